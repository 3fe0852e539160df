// Torchrun's and SLURM's environment (see comm/environment.h).
#include "comm/environment.h"

#include <cstdlib>
#include <string>

#include "contrax/comm/slurm.h"
#include "util/env.h"

namespace contrax::detail {

namespace {

bool is_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

int64_t env_int(const char* name, int64_t def, const char* expected) {
  return detail::env_int(name, def, expected, "Communicator::from_env()");
}

// MASTER_ADDR, or under SLURM the first host of the job's node list.
std::string master_addr(bool slurm, int64_t world) {
  const char* addr = std::getenv("MASTER_ADDR");
  std::string master = addr != nullptr ? addr : "";
  if (slurm && master.empty()) {
    const char* list = std::getenv("SLURM_JOB_NODELIST");
    if (list == nullptr || *list == '\0') list = std::getenv("SLURM_NODELIST");
    TORCH_CHECK(list != nullptr && *list != '\0', "Communicator::from_env(): under SLURM (SLURM_NTASKS=", world,
                ") either MASTER_ADDR or SLURM_JOB_NODELIST must be set");
    const auto hosts = expand_slurm_nodelist(list);
    TORCH_CHECK(!hosts.empty(), "Communicator::from_env(): SLURM_JOB_NODELIST '", list, "' names no host");
    master = hosts.front();
  }
  TORCH_CHECK(!master.empty(),
              "Communicator::from_env(): environment variable 'MASTER_ADDR' must be set when WORLD_SIZE > 1");
  return master;
}

// MASTER_PORT, or under SLURM 29500 + (SLURM_JOB_ID mod 1000), so that two
// jobs sharing a node do not collide.
int64_t master_port(bool slurm) {
  if (slurm && std::getenv("MASTER_PORT") == nullptr) {
    const char* job = std::getenv("SLURM_JOB_ID");
    if (job == nullptr || *job == '\0') return 29500;
    char* end = nullptr;
    const unsigned long long id = std::strtoull(job, &end, 10);
    return end != job && *end == '\0' ? 29500 + static_cast<int64_t>(id % 1000) : 29500;
  }
  TORCH_CHECK(std::getenv("MASTER_PORT") != nullptr,
              "Communicator::from_env(): environment variable 'MASTER_PORT' must be set when WORLD_SIZE > 1");
  return env_int("MASTER_PORT", 0, "a port number");
}

}  // namespace

JobEnvironment job_environment(const CommunicatorOptions& base) {
  // torchrun's variables win; SLURM's are the fallback, so that `srun` starts
  // a job without a launcher and a launcher inside an allocation still works.
  const bool slurm = !is_set("WORLD_SIZE") && is_set("SLURM_NTASKS");
  const char* world_var = slurm ? "SLURM_NTASKS" : "WORLD_SIZE";
  const char* rank_var = slurm ? "SLURM_PROCID" : "RANK";
  const char* local_var = slurm ? "SLURM_LOCALID" : "LOCAL_RANK";
  const int64_t world = env_int(world_var, 1, "a positive integer");
  TORCH_CHECK(world >= 1, "Communicator::from_env(): environment variable '", world_var,
              "' must be a positive integer, but got ", world);
  const int64_t rank = env_int(rank_var, 0, "an integer in [0, WORLD_SIZE)");
  TORCH_CHECK(rank >= 0 && rank < world, "Communicator::from_env(): environment variable '", rank_var,
              "' must be in [0, ", world, "), but got ", rank);
  JobEnvironment env{base, env_int(local_var, rank, "a non-negative integer")};
  env.options.rank(rank).world_size(world);
  if (!slurm) env.local_world_size = env_int("LOCAL_WORLD_SIZE", -1, "a positive integer");
  if (world == 1) return env;
  env.options.master_addr(master_addr(slurm, world)).master_port(master_port(slurm));
  if (const char* secret = std::getenv("CONTRAX_JOB_SECRET")) env.options.job_secret(secret);
  // torchrun's agent serves the store on MASTER_ADDR:MASTER_PORT and says so;
  // it keeps serving it across restarts, so each attempt has its own keys.
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  if (agent != nullptr && std::string(agent) == "True") {
    const int64_t attempt = env_int("TORCHELASTIC_RESTART_COUNT", 0, "a non-negative integer");
    env.options.external_store(true).store_prefix("contrax/attempt_" + std::to_string(attempt) + "/");
  }
  return env;
}

}  // namespace contrax::detail
