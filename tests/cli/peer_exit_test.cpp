// What a rank says when its peer is gone, against the real tool (issue 41,
// items 2 and 3): the surviving rank of a run whose rank 0 was killed or exited
// on its own error prints no C++ backtrace, no raw c10d line and no Gloo hint
// that contradicts the cause; a rank whose rank 0 never starts fails within
// --timeout (PyTorch 2.15's TCPStore client retried after a random back-off
// of up to the timeout: 31-35 s for 20 s), saying how long it waited.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "contrax/launch/launcher.h"
#include "support/cli.h"
#include "support/processes.h"

using contrax::testing::kCli;
using contrax::testing::kFastTrain;
using contrax::testing::read_file;

namespace {

// Small and quick: one thread per process, no evaluation.
const std::string kFast = kFastTrain + " --no-plot";

// The launcher's worker whose RANK is `rank` (from /proc), or -1.
pid_t worker_of(pid_t launcher, int rank) {
  std::ifstream children("/proc/" + std::to_string(launcher) + "/task/" + std::to_string(launcher) + "/children");
  pid_t c;
  while (children >> c) {
    std::ifstream env("/proc/" + std::to_string(c) + "/environ", std::ios::binary);
    std::string var;
    while (std::getline(env, var, '\0')) {
      if (var == "RANK=" + std::to_string(rank)) return c;
    }
  }
  return -1;
}

// What no line of a surviving rank may hold: a C++ backtrace, c10d's raw log
// lines, Gloo's guess at the cause.
void expect_no_raw_upstream_text(const std::string& out) {
  for (const char* bad : {"frame #", "TCPStore.cpp", "socket.cpp", "Exception raised from", "GLHF",
                          "typically caused by a remote worker crashing"}) {
    EXPECT_EQ(out.find(bad), std::string::npos) << "'" << bad << "' in:\n" << out;
  }
}

}  // namespace

// kill -9 of rank 0 while both ranks train (the issue's case: --max-steps 300
// --checkpoint-every 50). Before: rank 1 printed c10d's "[W ...
// TCPStore.cpp:106] sendBytes failed ... Broken pipe" and 11 stack frames
// from the thread that polls the store.
TEST(PeerExit, KilledRankZeroLeavesNoBacktraceOnRankOne) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  contrax::testing::TempDir t("contrax_peer_exit");
  const std::string run = t.path + "/run";
  const std::string args = " --nproc 2 --max-steps 300 --checkpoint-every 50 --run-dir " + run;
  const auto p = contrax::testing::spawn(kCli + " train " + kFast + args, t.path + "/out.txt");
  // Training has begun when both ranks passed a few steps.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (contrax::testing::count_lines(run + "/metrics.jsonl") < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const pid_t rank0 = worker_of(p.pid, 0);
  ASSERT_GT(rank0, 0) << read_file(p.out);
  ASSERT_EQ(::kill(rank0, SIGKILL), 0);
  const int status = contrax::testing::wait_for(p, std::chrono::seconds(120));
  const std::string out = read_file(p.out);
  std::cout << "FAULT kill -9 of rank 0 mid-run: launcher exit " << status << "\n";
  EXPECT_EQ(status, 128 + SIGKILL) << out;  // the rank's own end, passed on
  EXPECT_NE(out.find("contrax train: rank 0 was killed by signal 9"), std::string::npos) << out;
  expect_no_raw_upstream_text(out);
}

// Rank 0 exits on an error of its own (the testing aid CONTRAX_FAULT_EXIT_AT_STEP):
// before, rank 1 said "rank 0 ... did not answer (hung, stopped or dead);
// cause: Connection closed by peer ... This is typically caused by a remote
// worker crashing ... GLHF!", after c10d's raw recvValue line and backtrace.
TEST(PeerExit, RankZerosOwnErrorIsNotCalledACrashOnRankOne) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  contrax::testing::TempDir t("contrax_peer_exit");
  const auto r = contrax::testing::run_shell("CONTRAX_FAULT_EXIT_AT_STEP=4:0 " + kCli + " train " + kFast +
                                             " --nproc 2 --max-steps 20 --run-dir " + t.path + "/run 2>&1");
  std::cout << "FAULT rank 0 exits on its own error: exit " << r.status << "\n";
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("contrax train: rank 0 exited with status 1: contrax train: error: rank 0 failed before step 4"),
            std::string::npos)
      << r.out;
  expect_no_raw_upstream_text(r.out);
  // Rank 1, where it got to say anything, names rank 0 as ended, not as hung.
  const auto rank1 = r.out.find("failed on rank 1 of 2");
  if (rank1 != std::string::npos) {
    const std::string line = r.out.substr(rank1, r.out.find('\n', rank1) - rank1);
    EXPECT_NE(line.find("rank 0, which hosts the rendezvous store, has ended"), std::string::npos) << line;
  }
}

// A lone rank 1 (RANK=1 WORLD_SIZE=2, no rank 0) with --timeout 5: it fails
// within the timeout + 2 s of its start of the rendezvous, says how long it
// waited, and prints no raw c10d line before its own.
TEST(PeerExit, LoneRankOneFailsWithinTheTimeoutSayingHowLongItWaited) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  contrax::testing::TempDir t("contrax_peer_exit");
  const std::string env = "RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(contrax::find_free_port());
  const auto r = contrax::testing::run_shell(env + " " + kCli + " train " + kFast + " --max-steps 5 --timeout 5 " +
                                             "--run-dir " + t.path + "/run 2>&1");
  std::cout << "FAULT lone rank 1, --timeout 5: exit " << r.status << " after " << r.seconds << " s\n";
  EXPECT_EQ(r.status, 1) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("after waiting ([0-9]+) ms \\(timeout 5000 ms")))
      << r.out;
  const double waited = std::stod(m[1]) / 1000;
  EXPECT_GE(waited, 4.5) << r.out;
  EXPECT_LE(waited, 5.0 + 2.0) << r.out;
  // The whole process: the wait plus LibTorch's start-up (1-3 s on a loaded
  // 2-core machine); before, 10.8 s here for --timeout 5.
  EXPECT_LT(r.seconds, 5.0 + 2.0 + 3.0) << r.out;
  // Its own line is the only one: nothing of c10d's before it.
  EXPECT_EQ(r.out.find("[c10d]"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.rfind("contrax train: error: Communicator::create(): rank 1 could not reach", 0), 0u) << r.out;
  expect_no_raw_upstream_text(r.out);
}

// The debug switch: with TORCH_CPP_LOG_LEVEL set, c10d's own lines come back
// (rank 1's store calls after rank 0 exited, which are muted without it).
TEST(PeerExit, TorchCppLogLevelShowsC10dsOwnLines) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  contrax::testing::TempDir t("contrax_peer_exit");
  const auto r = contrax::testing::run_shell("TORCH_CPP_LOG_LEVEL=WARNING CONTRAX_FAULT_EXIT_AT_STEP=4:0 " + kCli +
                                             " train " + kFast + " --nproc 2 --max-steps 20 --run-dir " + t.path +
                                             "/run 2>&1");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("TCPStore.cpp"), std::string::npos) << "c10d's lines were muted: " << r.out;
}
