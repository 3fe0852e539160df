// Launching local worker processes with torchrun's environment.
//
// `launch` starts N copies of a program with RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, forwards their output
// prefixed with the rank, and supervises them: when one fails, the others are
// stopped (SIGTERM, then SIGKILL after a grace period) and the result names the
// failed rank and how it ended. SIGINT/SIGTERM sent to the launcher are
// forwarded to every worker. Multi-node jobs may set the variables themselves
// (or through a scheduler) and need no launcher.
//
// Which rank failed first: a failing rank takes its peers down (their
// collectives fail once its process group is gone), and a peer often exits
// first. So each worker gets CONTRAX_ERROR_FILE, where the communicator records
// with a monotonic time stamp whether the rank began failing on its own or in a
// collective with its peers; the launcher names the earliest rank that failed
// on its own, with the last line it wrote to stderr as the reason.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace contrax {

/// Options for `launch`. Defaults: 1 process, rendezvous on 127.0.0.1 at a
/// free port, 10 s grace between SIGTERM and SIGKILL, rank-prefixed output.
struct LaunchOptions {
  int64_t nproc = 1;                      ///< worker processes on this node
  std::string master_addr = "127.0.0.1";  ///< the rendezvous (rank 0's host), the workers' MASTER_ADDR
  int64_t master_port = 0;                ///< the rendezvous's port, MASTER_PORT (0: a free port)
  /// Multi-node: this node's index; ranks are node_rank * nproc + local_rank,
  /// world size nnodes * nproc.
  int64_t node_rank = 0;
  int64_t nnodes = 1;                      ///< number of nodes
  std::chrono::milliseconds grace{10000};  ///< time between SIGTERM and SIGKILL when the workers are stopped
  bool prefix_output = true;               ///< prefix every line a worker prints with its rank
  /// Non-empty: every rank's whole output (stdout and stderr, unprefixed) also
  /// goes to `DIR/rank_<rank>.log` (created, truncated at the start of the launch,
  /// appended to across restarts). The directory is created if missing.
  std::string log_dir;
  /// After a failure, stop all workers and start them all again, up to this
  /// many times (torchrun's --max-restarts). A run that checkpoints and is
  /// started with `--resume auto` continues from its last checkpoint. An
  /// interruption by SIGINT/SIGTERM is never restarted.
  int64_t max_restarts = 0;
};

/// How a launch ended.
struct LaunchResult {
  /// The exit status of the failing worker (128 + N when it was killed by
  /// signal N), or 128 + N when the launch was interrupted by signal N; 0 when
  /// all workers succeeded.
  int exit_code = 0;
  /// The rank whose failure ended the launch (the root cause when one is
  /// found, else the first seen failing); -1 if none.
  int64_t failed_rank = -1;
  std::string message;   ///< what went wrong, for the user: "rank 1 exited with status 3: error: ..."
  int64_t restarts = 0;  ///< how many times all workers were restarted (see `max_restarts`)
};

/// Runs `argv` (argv[0] is the program, looked up in PATH if it has no '/')
/// as `options.nproc` workers and waits for all of them. Never throws for a
/// worker's failure (that is in the result); throws c10::Error for bad options
/// or when the program cannot be started.
LaunchResult launch(const std::vector<std::string>& argv, const LaunchOptions& options);

/// A free TCP port on `addr` (bound and released; racy by nature but fine locally).
int64_t find_free_port(const std::string& addr = "127.0.0.1");

/// True when this process already runs under a launcher or scheduler
/// (WORLD_SIZE is set in the environment, or it is a task of a SLURM job step:
/// SLURM_NTASKS, SLURM_PROCID and SLURM_STEP_ID set, as `srun` does).
bool in_launched_worker();

/// The absolute path of the running executable (/proc/self/exe).
std::string self_executable();

/// For the launcher that started this process (CONTRAX_ERROR_FILE; a no-op
/// without it): records that this rank is failing, when, and whether the
/// cause is its own (`caused_by_peer` false) or a failed collective with its
/// peers. Only the first record of a process counts; never throws. Called by
/// the communicator; a program may call it where it catches its own error.
///
///   contrax::record_worker_failure(false, e.what());
void record_worker_failure(bool caused_by_peer, const std::string& what) noexcept;

/// For the launcher that started this process (a no-op without one): what
/// this rank is doing and the memory it expects to need, quoted should the
/// kernel's out-of-memory killer end the rank ("rank 0 was killed by the
/// out-of-memory killer: the memory limit is 600 MiB (...); the rank was
/// training: a step needs about ..."). A later note replaces an earlier one;
/// never throws.
///
///   contrax::note_worker_memory("evaluating the trained encoder");
void note_worker_memory(const std::string& what) noexcept;

}  // namespace contrax
