// Where the environment puts this process in a job: torchrun's variables
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, the agent's store),
// else SLURM's (SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, the first host of
// SLURM_JOB_NODELIST, a port from SLURM_JOB_ID). The parsing behind
// Communicator::from_env, apart from building anything, so that it can be
// tested without a process group. Internal to src/comm/, not installed.
#pragma once

#include <cstdint>

#include "contrax/comm/communicator.h"

namespace contrax::detail {

/// The communicator options the environment gives (`base` with rank, world
/// size, address and port set, and torchrun's agent store when it serves one)
/// and the local rank. Errors name the variable, as Communicator::from_env's.
struct JobEnvironment {
  CommunicatorOptions options;
  int64_t local_rank = 0;
  /// LOCAL_WORLD_SIZE (torchrun's ranks on this machine), or -1 when unset.
  int64_t local_world_size = -1;
};
JobEnvironment job_environment(const CommunicatorOptions& base);

}  // namespace contrax::detail
