// Communicator: construction from options and environment, world 1 without a
// process group, the raw collectives (even, uneven, empty ranks), byte
// accounting, and the errors a user can cause (including a peer that never
// arrives, which must end in a timeout error rather than a hang).
#include <gtest/gtest.h>

#include <cstdlib>

#include "contrax/communicator.h"
#include "contrax/detail/c10d.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::run_ranks;
using contrax::testing::run_ranks_collect_errors;

TEST(Communicator, WorldOfOneHasNoProcessGroup) {
  auto comm = Communicator::single();
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->backend(), "none");
  EXPECT_FALSE(contrax::detail::process_group(*comm));
  auto x = torch::randn({3, 2});
  EXPECT_TRUE(comm->all_gather_rows(x, {3}).equal(x));
  EXPECT_TRUE(comm->reduce_scatter_rows(x, {3}).equal(x));
  comm->barrier();
  EXPECT_EQ(comm->stats().total_bytes_sent(), 0);
  // create() with world_size 1 does no rendezvous either (an unusable port is fine).
  auto c2 = Communicator::create(CommunicatorOptions().world_size(1).master_port(1));
  EXPECT_FALSE(contrax::detail::process_group(*c2));
}

TEST(Communicator, FromEnvWithoutWorldSizeIsSingle) {
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  auto comm = Communicator::from_env();
  EXPECT_EQ(comm->world_size(), 1);
}

TEST(Communicator, FromEnvErrorsNameTheVariable) {
  ::setenv("WORLD_SIZE", "two", 1);
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'WORLD_SIZE' must be a positive integer");
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "5", 1);
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'RANK' must be in [0, 2), but got 5");
  ::setenv("RANK", "1", 1);
  ::unsetenv("MASTER_ADDR");
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'MASTER_ADDR' must be set");
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::unsetenv("MASTER_PORT");
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'MASTER_PORT' must be set");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  ::unsetenv("MASTER_ADDR");
}

TEST(Communicator, CreateErrorsNameTheArgument) {
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(0)),
                       "argument 'world_size' must be >= 1, but got 0");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).rank(2)),
                       "argument 'rank' must be in [0, 2), but got 2");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).backend("ucx")),
                       "argument 'backend' must be one of auto, gloo, nccl, mpi, but got 'ucx'");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).master_port(70000)),
                       "argument 'master_port' must be in [1, 65535], but got 70000");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).timeout(std::chrono::milliseconds(0))),
                       "argument 'timeout' must be positive");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).backend("nccl").file_store("/tmp/x")),
                       "without NCCL");
}

TEST(Communicator, PeerThatNeverArrivesTimesOut) {
  // Rank 0 of 2 alone: the rendezvous must give up after the timeout.
  auto path = std::string("/tmp/contrax_lonely_") + std::to_string(::getpid());
  std::remove(path.c_str());
  auto start = std::chrono::steady_clock::now();
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).rank(0).file_store(path).timeout(
                           std::chrono::milliseconds(1500))),
                       "could not build the process group within 1500 ms");
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 30.0);
  std::remove(path.c_str());
}

TEST(Communicator, CollectiveWithMissingPeerTimesOut) {
  // Both ranks rendezvous, then only rank 0 enters a gather: rank 0 must get
  // an error naming the collective once the timeout passes.
  auto errors = run_ranks_collect_errors(
      2,
      [](const CommunicatorPtr& comm) {
        if (comm->rank() == 0) comm->all_gather_rows(torch::ones({2, 3}), {2, 2});
      },
      std::chrono::milliseconds(1500));
  EXPECT_NE(errors[0].find("collective 'all_gather' failed on rank 0 of 2"), std::string::npos) << errors[0];
  EXPECT_TRUE(errors[1].empty()) << errors[1];
}

class CommunicatorWorld : public ::testing::TestWithParam<int64_t> {};

