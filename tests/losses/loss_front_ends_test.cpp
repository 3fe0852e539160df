// The loss front ends on one device: finite differences, modules that own
// their parameters, extreme temperatures, the momentum helpers.

#include <gtest/gtest.h>

#include <cmath>

#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;

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
