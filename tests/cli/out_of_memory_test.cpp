// Tests that an out-of-memory kill is named: the memory limit is read from
// cgroup v2 and v1 files (own cgroup and ancestors, the tightest wins; v1's
// "unlimited" is no limit), the killer's counters from memory.events,
// memory.oom_control and /proc/vmstat; a rank that the kernel's
// out-of-memory killer ends is reported as such, with the limit and what the
// rank said it was doing, by the launcher and by `contrax train` at
// --nproc 1 (in its evaluation) and --nproc 2. The real kills need a v1
// memory cgroup that this process can make (root); they skip otherwise.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "contrax/launch/launcher.h"
#include "support/cli.h"
#include "support/processes.h"
#include "util/cgroup.h"

namespace fs = std::filesystem;
using contrax::testing::TempDir;

namespace {

void put(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << text;
}

// A v1 memory cgroup under this process's own, with memory.limit_in_bytes
// `limit`, removed at scope exit; `path` is empty (and `reason` says why)
// where none can be made.
struct MemoryCgroup {
  explicit MemoryCgroup(int64_t limit) {
    const auto dirs = contrax::detail::cgroup_dirs("memory", /*ancestors=*/false);
    if (dirs.empty()) {
      reason = "no v1 memory cgroup hierarchy is mounted here";
      return;
    }
    path = dirs.front() + "/contrax_oom_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
    std::error_code ec;
    fs::create_directory(path, ec);
    if (ec || !fs::exists(path + "/memory.limit_in_bytes")) {
      reason = "cannot make a memory cgroup under " + dirs.front() + (ec ? ": " + ec.message() : std::string());
      path.clear();
      return;
    }
    std::ofstream(path + "/memory.limit_in_bytes") << limit;
  }
  ~MemoryCgroup() {
    if (path.empty()) return;
    for (int i = 0; i < 100 && ::rmdir(path.c_str()) != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // A shell command run inside the cgroup (the shell moves itself there, then runs it).
  contrax::testing::CliRun run(const std::string& cmd) const {
    return contrax::testing::run_shell("sh -c 'echo $$ > " + path + "/cgroup.procs && exec " + cmd + "' 2>&1");
  }
  std::string path, reason;
  static inline int counter = 0;
};

}  // namespace

TEST(OutOfMemory, LimitsAndKillsAreReadFromCgroupV2AndV1Files) {
  TempDir tmp;
  const std::string v2 = tmp.path + "/v2/job", v2_parent = tmp.path + "/v2";
  put(v2 + "/memory.max", "max\n");
  put(v2 + "/memory.current", "1048576\n");
  put(v2 + "/memory.events", "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n");
  put(v2_parent + "/memory.max", "629145600\n");
  put(v2_parent + "/memory.current", "104857600\n");
  put(v2_parent + "/memory.events", "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\n");
  const std::string v1 = tmp.path + "/v1/job";
  put(v1 + "/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  put(v1 + "/memory.usage_in_bytes", "5000\n");
  put(v1 + "/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n");
  put(tmp.path + "/vmstat", "pgfault 10\noom_kill 7\n");
  using contrax::detail::memory_limit_of;
  // v2: the parent's limit binds (its child has none).
  auto m = memory_limit_of({v2, v2_parent}, {});
  EXPECT_EQ(m.limit, 629145600);
  EXPECT_EQ(m.used, 104857600);
  EXPECT_EQ(m.file, v2_parent + "/memory.max");
  // v1's near-2^63 is no limit.
  m = memory_limit_of({}, {v1});
  EXPECT_EQ(m.limit, -1);
  put(v1 + "/memory.limit_in_bytes", "314572800\n");
  m = memory_limit_of({v2, v2_parent}, {v1});
  EXPECT_EQ(m.limit, 314572800) << "the tightest of both hierarchies";
  EXPECT_EQ(m.file, v1 + "/memory.limit_in_bytes");
  const auto k = contrax::detail::oom_kills_of({v2, v2_parent}, {v1}, tmp.path + "/vmstat");
  EXPECT_EQ(k.cgroup, 5);
  EXPECT_EQ(k.machine, 7);
}

TEST(OutOfMemory, TheLauncherNamesTheKillerTheLimitAndTheRanksNote) {
  // Above the launcher's own memory: `contrax launch` holds about 190 MiB
  // of anonymous memory once LibTorch is loaded (PyPI torch 2.15).
  MemoryCgroup cg(512 << 20);
  if (cg.path.empty()) GTEST_SKIP() << cg.reason;
  const auto r = cg.run(std::string(CONTRAX_CLI_PATH) + " launch --nproc 2 -- " + CONTRAX_TEST_PROGRAM_DIR +
                        "/launcher_probe hog");
  EXPECT_EQ(r.status, 137) << r.out;
  EXPECT_NE(r.out.find("rank 1 was killed by the out-of-memory killer: the memory limit is 512 MiB (" + cg.path +
                       "/memory.limit_in_bytes; "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("; the rank was allocating 16 MiB blocks until it is stopped"), std::string::npos) << r.out;
}

TEST(OutOfMemory, AnotherSigkillIsNotCalledOutOfMemory) {
  // The same launcher, a rank killed by SIGKILL from outside: the killer's
  // counters did not move, so the message stays the signal's.
  TempDir tmp;
  const auto r = contrax::testing::run_shell(std::string(CONTRAX_CLI_PATH) + " launch --nproc 3 -- " +
                                             CONTRAX_TEST_PROGRAM_DIR + "/launcher_probe signal " + tmp.path + " 2>&1");
  EXPECT_EQ(r.status, 137) << r.out;
  EXPECT_NE(r.out.find("rank 2 was killed by signal 9 (Killed)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("out-of-memory"), std::string::npos) << r.out;
}

TEST(OutOfMemory, TheToolNamesItInTrainingAndInTheEvaluation) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  struct Case {
    int64_t limit_mib;
    std::string flags, phase;
  };
  // Measured on PyPI torch 2.15.0 with the tool loading LibTorch's CPU
  // libraries only (2026-11-30, AMD EPYC, 2 cores; each limit in the middle
  // of the range that kills where the case says, every limit run 5-6 times).
  // At --nproc 1 a run of 2,048 examples in batches of 1,024 is refused by
  // the tool's check of a step's memory up to 340 MiB, killed in its
  // training from 345 to 455 MiB and trained from 470 MiB; a run of 512
  // examples is killed in its evaluation (60,000 + 10,000 images) from 160
  // MiB to beyond 1,100. At --nproc 2 a run of 512 examples in batches of 64
  // trains from 250 MiB and is killed in rank 0's evaluation up to 1,100
  // MiB. (A rank killed in its training at --nproc 2 was no case to test:
  // the window between the check refusing, which counts what the other
  // rank holds at that moment, and the step fitting was 285-315 MiB and
  // moved from run to run.)
  for (const Case& c :
       {Case{400, "--batch-size 1024 --nproc 1 --train-limit 2048 --no-eval", "training: a step needs about "},
        Case{650, "--batch-size 64 --nproc 1 --train-limit 512", "evaluating the trained model"},
        Case{600, "--batch-size 64 --nproc 2 --train-limit 512", "evaluating the trained model"}}) {
    MemoryCgroup cg(c.limit_mib << 20);
    if (cg.path.empty()) GTEST_SKIP() << cg.reason;
    const std::string run = contrax::testing::scratch_path("oom_" + std::to_string(c.limit_mib));
    const auto r = cg.run(std::string(CONTRAX_CLI_PATH) + " train --threads 1 --max-steps 3 " +
                          "--warmup-steps 1 --no-verify --no-plot --run-dir " + run + " " + c.flags);
    EXPECT_EQ(r.status, 137) << c.flags << ": " << r.out;
    EXPECT_NE(r.out.find("was killed by the out-of-memory killer: the memory limit is " +
                         std::to_string(c.limit_mib) + " MiB ("),
              std::string::npos)
        << c.flags << ": " << r.out;
    EXPECT_NE(r.out.find("; the rank was " + c.phase), std::string::npos) << c.flags << ": " << r.out;
  }
}