TEST_P(CommunicatorWorld, GatherAndReduceScatterEvenAndUneven) {
  const int64_t W = GetParam();
  for (bool even : {true, false}) {
    std::vector<int64_t> counts;
    for (int64_t r = 0; r < W; ++r) counts.push_back(even ? 3 : (r * 2 + 1) % 5);  // uneven includes 0 at W>=3
    int64_t B = 0;
    for (auto c : counts) B += c;
    auto global = torch::arange(B * 4, torch::kDouble).view({B, 4});
    run_ranks(W, [&](const CommunicatorPtr& comm) {
      const int64_t r = comm->rank();
      auto mine = contrax::testing::shard(global, counts, r).clone();
      auto all = comm->all_gather_rows(mine, counts);
      EXPECT_TRUE(all.equal(global)) << "W=" << W << " rank " << r;
      // Reduce-scatter of (rank+1) * global: slice r of the sum over ranks.
      auto contrib = global * static_cast<double>(r + 1);
      auto got = comm->reduce_scatter_rows(contrib, counts);
      auto want = contrax::testing::shard(global, counts, r) * static_cast<double>(W * (W + 1) / 2);
      EXPECT_TRUE(got.allclose(want)) << "W=" << W << " rank " << r;
      // Byte accounting: all-gather sends our rows to W-1 peers; reduce-scatter
      // sends everything but our own slice.
      auto st = comm->stats();
      EXPECT_EQ(st.op("all_gather").bytes_sent, (W - 1) * counts[r] * 4 * 8);
      EXPECT_EQ(st.op("reduce_scatter").bytes_sent, (B - counts[r]) * 4 * 8);
    });
  }
}

TEST_P(CommunicatorWorld, AllReduceBroadcastRingAndInts) {
  const int64_t W = GetParam();
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    auto t = torch::full({5}, static_cast<double>(r), torch::kDouble);
    comm->all_reduce_sum(t);
    EXPECT_TRUE(t.equal(torch::full({5}, static_cast<double>(W * (W - 1) / 2))));
    auto b = torch::full({3}, static_cast<double>(r + 10));
    comm->broadcast(b, W - 1);
    EXPECT_TRUE(b.equal(torch::full({3}, static_cast<double>(W - 1 + 10))));
    auto ints = comm->all_gather_ints({r, 2 * r});
    ASSERT_EQ(static_cast<int64_t>(ints.size()), W);
    for (int64_t s = 0; s < W; ++s) EXPECT_EQ(ints[s], (std::vector<int64_t>{s, 2 * s}));
    // Ring: each rank sends r and receives from the left neighbour.
    auto recv = comm->ring_exchange(torch::full({2, 2}, static_cast<double>(r)), {2, 2}, 1);
    EXPECT_TRUE(recv.equal(torch::full({2, 2}, static_cast<double>((r - 1 + W) % W))));
    auto pending = comm->ring_exchange_async(torch::full({1}, static_cast<double>(r)), {1}, -1);
    EXPECT_EQ(pending.wait().item<double>(), static_cast<double>((r + 1) % W));
    comm->barrier();
    if (W > 1) {
      EXPECT_EQ(comm->stats().op("all_reduce").bytes_sent, 2 * (W - 1) * 5 * 8 / W);
      EXPECT_EQ(comm->stats().op("ring").calls, 2);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CommunicatorWorld, ::testing::Values(1, 2, 3, 4));

TEST(Communicator, RendezvousOverTcp) {
  // The torchrun path: a TCP store on the rank-0 host (threads stand in for
  // processes; the launcher test covers real processes).
  const int64_t port = 29000 + (::getpid() % 2000);
  std::vector<std::thread> ts;
  std::vector<double> got(2, -1);
  for (int64_t r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      auto comm = Communicator::create(CommunicatorOptions().rank(r).world_size(2).master_port(port).timeout(
          std::chrono::seconds(20)));
      auto t = torch::full({1}, static_cast<double>(r + 1));
      comm->all_reduce_sum(t);
      got[r] = t.item<double>();
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(got[0], 3.0);
  EXPECT_EQ(got[1], 3.0);
}
