// `contrax launch`: torchrun's job for this project. Starts N local copies of a
// program with RANK/WORLD_SIZE/MASTER_ADDR/... set, prefixes their output with
// the rank, and stops all of them when one fails. The exit code is the failed
// rank's (or 128+signal), so a script can tell a crash from a clean exit.
//
//   contrax launch --nproc 4 -- ./my_job --epochs 3
//   contrax launch --nproc-per-node 4 --log-dir logs --max-restarts 1 -- contrax train --resume auto
//   contrax launch --nproc 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -- ./job
#include <algorithm>
#include <chrono>
#include <iostream>

#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/machine.h"
#include "contrax/launch/launcher.h"

namespace {

int run_launch(const std::vector<std::string>& args) {
  namespace cli = contrax::cli;
  // The program and its arguments follow the first "--", or the first word
  // that is not a flag; CLI11 sees only what comes before.
  std::vector<std::string> flags = args, program;
  if (auto dd = std::find(args.begin(), args.end(), "--"); dd != args.end()) {
    flags.assign(args.begin(), dd);
    program.assign(dd + 1, args.end());
  }
  CLI::App app{"run N local worker processes with the torchrun environment", "launch"};
  cli::setup_app(app);
  app.prefix_command();  // without "--": the first word that is no flag starts the program
  app.footer("then: [--] PROGRAM ARGS...   (use '--' when the program's own arguments start with '-')");
  contrax::LaunchOptions o;
  int64_t grace_ms = o.grace.count();
  bool no_prefix = false, force = false, standalone = false;
  // torchrun's names are aliases, so its command lines work unchanged.
  cli::add_int(app, "--nproc,--nproc-per-node,--nproc_per_node", o.nproc, "worker processes on this node", 1);
  cli::add_int(app, "--nnodes", o.nnodes, "number of nodes, each running its own `contrax launch`", 1, 1 << 20);
  cli::add_int(app, "--node-rank,--node_rank", o.node_rank, "this node's index in [0, nnodes)", 0, 1 << 20);
  app.add_option("--master-addr,--master_addr", o.master_addr, "host of the rank-0 rendezvous (MASTER_ADDR)");
  cli::add_int(app, "--master-port,--master_port", o.master_port, "rendezvous port (MASTER_PORT); 0 picks a free one",
               0, 65535);
  app.add_flag("--standalone", standalone,
               "single node on 127.0.0.1 with a free port (as torchrun's --standalone); excludes --nnodes > 1");
  cli::add_int(app, "--grace-ms", grace_ms, "time between SIGTERM and SIGKILL when stopping workers", 0,
               int64_t{24} * 3600 * 1000);
  app.add_option("--log-dir,--log_dir", o.log_dir, "also write each rank's output to DIR/rank_<R>.log");
  cli::add_int(app, "--max-restarts,--max_restarts", o.max_restarts,
               "restart all workers up to N times after a failure (the program resumes itself)", 0, 1000);
  app.add_flag("--no-prefix", no_prefix, "forward worker output as is, without '[rank N] '");
  cli::add_force(app, force);
  if (int st = cli::parse(app, flags); st >= 0) return st;
  // Prefix mode hands back everything from the first word it does not know:
  // an unknown flag there is a mistake, not the program.
  const std::vector<std::string> rest = app.remaining();
  if (!rest.empty()) {
    cli::usage_check(rest.front().rfind("-", 0) != 0, "unknown flag '", rest.front(), "'");
    cli::usage_check(program.empty(), "unexpected word '", rest.front(), "' before '--' (the program follows '--')");
    program = rest;
  }
  o.grace = std::chrono::milliseconds(grace_ms);
  o.prefix_output = !no_prefix;
  cli::check_procs("--nproc", o.nproc, force);
  cli::usage_check(o.node_rank < o.nnodes, "flag '--node-rank' must be in [0, --nnodes = ", o.nnodes, "), but got ",
                   o.node_rank);
  if (standalone) {
    cli::usage_check(o.nnodes == 1, "flag '--standalone' runs one node, but got --nnodes ", o.nnodes);
    o.master_addr = "127.0.0.1";
    o.master_port = 0;
  }
  cli::usage_check(!program.empty(), "no PROGRAM given (usage: contrax launch --nproc N [flags] -- PROGRAM ARGS...)");

  contrax::LaunchResult r = contrax::launch(program, o);
  if (r.exit_code != 0) {
    std::cerr << "contrax launch: " << r.message << "\n";
    return r.exit_code;
  }
  return 0;
}

contrax::cli::Command launch_cmd("launch", "run N local worker processes with the torchrun environment", run_launch);

}  // namespace
