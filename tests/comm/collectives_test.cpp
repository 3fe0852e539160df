// gather_with_grad / gather_no_grad: values, exact gradients (against an
// analytic sum and against distributed finite differences), backward volume
// equal to a reduce-scatter's, uneven and empty ranks, and the cross-rank
// agreement checks that turn a mismatch into an error on every rank.
#include <gtest/gtest.h>

#include <mutex>

#include "contrax/comm/collectives.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using namespace contrax::testing;

namespace {
std::vector<std::vector<int64_t>> count_patterns(int64_t W) {
  std::vector<int64_t> even(W, 4), uneven, empty;
  for (int64_t r = 0; r < W; ++r) uneven.push_back(r + 2);
  for (int64_t r = 0; r < W; ++r) empty.push_back(r == W / 2 ? 0 : 3 + r);
  if (W == 1) return {even, {0 + 5}};
  return {even, uneven, empty};
}
}  // namespace

class GatherWorld : public ::testing::TestWithParam<int64_t> {};

// Each rank r weights the gathered matrix by its own W_r and sums; the
// gradient on rank r must be sum_s W_s[rows of r] — exactly what one device
// computing sum_s <W_s, X> on the concatenated X would give for those rows.
TEST_P(GatherWorld, ForwardAndBackwardAreExact) {
  const int64_t W = GetParam();
  for (const auto& counts : count_patterns(W)) {
    int64_t B = 0;
    for (auto c : counts) B += c;
    auto gen = at::detail::createCPUGenerator(7);
    auto X = torch::randn({B, 3}, gen, torch::kDouble);
    std::vector<torch::Tensor> weights;
    for (int64_t s = 0; s < W; ++s) weights.push_back(torch::randn({B, 3}, gen, torch::kDouble));
    auto wsum = torch::zeros({B, 3}, torch::kDouble);
    for (auto& w : weights) wsum += w;
    run_ranks(W, [&](const CommunicatorPtr& comm) {
      const int64_t r = comm->rank();
      auto x = shard(X, counts, r).clone().requires_grad_(true);
      auto g = gather_with_grad(x, comm);
      EXPECT_EQ(g.counts, counts);
      EXPECT_EQ(g.total(), B);
      EXPECT_TRUE(g.all.detach().equal(X));
      (g.all * weights[r]).sum().backward();
      EXPECT_LE(rel_err(x.grad(), shard(wsum, counts, r)), 1e-15) << "W=" << W << " rank " << r;
    });
  }
}

TEST_P(GatherWorld, BackwardMovesReduceScatterVolume) {
  const int64_t W = GetParam();
  const int64_t b = 8, d = 16;
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    auto x = torch::randn({b, d}, torch::kDouble).requires_grad_(true);
    auto g = gather_with_grad(x, comm);
    comm->reset_stats();
    g.all.sum().backward();
    const int64_t gathered_bytes = W * b * d * 8;
    // (W-1)/W of the gathered gradient per rank: half of an all-reduce's 2(W-1)/W.
    EXPECT_EQ(comm->stats().op("reduce_scatter").bytes_sent, (W - 1) * gathered_bytes / W);
    EXPECT_EQ(comm->stats().op("all_reduce").calls, 0);
    EXPECT_EQ(comm->stats().total_bytes_sent(), (W - 1) * gathered_bytes / W);
  });
}

// Finite differences of the *global* objective sum_s f_s(gather(x)): perturb
// one element of one rank's input at a time, every rank re-evaluates its f_s,
// and the values are summed across ranks.
TEST_P(GatherWorld, FiniteDifferences) {
  const int64_t W = GetParam();
  std::vector<int64_t> counts;
  for (int64_t r = 0; r < W; ++r) counts.push_back(1 + (r % 2));
  int64_t B = 0;
  for (auto c : counts) B += c;
  auto gen = at::detail::createCPUGenerator(3);
  auto X = torch::randn({B, 2}, gen, torch::kDouble);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    auto f = [&](const torch::Tensor& all) {  // a nonlinear per-rank objective
      return (all.sin() * static_cast<double>(r + 1)).pow(2).sum() + all.prod();
    };
    auto x = shard(X, counts, r).clone().requires_grad_(true);
    f(gather_with_grad(x, comm).all).backward();
    auto analytic = x.grad();
    const double eps = 1e-6;
    for (int64_t owner = 0; owner < W; ++owner) {
      for (int64_t i = 0; i < counts[owner] * 2; ++i) {
        double vals[2];
        for (int sign = 0; sign < 2; ++sign) {
          auto xp = shard(X, counts, r).clone();
          if (r == owner) xp.view(-1)[i] += sign ? -eps : eps;
          torch::NoGradGuard ng;
          auto v = f(gather_no_grad(xp, comm).all).reshape({1}).contiguous();
          comm->all_reduce_sum(v);
          vals[sign] = v.item<double>();
        }
        if (r == owner) {
          const double numeric = (vals[0] - vals[1]) / (2 * eps);
          const double a = analytic.view(-1)[i].item<double>();
          EXPECT_NEAR(a, numeric, 1e-6 * std::max(1.0, std::abs(a))) << "rank " << r << " elem " << i;
        }
      }
    }
  });
}

