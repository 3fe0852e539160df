// Every loss against the one-device reference on the concatenated batch
// (fp64, W = 1..4, equal, uneven and empty-rank batches, static shapes),
// through verify's cases; and negative controls showing that the exactness
// check catches the classic all_gather-without-gradient bug and does not
// report round-off against an exact 0.

#include <gtest/gtest.h>

#include <cmath>

#include "contrax/check/verify.h"
#include "contrax/comm/collectives.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::run_ranks;

namespace {

std::vector<std::vector<int64_t>> row_patterns(int64_t W) {
  std::vector<std::vector<int64_t>> p{std::vector<int64_t>(W, 4), default_row_counts(W)};
  if (W >= 2) {
    std::vector<int64_t> one_row(W, 1);
    one_row[0] = 9;  // a long and many 1-row ranks
    p.push_back(one_row);
  }
  return p;
}

void expect_case_exact(const VerifyCase& c, int64_t W, const std::vector<int64_t>& rows, double tol = 1e-10,
                       const contrax::testing::ConfigureRank& configure = {}) {
  std::vector<VerifyResult> results(W);
  run_ranks(
      W,
      [&](const CommunicatorPtr& comm) {
        results[comm->rank()] = verify_case(c, comm, VerifyOptions().rows(rows).width(6).seed(11));
      },
      std::chrono::seconds(30), configure);
  for (const auto& r : results) {
    EXPECT_LE(r.max_rel_err, tol) << c.name << " W=" << W << " worst: " << r.worst << " " << to_json(r);
  }
}

}  // namespace

class LossWorld : public ::testing::TestWithParam<int64_t> {};

TEST_P(LossWorld, EveryLossEqualsTheSingleDeviceReference) {
  const int64_t W = GetParam();
  for (const auto& c : verify_cases()) {
    for (const auto& rows : row_patterns(W)) expect_case_exact(c, W, rows);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, LossWorld, ::testing::Values(1, 2, 3, 4));

// Static shapes (Communicator::static_shapes): equal batches, every loss exact
// as before, and not one metadata exchange in the losses' forward or backward.
TEST_P(LossWorld, StaticShapesSkipTheMetadataExchangeAndStayExact) {
  const int64_t W = GetParam();
  const auto static_shapes = [](int64_t, CommunicatorOptions& o) { o.static_shapes(true); };
  for (const auto& c : verify_cases()) expect_case_exact(c, W, std::vector<int64_t>(W, 4), 1e-10, static_shapes);
  run_ranks(
      W,
      [&](const CommunicatorPtr& comm) {
        auto gen = at::detail::createCPUGenerator(100 + comm->rank());
        auto a = torch::randn({5, 4}, gen, torch::kDouble).requires_grad_(true);
        auto b = torch::randn({5, 4}, gen, torch::kDouble).requires_grad_(true);
        auto s = torch::tensor(1.5, torch::kDouble);
        const auto losses = [&] {
          clip_loss(a, b, s, c10::nullopt, ClipLossOptions().comm(comm)).backward();
          clip_loss(a, b, s, c10::nullopt, ClipLossOptions().comm(comm).path(MemoryPath::kTiled).ring(true))
              .backward();
          nt_xent_loss(a, b, NTXentLossOptions().comm(comm)).backward();
          moco_v3_loss(a, b, b.detach(), a.detach(), MocoV3LossOptions().comm(comm)).backward();
          siglip_loss(a, b, s, torch::tensor(-1.0, torch::kDouble), SigLipLossOptions().comm(comm)).backward();
          grouped_loss(a, b, s, c10::nullopt, GroupedLossOptions().comm(comm)).backward();
          gather_with_grad(a, comm).all.sum().backward();
        };
        // Without static shapes each of the seven calls agrees on its row
        // counts once, in its forward (the backwards reuse them), and a world
        // of one exchanges nothing: 7 metadata calls for W > 1, 0 for W = 1.
        // With them, none; the data collectives still run (W > 1).
        EXPECT_TRUE(comm->static_shapes() || W == 1);  // from the options (world 1 has no group)
        comm->set_static_shapes(false);
        comm->reset_stats();
        losses();
        EXPECT_EQ(comm->stats().op("metadata").calls, W == 1 ? 0 : 7);
        comm->set_static_shapes(true);
        comm->reset_stats();
        losses();
        EXPECT_EQ(comm->stats().op("metadata").calls, 0);
        EXPECT_EQ(comm->stats().total_calls() > 0, W > 1);
      },
      std::chrono::seconds(30), static_shapes);
}

// The classic mistake (seed 003): gather features without gradient and use the
// [local x global] logits. Rank r then misses the gradient that flows to its
// rows through the other ranks' losses. The check must see that.
TEST(Losses, ExactnessCheckCatchesGatherWithoutGradient) {
  VerifyCase wrong;
  wrong.name = "clip_no_grad_gather";
  wrong.scalars = {std::log(10.0)};
  wrong.distributed = [](const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& s,
                         const CommunicatorPtr& comm) {
    auto ga = gather_no_grad(x[0], comm), gb = gather_no_grad(x[1], comm);
    auto scale = s[0].exp();
    auto labels = torch::arange(ga.offset, ga.offset + x[0].size(0));
    namespace F = torch::nn::functional;
    auto sum = F::cross_entropy(torch::mm(x[0], gb.all.t()) * scale, labels,
                                F::CrossEntropyFuncOptions().reduction(torch::kSum)) +
               F::cross_entropy(torch::mm(x[1], ga.all.t()) * scale, labels,
                                F::CrossEntropyFuncOptions().reduction(torch::kSum));
    return sum * 0.5 * static_cast<double>(comm->world_size()) / static_cast<double>(ga.total());
  };
  wrong.reference = [](const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& s) {
    return reference::clip_loss(x[0], x[1], s[0], c10::nullopt);
  };
  std::vector<VerifyResult> results(2);
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    results[comm->rank()] = verify_case(wrong, comm, VerifyOptions().rows({4, 4}).width(6));
  });
  EXPECT_LE(results[0].loss_rel_err, 1e-12);  // the value is right...
  EXPECT_GT(results[0].max_rel_err, 1e-3);    // ...the gradient is not
  EXPECT_FALSE(results[0].passed);
}

// One global row (the exact loss and every gradient are 0) and width 1 (the
// normalised features are +-1 and the input gradients 0): verify used to report
// a relative error of 1e285 for round-off against an exact 0.
TEST(LossExtremes, VerifyHasAnAbsoluteFloor) {
  std::vector<std::vector<VerifyResult>> results(2);
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    results[comm->rank()] = verify(comm, VerifyOptions().rows({1, 0}).cases({"clip", "nt_xent", "moco_v3", "clip_tiled"}));
  });
  for (const auto& r : results[0]) EXPECT_TRUE(r.passed) << to_json(r);
  std::vector<std::vector<VerifyResult>> narrow(2);
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    narrow[comm->rank()] = verify(comm, VerifyOptions().width(1).cases({"clip", "clip_clamped", "nt_xent", "moco_v3"}));
  });
  for (const auto& r : narrow[0]) EXPECT_TRUE(r.passed) << to_json(r);
}
