// Where the environment puts a process in a job, parsed without a process
// group (issue 26): SLURM's compressed host lists (contrax/comm/slurm.h) and the
// job environment behind Communicator::from_env (src/comm/environment.h),
// SLURM's variables and torchrun's, including a world of 4 that no test could
// start. Every error message of both is checked here.
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm/environment.h"
#include "contrax/comm/slurm.h"
#include "support/errors.h"

using namespace contrax;

namespace {

const std::vector<const char*> kJobVars = {"WORLD_SIZE",         "RANK",         "LOCAL_RANK",
                                           "MASTER_ADDR",        "MASTER_PORT",  "TORCHELASTIC_USE_AGENT_STORE",
                                           "TORCHELASTIC_RESTART_COUNT",         "SLURM_NTASKS",
                                           "SLURM_PROCID",       "SLURM_LOCALID", "SLURM_JOB_ID",
                                           "SLURM_JOB_NODELIST", "SLURM_NODELIST"};

void clear_job_environment() {
  for (const char* v : kJobVars) ::unsetenv(v);
}

}  // namespace

TEST(Slurm, NodelistExpansion) {
  EXPECT_EQ(expand_slurm_nodelist("node[01-04,07]"),
            (std::vector<std::string>{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_slurm_nodelist("gpu5,cpu[8-10],login"),
            (std::vector<std::string>{"gpu5", "cpu8", "cpu9", "cpu10", "login"}));
  EXPECT_EQ(expand_slurm_nodelist("r[1-2]-n[09-10]"),
            (std::vector<std::string>{"r1-n09", "r1-n10", "r2-n09", "r2-n10"}));
  EXPECT_EQ(expand_slurm_nodelist("single"), (std::vector<std::string>{"single"}));
  EXPECT_EQ(expand_slurm_nodelist(",a,,b,"), (std::vector<std::string>{"a", "b"}));  // empty entries skipped
  EXPECT_TRUE(expand_slurm_nodelist("").empty());
}

TEST(Slurm, NodelistErrorsNameTheList) {
  CONTRAX_EXPECT_ERROR(expand_slurm_nodelist("node[01-"), "expand_slurm_nodelist(): unbalanced brackets in 'node[01-'");
  CONTRAX_EXPECT_ERROR(expand_slurm_nodelist("n[1[2]]"),
                       "expand_slurm_nodelist(): unbalanced or nested brackets in 'n[1[2]]'");
  CONTRAX_EXPECT_ERROR(expand_slurm_nodelist("n]1["),
                       "expand_slurm_nodelist(): unbalanced or nested brackets in 'n]1['");
  CONTRAX_EXPECT_ERROR(expand_slurm_nodelist("node[5-2]"), "range '5-2' in 'node[5-2]' is descending");
  CONTRAX_EXPECT_ERROR(expand_slurm_nodelist("node[a-b]"), "range 'a-b' in 'node[a-b]' is not N or N-M");
  CONTRAX_EXPECT_ERROR(expand_slurm_nodelist("node[1-]"), "range '1-' in 'node[1-]' is not N or N-M");
  // A corrupt range must not allocate without bound: at most 2^20 hosts.
  CONTRAX_EXPECT_ERROR(expand_slurm_nodelist("n[0-99999999]"), "range '0-99999999' in 'n[0-99999999]' is too long");
  CONTRAX_EXPECT_ERROR(expand_slurm_nodelist("n[0-1024]-m[0-1023]"),
                       "expand_slurm_nodelist(): 'n[0-1024]-m[0-1023]' names too many hosts");
}

TEST(Slurm, JobEnvironmentIsParsedWithoutAProcessGroup) {
  clear_job_environment();
  ::setenv("SLURM_NTASKS", "4", 1);
  ::setenv("SLURM_PROCID", "3", 1);
  ::setenv("SLURM_LOCALID", "1", 1);
  ::setenv("SLURM_JOB_ID", "123456", 1);
  ::setenv("SLURM_JOB_NODELIST", "gpu[07-08],login", 1);
  auto env = contrax::detail::job_environment(CommunicatorOptions().timeout(std::chrono::seconds(3)));
  EXPECT_EQ(env.options.world_size(), 4);
  EXPECT_EQ(env.options.rank(), 3);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.options.master_addr(), "gpu07");      // the first host of the list
  EXPECT_EQ(env.options.master_port(), 29500 + 456);  // 29500 + SLURM_JOB_ID mod 1000
  EXPECT_EQ(env.options.timeout(), std::chrono::milliseconds(3000));  // the base's other fields are kept
  EXPECT_FALSE(env.options.external_store());
  // SLURM_NODELIST when SLURM_JOB_NODELIST is unset; no SLURM_JOB_ID: port 29500.
  ::unsetenv("SLURM_JOB_NODELIST");
  ::unsetenv("SLURM_JOB_ID");
  ::setenv("SLURM_NODELIST", "cpu[3-4]", 1);
  env = contrax::detail::job_environment(CommunicatorOptions());
  EXPECT_EQ(env.options.master_addr(), "cpu3");
  EXPECT_EQ(env.options.master_port(), 29500);
  // MASTER_ADDR and MASTER_PORT win over SLURM's defaults.
  ::setenv("MASTER_ADDR", "10.1.2.3", 1);
  ::setenv("MASTER_PORT", "31000", 1);
  env = contrax::detail::job_environment(CommunicatorOptions());
  EXPECT_EQ(env.options.master_addr(), "10.1.2.3");
  EXPECT_EQ(env.options.master_port(), 31000);
  // torchrun's variables win over SLURM's; its agent's store has a key prefix per attempt.
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "1", 1);
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  env = contrax::detail::job_environment(CommunicatorOptions());
  EXPECT_EQ(env.options.world_size(), 2);
  EXPECT_EQ(env.options.rank(), 1);
  EXPECT_EQ(env.local_rank, 1);  // LOCAL_RANK unset: the rank
  EXPECT_TRUE(env.options.external_store());
  EXPECT_EQ(env.options.store_prefix(), "contrax/attempt_2/");
  // A world of 1 needs no address.
  clear_job_environment();
  ::setenv("SLURM_NTASKS", "1", 1);
  env = contrax::detail::job_environment(CommunicatorOptions());
  EXPECT_EQ(env.options.world_size(), 1);
  EXPECT_EQ(env.options.rank(), 0);
  clear_job_environment();
}

