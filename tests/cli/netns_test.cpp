// Multi-node training over a real network link (issue 14): two network
// namespaces joined by a veth pair, 10.77.0.1/24 and 10.77.0.2/24 (addresses
// that exist only inside these namespaces, so nothing leaves them), one
// `contrax launch --nnodes 2 --node-rank K` per namespace with rank 0's
// address as MASTER_ADDR.
//
//   * the fp64 loss curve of the two-node run equals, bit for bit, the
//     single-node run of the same world size and global batch;
//   * cutting the link (`ip link set ... down`) mid-run stops both nodes
//     within --timeout plus a few seconds, each with a message naming the
//     collective and the peer, and rank 0's last checkpoint stays loadable.
//
// Needs CAP_NET_ADMIN (`ip netns add`); skips with the reason otherwise.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "contrax/train/common/checkpoint.h"
#include "contrax/train/image/trainer.h"

#include "support/cli.h"
#include "support/processes.h"

namespace fs = std::filesystem;
namespace ct = contrax::train;
using Clock = std::chrono::steady_clock;
using namespace contrax::testing;

namespace {

bool sh(const std::string& cmd) { return std::system((cmd + " > /dev/null 2>&1").c_str()) == 0; }

std::string slurp(const std::string& p) { return read_file(p); }

std::string node_cmd(const TwoNodes& net, int node, int port, const std::string& train_args) {
  return "ip netns exec " + net.ns(node) + " " + kCli + " launch --nproc 1 --nnodes 2 --node-rank " +
         std::to_string(node) + " --master-addr 10.77.0.1 --master-port " + std::to_string(port) + " --grace-ms 2000 -- " +
         kCli + " train " + train_args;
}

}  // namespace

TEST(TwoNamespaces, LossCurveEqualsSingleNodeAndACutLinkStopsBothSides) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TwoNodes net;
  if (!net.skip_reason().empty()) GTEST_SKIP() << net.skip_reason();
  TempDir t("contrax_netns");
  const int port = 29600 + ::getpid() % 300;

  // The reference: both ranks on one node (loopback).
  const std::string args = kFastTrain + " --dtype double --max-steps 5 --timeout 30";
  auto single = spawn(kCli + " train " + args + " --nproc 2 --run-dir " + t.path + "/single", t.path + "/single.txt");
  ASSERT_EQ(wait_for(single, std::chrono::seconds(300)), 0) << slurp(t.path + "/single.txt");

  // The same run over the veth link.
  auto n0 = spawn(node_cmd(net, 0, port, args + " --run-dir " + t.path + "/multi"), t.path + "/n0.txt");
  auto n1 = spawn(node_cmd(net, 1, port, args + " --run-dir " + t.path + "/multi1"), t.path + "/n1.txt");
  const int s0 = wait_for(n0, std::chrono::seconds(300)), s1 = wait_for(n1, std::chrono::seconds(300));
  ASSERT_EQ(s0, 0) << slurp(t.path + "/n0.txt");
  ASSERT_EQ(s1, 0) << slurp(t.path + "/n1.txt");
  const auto a = losses_of(t.path + "/single/metrics.jsonl"), b = losses_of(t.path + "/multi/metrics.jsonl");
  ASSERT_EQ(a.size(), 5u);
  EXPECT_EQ(a, b) << "the two-node fp64 loss curve must equal the single-node one bit for bit (17 digits)";
  std::cout << "FAULT two namespaces: fp64 losses single-node vs two-node:";
  for (size_t i = 0; i < a.size(); ++i) std::cout << " " << a[i] << (i < b.size() && a[i] == b[i] ? "=" : "!=") << (i < b.size() ? b[i] : "-");
  std::cout << "\n";

  // Cut the link mid-run.
  const std::string cut_args = kFastTrain + " --max-steps 2000 --checkpoint-every 2 --timeout 3";
  const std::string rd = t.path + "/cut";
  auto c0 = spawn(node_cmd(net, 0, port + 1, cut_args + " --run-dir " + rd), t.path + "/c0.txt");
  auto c1 = spawn(node_cmd(net, 1, port + 1, cut_args + " --run-dir " + t.path + "/cut1"), t.path + "/c1.txt");
  const auto deadline = Clock::now() + std::chrono::seconds(180);
  while (losses_of(rd + "/metrics.jsonl").size() < 5 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_GE(losses_of(rd + "/metrics.jsonl").size(), 5u) << slurp(t.path + "/c0.txt");
  const auto cut_at = Clock::now();
  ASSERT_TRUE(sh("ip -n " + net.ns(0) + " link set " + net.veth(0) + " down"));
  const int e0 = wait_for(c0, std::chrono::seconds(60));
  const double t0 = std::chrono::duration<double>(Clock::now() - cut_at).count();
  const int e1 = wait_for(c1, std::chrono::seconds(60));
  const double t1 = std::chrono::duration<double>(Clock::now() - cut_at).count();
  const std::string o0 = slurp(t.path + "/c0.txt"), o1 = slurp(t.path + "/c1.txt");
  std::cout << "FAULT link cut (--timeout 3): node 0 exit " << e0 << " after " << t0 << " s, node 1 exit " << e1
            << " after " << t1 << " s\n";
  EXPECT_EQ(e0, 1) << o0;
  EXPECT_EQ(e1, 1) << o1;
  EXPECT_LT(t0, 3.0 + 8.0) << o0;
  EXPECT_LT(t1, 3.0 + 8.0) << o1;
  EXPECT_NE(o0.find("on rank 0 of 2 (backend gloo, timeout 3000 ms); rank 1 did not answer"), std::string::npos) << o0;
  EXPECT_NE(o1.find("on rank 1 of 2 (backend gloo, timeout 3000 ms); rank 0, which hosts the rendezvous store, did not "
                    "answer"),
            std::string::npos)
      << o1;
  ASSERT_TRUE(ct::is_valid_checkpoint(ct::checkpoint_path(rd))) << o0;
  ct::Checkpoint c;
  c.load(ct::checkpoint_path(rd));
  EXPECT_GE(c.ints.at("step"), 2);
}
