// Launching local worker processes with torchrun's environment.
//
// `launch` starts N copies of a program with RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, forwards their output
// prefixed with the rank, and supervises them: when one fails, the others are
// stopped (SIGTERM, then SIGKILL after a grace period) and the result names the
// failed rank and how it ended. SIGINT/SIGTERM sent to the launcher are
// forwarded to every worker. Multi-node jobs set the same variables by hand
// (or through a scheduler) and need no launcher.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace contrax {

/// Options for `launch`. Defaults: 1 process, rendezvous on 127.0.0.1 at a
/// free port, 10 s grace between SIGTERM and SIGKILL, rank-prefixed output.
struct LaunchOptions {
  int64_t nproc = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 0;  // 0: pick a free port
  /// Multi-node: this node's index and the node count; ranks are
  /// node_rank * nproc + local_rank, world size nnodes * nproc.
  int64_t node_rank = 0;
  int64_t nnodes = 1;
  std::chrono::milliseconds grace{10000};
  bool prefix_output = true;
  /// Non-empty: each rank's output also goes to DIR/rank_<R>.log (one file
  /// per rank), as torchrun's --log-dir. Empty: no log files.
  std::string log_dir;
  /// Restart all workers up to this many times after a worker fails (the
  /// program resumes itself, e.g. `contrax train --resume auto`). 0: never.
  int64_t max_restarts = 0;
};

/// How a launch ended.
struct LaunchResult {
  int exit_code = 0;        // 0 when all workers succeeded
  int64_t failed_rank = -1; // first rank seen failing, -1 if none
  std::string message;      // e.g. "rank 1 exited with status 3"
};

/// Runs `argv` (argv[0] is the program, looked up in PATH if it has no '/')
/// as `options.nproc` workers and waits for all of them. Never throws for a
/// worker's failure (that is in the result); throws c10::Error for bad options
/// or when the program cannot be started.
LaunchResult launch(const std::vector<std::string>& argv, const LaunchOptions& options);

/// A free TCP port on `addr` (bound and released; racy by nature but fine locally).
int64_t find_free_port(const std::string& addr = "127.0.0.1");

/// True when this process already runs under a launcher or scheduler
/// (WORLD_SIZE is set in the environment).
bool in_launched_worker();

/// The absolute path of the running executable (/proc/self/exe).
std::string self_executable();

}  // namespace contrax
