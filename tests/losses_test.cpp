// The distributed losses against the one-device reference on the
// concatenated batch (fp64, W = 1..4, equal, uneven and empty-rank batches),
// finite-difference checks, the error messages, and a negative control showing
// that the exactness check catches the classic all_gather-without-gradient bug.
#include <gtest/gtest.h>

#include <cmath>

#include "contrax/collectives.h"
#include "contrax/losses.h"
#include "contrax/reference.h"
#include "contrax/verify.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::run_ranks;
using contrax::testing::run_ranks_collect_errors;

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

void expect_case_exact(const VerifyCase& c, int64_t W, const std::vector<int64_t>& rows, double tol = 1e-10) {
  std::vector<VerifyResult> results(W);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    results[comm->rank()] = verify_case(c, comm, VerifyOptions().rows(rows).width(6).seed(11));
  });
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

TEST(Losses, FiniteDifferencesSingleDevice) {
  auto gen = at::detail::createCPUGenerator(5);
  auto a = torch::randn({4, 3}, gen, torch::kDouble).requires_grad_(true);
  auto b = torch::randn({4, 3}, gen, torch::kDouble).requires_grad_(true);
  auto s = torch::tensor(std::log(3.0), torch::kDouble).requires_grad_(true);
  auto bias = torch::tensor(0.2, torch::kDouble).requires_grad_(true);
  using V = std::vector<torch::Tensor>;
  EXPECT_LE(contrax::testing::finite_difference_error(
                [](const V& x) { return clip_loss(x[0], x[1], x[2], x[3], ClipLossOptions().normalize(true)); },
                {a, b, s, bias}),
            1e-7);
  EXPECT_LE(contrax::testing::finite_difference_error(
                [](const V& x) { return nt_xent_loss(x[0], x[1], NTXentLossOptions().temperature(0.3)); }, {a, b}),
            1e-7);
  auto k1 = torch::randn({4, 3}, gen, torch::kDouble), k2 = torch::randn({4, 3}, gen, torch::kDouble);
  EXPECT_LE(contrax::testing::finite_difference_error(
                [](const V& x) { return moco_v3_loss(x[0], x[1], x[2], x[3], MocoV3LossOptions().temperature(0.5)); },
                {a, b, k1, k2}),
            1e-7);
}

TEST(Losses, ModulesOwnTheirParameters) {
  auto a = torch::randn({5, 4}, torch::kDouble), b = torch::randn({5, 4}, torch::kDouble);
  ClipLoss clip(ClipLossOptions(), 1.0 / 0.07, /*with_bias=*/true);
  EXPECT_EQ(clip->parameters().size(), 2u);
  clip->to(torch::kDouble);
  auto l = clip(a, b);
  EXPECT_NEAR(clip->logit_scale.item<double>(), std::log(1.0 / 0.07), 1e-6);
  auto ref = reference::clip_loss(a, b, clip->logit_scale.detach(), clip->logit_bias.detach());
  EXPECT_NEAR(l.item<double>(), ref.item<double>(), 1e-12);
  l.backward();
  EXPECT_TRUE(clip->logit_scale.grad().defined());
  NTXentLoss nt(NTXentLossOptions().temperature(0.5));
  EXPECT_NEAR(nt(a, b).item<double>(), reference::nt_xent_loss(a, b, 0.5).item<double>(), 1e-12);
  MocoV3Loss moco(MocoV3LossOptions().temperature(0.2));
  EXPECT_NEAR(moco(a, b, b, a).item<double>(), reference::moco_v3_loss(a, b, b, a, 0.2).item<double>(), 1e-12);
}

TEST(Losses, ExtremeTemperatureStaysFinite) {
  auto a = torch::randn({6, 8}, torch::kFloat);
  auto b = a + 1e-4 * torch::randn({6, 8});
  auto l = nt_xent_loss(a.requires_grad_(true), b, NTXentLossOptions().temperature(0.01));
  l.backward();
  EXPECT_TRUE(std::isfinite(l.item<float>()));
  EXPECT_TRUE(a.grad().isfinite().all().item<bool>());
}

TEST(Losses, MomentumHelpers) {
  torch::nn::Linear online(3, 2), target(3, 2);
  auto before = target->weight.detach().clone();
  momentum_update(*target, *online, 0.9);
  EXPECT_TRUE(target->weight.allclose(before * 0.9 + online->weight.detach() * 0.1));
  EXPECT_DOUBLE_EQ(momentum_schedule(0.99, 0, 100), 0.99);
  EXPECT_DOUBLE_EQ(momentum_schedule(0.99, 100, 100), 1.0);
  EXPECT_NEAR(momentum_schedule(0.99, 50, 100), 0.995, 1e-12);
  torch::nn::Linear other(4, 2);
  CONTRAX_EXPECT_ERROR(momentum_update(*target, *other, 0.9),
                       "momentum_update(): parameter 'weight' has shape [2, 3] in 'target' but [2, 4] in 'online'");
  CONTRAX_EXPECT_ERROR(momentum_update(*target, *online, 1.5),
                       "momentum_update(): argument 'momentum' must be in [0, 1], but got 1.5");
  CONTRAX_EXPECT_ERROR(momentum_schedule(0.9, 1, 0),
                       "momentum_schedule(): argument 'total_steps' must be positive, but got 0");
  CONTRAX_EXPECT_ERROR(momentum_schedule(1.9, 1, 10), "momentum_schedule(): argument 'base' must be in [0, 1]");
}

