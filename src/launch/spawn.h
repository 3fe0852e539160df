// Spawning a worker: its torchrun environment, and fork + exec with its output
// on pipes, in its own process group (so that a worker and whatever it
// spawned go down together), with no stdin, and dying with the launcher.
// Internal to the launcher (src/launch/), not installed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "contrax/launch/launcher.h"
#include "launch/signals.h"
#include "launch/worker.h"

namespace contrax::detail {

/// The variable that tells a worker where to record its failure
/// (record_worker_failure).
constexpr const char* kErrorFileVar = "CONTRAX_ERROR_FILE";
/// The job's secret (CommunicatorOptions::job_secret): the user's, or one the
/// launcher makes for a one-node job.
constexpr const char* kJobSecretVar = "CONTRAX_JOB_SECRET";

/// This process's environment without the variables the launcher owns, plus
/// RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
/// MASTER_PORT, TORCHELASTIC_RESTART_COUNT (`restart`), CONTRAX_JOB_SECRET
/// (`secret`, when not empty) and, when `error_file` is set,
/// CONTRAX_ERROR_FILE.
std::vector<std::string> worker_environment(const LaunchOptions& o, int64_t local_rank, int64_t port,
                                            int64_t restart, const std::string& error_file,
                                            const std::string& secret);

/// Forks and execs `argv` with `env` as `w` (rank, error file and log file
/// already set; its pid, running state and read ends filled in here).
/// `signals`: the launcher's, reset in the child. Returns the errno of a
/// failed exec, 0 on success; throws when no pipe or process can be made.
int spawn(Worker& w, const std::vector<std::string>& argv, const std::vector<std::string>& env,
          const SignalPipe& signals);

}  // namespace contrax::detail