TEST_P(GatherWorld, NoGradGatherIsDetachedAndExact) {
  const int64_t W = GetParam();
  auto counts = count_patterns(W).back();
  int64_t B = 0;
  for (auto c : counts) B += c;
  auto X = torch::randn({B, 5}, torch::kFloat);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    auto x = shard(X, counts, comm->rank()).clone().requires_grad_(true);
    auto g = gather_no_grad(x, comm);
    EXPECT_FALSE(g.all.requires_grad());
    EXPECT_TRUE(g.all.equal(X));
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, GatherWorld, ::testing::Values(1, 2, 3, 4));

TEST(Gather, WidthMismatchBetweenRanksFailsOnEveryRank) {
  auto errors = run_ranks_collect_errors(3, [](const CommunicatorPtr& comm) {
    auto x = torch::randn({2, comm->rank() == 1 ? 5 : 4});
    gather_with_grad(x, comm, "clip_loss");
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("clip_loss(): argument 'local' must have the same trailing shape on every rank, but it is "
                     "[b, 5] on rank 1 and [b, 4] on rank 0"),
              std::string::npos)
        << e;
  }
}

TEST(Gather, DtypeMismatchBetweenRanksFailsOnEveryRank) {
  auto errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto x = torch::randn({2, 4}, comm->rank() == 1 ? torch::kDouble : torch::kFloat);
    gather_no_grad(x, comm);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("must have the same dtype on every rank, but it is Double on rank 1 and Float on rank 0"),
              std::string::npos)
        << e;
  }
}

TEST(Gather, LocalErrorIsSharedInsteadOfHanging) {
  auto errors = run_ranks_collect_errors(3, [](const CommunicatorPtr& comm) {
    std::string err = comm->rank() == 2 ? "my_loss(): argument 'x' is bad" : "";
    contrax::detail::exchange_row_counts(torch::randn({2, 2}), comm, "my_loss", "x", err);
  });
  EXPECT_NE(errors[2].find("my_loss(): argument 'x' is bad"), std::string::npos) << errors[2];
  EXPECT_NE(errors[0].find("my_loss(): rank 2 passed an invalid argument"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("my_loss(): rank 2 passed an invalid argument"), std::string::npos) << errors[1];
}

TEST(Gather, ZeroDimInputIsRejected) {
  CONTRAX_EXPECT_ERROR(gather_with_grad(torch::tensor(1.0), Communicator::single()),
                       "gather_with_grad(): argument 'local' must have at least 1 dimension");
}

TEST(Gather, DoubleBackwardIsAnExplicitError) {
  run_ranks(2, [](const CommunicatorPtr& comm) {
    auto x = torch::randn({2, 2}, torch::kDouble).requires_grad_(true);
    auto y = gather_with_grad(x, comm).all.pow(2).sum();
    CONTRAX_EXPECT_ERROR(torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true),
                         "gather_with_grad(): double backward is not supported");
    // Every rank raised before its collective, so no rank is left waiting.
  });
}

// ---------------------------------------------------------------------------
// The ring driver on its own: every block visited once, gradients summed home,
// and its traffic: 3(W-1) blocks against gather + reduce-scatter's 2(W-1). At
// W = 2, 3 and 5 (one rank empty), and with a gradient wider than its block
// (fp32 blocks, fp64 partials: the packed messages); the partials are summed
// inside the received messages, which must leave the blocks they carry as
// they were (each visit checks its block).
TEST(Ring, GradientsReturnToOwnersAndBytes) {
  const std::vector<int64_t> all_counts = {2, 3, 1, 0, 4};
  for (int64_t W : {2, 3, 5}) {
    for (bool packed : {false, true}) {
      SCOPED_TRACE(std::to_string(W) + (packed ? " packed" : ""));
      const std::vector<int64_t> counts(all_counts.begin(), all_counts.begin() + W);
      const auto block_dtype = packed ? torch::kFloat32 : torch::kFloat64;
      const int64_t block_bytes = packed ? 4 : 8;
      run_ranks(W, [&](const CommunicatorPtr& comm) {
        const int64_t r = comm->rank();
        auto local = torch::full({counts[r], 4}, static_cast<double>(r), block_dtype);
        comm->reset_stats();
        std::vector<int64_t> seen;
        auto grad = contrax::detail::ring_for_each_block_grad(
            comm, counts, local, [&](int64_t owner, const torch::Tensor& block) {
              seen.push_back(owner);
              EXPECT_EQ(block.size(0), counts[owner]);
              EXPECT_TRUE(torch::equal(block, torch::full_like(block, static_cast<double>(owner))));
              // contribution of visitor r
              return torch::full(block.sizes(), static_cast<double>(r + 1), torch::kFloat64);
            });
        std::vector<int64_t> order;
        for (int64_t t = 0; t < W; ++t) order.push_back((r - t + W) % W);
        EXPECT_EQ(seen, order);
        // Every rank contributed its rank+1: 1 + 2 + ... + W.
        EXPECT_TRUE(torch::equal(grad, torch::full({counts[r], 4}, W * (W + 1) / 2.0, torch::kFloat64)));
        // Sent: own block and the next blocks' partials (W-1 blocks and W-1 partials).
        int64_t bytes = 0;
        for (int64_t t = 0; t <= W - 2; ++t) bytes += counts[(r - t + W) % W] * 4 * block_bytes;  // blocks
        for (int64_t t = 2; t <= W; ++t) bytes += counts[(r - t + 1 + W) % W] * 4 * 8;            // partials
        EXPECT_EQ(comm->stats().op("ring").bytes_sent, bytes);
      });
    }
  }
}

