// `contrax train` under torchrun, PyTorch's own launcher (TorchElastic):
//
//   * torchrun's agent serves the rendezvous store and says so with
//     TORCHELASTIC_USE_AGENT_STORE=True; every rank, rank 0 included, must
//     connect to it (before: rank 0 failed with "the port is in use");
//   * --max-restarts 1 with a worker that fails once, and `--resume auto`:
//     the restarted attempt resumes from the last checkpoint and the loss
//     curve equals an uninterrupted run's, bit for bit;
//   * two nodes (two network namespaces) with the c10d rendezvous backend:
//     the fp64 curve equals the single-node one.
//
// torchrun is the build's Python's `-m torch.distributed.run`; skipped with
// the reason where that Python has no torch.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "support/cli.h"
#include "support/processes.h"

namespace fs = std::filesystem;
using namespace contrax::testing;

namespace {

std::string torchrun() { return std::string(CONTRAX_TEST_PYTHON) + " -m torch.distributed.run"; }

// Why torchrun cannot run here ("" when it can).
std::string skip_reason() {
  if (std::string(CONTRAX_TEST_PYTHON).empty()) return "the build found no Python interpreter";
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    return "dataset-fashion-mnist is not installed";
  auto r = run_shell(std::string(CONTRAX_TEST_PYTHON) + " -c 'import torch.distributed.run' 2>&1");
  if (r.status != 0) return "the build's Python cannot import torch.distributed.run: " + r.out;
  // Debian's torch 2.6 is built without libuv, and its torchrun asks for a
  // libuv store whatever the rendezvous backend: it cannot start anything.
  r = run_shell(torchrun() + " --standalone --nproc-per-node 1 --no-python true 2>&1");
  if (r.status != 0 && r.out.find("without libuv support") != std::string::npos)
    return "this torch's torchrun cannot start workers: it asks for a libuv store, and this torch is built without "
           "libuv (Debian's 2.6)";
  return "";
}

// 12 steps, a checkpoint every 4, one thread per process (the interrupted and
// the uninterrupted runs then compute alike).
std::string train_flags(const std::string& run_dir, const std::string& extra = "") {
  return "train --threads 1 --train-limit 256 --batch-size 64 --max-steps 12 --warmup-steps 2 --checkpoint-every 4 "
         "--log-every 1 --resume auto --no-eval --no-verify --no-plot --timeout 60 " +
         extra + " --run-dir " + run_dir;
}

int torchrun_port() { return 29700 + ::getpid() % 250; }

}  // namespace

TEST(Torchrun, TrainsAndAWorkerThatFailsOnceIsRestartedOnTheSameCurve) {
  const std::string why = skip_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  TempDir t("contrax_torchrun");
  const std::string standalone = torchrun() + " --standalone --nproc-per-node 2 --no-python ";

  // Contrax's own launcher, then torchrun: the same computation.
  auto own = run_shell(kCli + " " + train_flags(t.path + "/own") + " --nproc 2 2>&1");
  ASSERT_EQ(own.status, 0) << own.out;
  const auto want = losses_of(t.path + "/own/metrics.jsonl");
  ASSERT_EQ(want.size(), 12u);
  auto tr = run_shell(standalone + kCli + " " + train_flags(t.path + "/torchrun") + " 2>&1");
  ASSERT_EQ(tr.status, 0) << tr.out;
  EXPECT_EQ(losses_of(t.path + "/torchrun/metrics.jsonl"), want) << tr.out;

  // Rank 1 fails before step 10 (after the checkpoint of step 8); torchrun
  // restarts both workers, which resume from step 8.
  auto re = run_shell("CONTRAX_FAULT_EXIT_AT_STEP=10:1 " + torchrun() +
                      " --standalone --nproc-per-node 2 --max-restarts 1 --no-python " + kCli + " " +
                      train_flags(t.path + "/restart") + " 2>&1");
  ASSERT_EQ(re.status, 0) << re.out;
  EXPECT_NE(re.out.find("rank 1 failed before step 10 as asked by CONTRAX_FAULT_EXIT_AT_STEP=10:1"),
            std::string::npos)
      << re.out;
  const std::string log = read_file(t.path + "/restart/train.log");
  EXPECT_NE(log.find("resum"), std::string::npos) << log;
  EXPECT_EQ(losses_of(t.path + "/restart/metrics.jsonl"), want) << re.out;
}

TEST(Torchrun, TwoNodesWithTheC10dRendezvousEqualOneNode) {
  const std::string why = skip_reason();
  if (!why.empty()) GTEST_SKIP() << why;
  TwoNodes net;
  if (!net.skip_reason().empty()) GTEST_SKIP() << net.skip_reason();
  TempDir t("contrax_torchrun2");
  const std::string extra = "--dtype double";

  auto single = run_shell(kCli + " " + train_flags(t.path + "/single", extra) + " --nproc 2 2>&1");
  ASSERT_EQ(single.status, 0) << single.out;
  const auto want = losses_of(t.path + "/single/metrics.jsonl");
  ASSERT_EQ(want.size(), 12u);

  const std::string endpoint = TwoNodes::address(0) + ":" + std::to_string(torchrun_port());
  std::vector<Proc> nodes;
  for (int k = 0; k < 2; ++k) {
    nodes.push_back(spawn("ip netns exec " + net.ns(k) + " " + torchrun() +
                              " --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint " + endpoint +
                              " --rdzv-id contrax-test --rdzv-conf is_host=" + std::to_string(k == 0 ? 1 : 0) +
                              " --local-addr " + TwoNodes::address(k) + " --no-python " +
                              kCli + " " + train_flags(t.path + "/node" + std::to_string(k), extra),
                          t.path + "/node" + std::to_string(k) + ".txt"));
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_EQ(wait_for(nodes[k], std::chrono::seconds(300)), 0) << read_file(nodes[k].out);
  }
  // The rendezvous decides which node's worker is rank 0 (it writes the metrics).
  std::vector<std::string> got;
  for (int k = 0; k < 2; ++k) {
    const std::string m = t.path + "/node" + std::to_string(k) + "/metrics.jsonl";
    if (fs::exists(m)) got = losses_of(m);
  }
  EXPECT_EQ(got, want) << read_file(nodes[0].out) << read_file(nodes[1].out);
}
