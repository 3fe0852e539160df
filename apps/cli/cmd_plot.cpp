// `contrax plot RUN_DIR`: (re)draws RUN_DIR/curves.png from its metrics.jsonl
// (loss, learning rate and throughput against the step) with python3 and
// matplotlib, through the same script `contrax train` runs at the end.
//
//   contrax plot runs/simclr
#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/plot.h"

namespace {

int run_plot(const std::vector<std::string>& args) {
  namespace cli = contrax::cli;
  CLI::App app{"draw RUN_DIR/curves.png (loss, lr, examples/s against steps) from its metrics.jsonl", "plot"};
  cli::setup_app(app);
  std::string dir;
  app.add_option("RUN_DIR", dir, "a run directory of contrax train")->required();
  if (int st = cli::parse(app, args); st >= 0) return st;
  return cli::plot_run(dir, /*quiet=*/false);
}

contrax::cli::Command plot_cmd("plot", "draw RUN_DIR/curves.png from a run's metrics (matplotlib)", run_plot);

}  // namespace