// ---- bad input: each message, on one device and across ranks ----

TEST(LossErrors, LocalArgumentChecks) {
  auto x = torch::randn({4, 3}), s = torch::tensor(1.0);
  CONTRAX_EXPECT_ERROR(clip_loss(torch::randn({4}), x, s),
                       "clip_loss(): argument 'a' must be a 2-D tensor [rows, width], but got shape [4]");
  CONTRAX_EXPECT_ERROR(clip_loss(x, torch::randn({3, 3}), s),
                       "clip_loss(): arguments 'a' and 'b' must have the same number of rows on each rank, but got 4 "
                       "and 3");
  CONTRAX_EXPECT_ERROR(clip_loss(x, torch::randn({4, 2}), s),
                       "clip_loss(): arguments 'a' and 'b' must have the same width, but got 3 and 2");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x.to(torch::kDouble), s),
                       "clip_loss(): arguments 'a' and 'b' must have the same dtype, but got Float and Double");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x, torch::ones({3})),
                       "clip_loss(): argument 'logit_scale' must be a 0-dim tensor, but got shape [3]");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x, s, torch::ones({1})),
                       "clip_loss(): argument 'logit_bias' must be a 0-dim tensor, but got shape [1]");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x, s, c10::nullopt, ClipLossOptions().max_logit_scale(0)),
                       "clip_loss(): argument 'max_logit_scale' must be a positive finite number, but got 0");
  CONTRAX_EXPECT_ERROR(clip_loss(x.to(torch::kLong), x, s),
                       "clip_loss(): argument 'a' must be a floating-point tensor, but got dtype Long");
  CONTRAX_EXPECT_ERROR(nt_xent_loss(x, x, NTXentLossOptions().temperature(0)),
                       "nt_xent_loss(): argument 'temperature' must be a positive finite number, but got 0");
  CONTRAX_EXPECT_ERROR(nt_xent_loss(x, torch::randn({5, 3})),
                       "nt_xent_loss(): argument 'z2' must have the same shape as 'z1' ([4, 3]), but got [5, 3]");
  CONTRAX_EXPECT_ERROR(nt_xent_loss(torch::randn({2, 2, 2}), x),
                       "nt_xent_loss(): argument 'z1' must be a 2-D tensor");
  CONTRAX_EXPECT_ERROR(moco_v3_loss(x, x, x, x, MocoV3LossOptions().temperature(-1)),
                       "moco_v3_loss(): argument 'temperature' must be a positive finite number, but got -1");
  CONTRAX_EXPECT_ERROR(moco_v3_loss(x, x, torch::randn({4, 2}), x),
                       "moco_v3_loss(): argument 'k1' must have the same shape as 'q1' ([4, 3]), but got [4, 2]");
  CONTRAX_EXPECT_ERROR(clip_loss(torch::randn({0, 3}), torch::randn({0, 3}), s),
                       "clip_loss(): the global batch is empty");
  CONTRAX_EXPECT_ERROR(ClipLoss(ClipLossOptions(), -1.0), "ClipLoss(): argument 'init_scale' must be positive");
}

TEST(LossErrors, BadInputOnOneRankIsAnErrorOnAllRanks) {
  auto errors = run_ranks_collect_errors(3, [](const CommunicatorPtr& comm) {
    auto a = torch::randn({3, 4});
    auto b = comm->rank() == 1 ? torch::randn({2, 4}) : torch::randn({3, 4});
    clip_loss(a, b, torch::tensor(1.0), c10::nullopt, ClipLossOptions().comm(comm));
  });
  EXPECT_NE(errors[1].find("arguments 'a' and 'b' must have the same number of rows on each rank"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("clip_loss(): rank 1 passed an invalid argument"), std::string::npos) << errors[0];
  EXPECT_NE(errors[2].find("clip_loss(): rank 1 passed an invalid argument"), std::string::npos) << errors[2];
}

TEST(LossErrors, WidthOrDtypeMismatchBetweenRanks) {
  auto errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto z = torch::randn({3, comm->rank() == 0 ? 4 : 6});
    nt_xent_loss(z, z, NTXentLossOptions().comm(comm));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("nt_xent_loss(): argument 'z1' must have the same trailing shape on every rank, but it is "
                     "[b, 6] on rank 1 and [b, 4] on rank 0"),
              std::string::npos)
        << e;
  }
  errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto q = torch::randn({3, 4}, comm->rank() == 0 ? torch::kFloat : torch::kDouble);
    moco_v3_loss(q, q, q, q, MocoV3LossOptions().comm(comm));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("moco_v3_loss(): argument 'k1' must have the same dtype on every rank, but it is Double on "
                     "rank 1 and Float on rank 0"),
              std::string::npos)
        << e;
  }
}
