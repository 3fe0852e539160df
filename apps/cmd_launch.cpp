// `contrax launch`: torchrun's job for this project. Starts N local copies of a
// program with RANK/WORLD_SIZE/MASTER_ADDR/... set, prefixes their output with
// the rank, and stops all of them when one fails. The exit code is the failed
// rank's (or 128+signal), so a script can tell a crash from a clean exit.
//
//   contrax launch --nproc 4 -- ./my_job --epochs 3
//   contrax launch --nproc 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -- ./job
#include <c10/util/Exception.h>

#include <chrono>
#include <iostream>

#include "cli.h"
#include "contrax/launcher.h"

namespace {

int run_launch(const std::vector<std::string>& args) {
  contrax::cli::Args a("launch", args);
  contrax::LaunchOptions o;
  o.nproc = a.get_int("nproc", o.nproc, "worker processes on this node");
  o.master_addr = a.get("master-addr", o.master_addr, "host of the rank-0 rendezvous (MASTER_ADDR)");
  o.master_port = a.get_int("master-port", o.master_port, "rendezvous port (MASTER_PORT); 0 picks a free one");
  o.nnodes = a.get_int("nnodes", o.nnodes, "number of nodes, each running its own `contrax launch`");
  o.node_rank = a.get_int("node-rank", o.node_rank, "this node's index in [0, nnodes)");
  o.grace = std::chrono::milliseconds(
      a.get_int("grace-ms", o.grace.count(), "time between SIGTERM and SIGKILL when stopping workers"));
  o.prefix_output = !a.flag("no-prefix", "forward worker output as is, without '[rank N] '");
  if (a.finish()) {
    std::cout << "then: [--] PROGRAM ARGS...   (use '--' when the program's own arguments start with '--')\n";
    return 0;
  }
  // main() prefixes thrown messages with "contrax launch: error: ".
  TORCH_CHECK(!a.rest().empty(), "no PROGRAM given (usage: contrax launch --nproc N [flags] -- PROGRAM ARGS...)");

  contrax::LaunchResult r = contrax::launch(a.rest(), o);
  if (r.exit_code != 0) {
    std::cerr << "contrax launch: " << r.message << "\n";
    return r.exit_code;
  }
  return 0;
}

contrax::cli::Command launch_cmd("launch", "run N local worker processes with the torchrun environment", run_launch);

}  // namespace