TEST(Slurm, JobEnvironmentErrorsNameTheVariable) {
  clear_job_environment();
  // The job environment as set so far is refused with `text`.
  const auto refused = [](const std::string& text) {
    CONTRAX_EXPECT_ERROR(contrax::detail::job_environment(CommunicatorOptions()), text);
  };
  ::setenv("SLURM_NTASKS", "0", 1);
  refused("Communicator::from_env(): environment variable 'SLURM_NTASKS' must be a positive integer, but got 0");
  ::setenv("SLURM_NTASKS", "2", 1);
  ::setenv("SLURM_PROCID", "x", 1);
  refused("environment variable 'SLURM_PROCID' must be an integer in [0, WORLD_SIZE), but got 'x'");
  ::setenv("SLURM_PROCID", "1", 1);
  refused("under SLURM (SLURM_NTASKS=2) either MASTER_ADDR or SLURM_JOB_NODELIST must be set");
  ::setenv("SLURM_JOB_NODELIST", ",,", 1);
  refused("Communicator::from_env(): SLURM_JOB_NODELIST ',,' names no host");
  ::setenv("SLURM_JOB_NODELIST", "n[2-1]", 1);
  refused("range '2-1' in 'n[2-1]' is descending");
  ::setenv("SLURM_JOB_NODELIST", "n1", 1);
  ::setenv("MASTER_PORT", "http", 1);
  refused("environment variable 'MASTER_PORT' must be a port number, but got 'http'");
  ::unsetenv("MASTER_PORT");
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "one", 1);
  refused("environment variable 'TORCHELASTIC_RESTART_COUNT' must be a non-negative integer, but got 'one'");
  ::setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
  ::setenv("SLURM_LOCALID", "-", 1);
  refused("environment variable 'SLURM_LOCALID' must be a non-negative integer, but got '-'");
  clear_job_environment();
}
