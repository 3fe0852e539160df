// Extreme values (issue 14, item 13): huge logit scales, NaN scalars and
// features whose squares overflow stay finite or NaN as they should.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"
#include "support/errors.h"

using namespace contrax;
using contrax::testing::error_of;

// ---- extreme values (issue 14, item 13) ----

// The memory path of `tile` in the loops below: -1 the materialised path, any
// other value the tiled path with that tile side.
MemoryPathOptions memory_of(int64_t tile) {
  return tile < 0 ? MemoryPathOptions().path(MemoryPath::kMaterialised)
                  : MemoryPathOptions().path(MemoryPath::kTiled).tile_size(tile);
}

// exp(89) overflows fp32: taking exp before the clamp gave a finite loss and a
// NaN gradient for the logit scale. The clamp is now on the log side.
TEST(LossExtremes, HugeLogitScaleHasZeroNotNaNGradient) {
  auto a = torch::randn({6, 4}), b = torch::randn({6, 4});
  for (float v : {89.0f, 100.0f, 1e30f}) {
    auto ls = torch::tensor(v).requires_grad_(true);
    for (int64_t tile : {int64_t{-1}, int64_t{2}}) {
      ls.mutable_grad() = torch::Tensor();
      auto loss = clip_loss(a, b, ls, c10::nullopt, ClipLossOptions().normalize(true).memory(memory_of(tile)));
      loss.backward();
      EXPECT_TRUE(std::isfinite(loss.item<float>())) << v;
      EXPECT_EQ(ls.grad().item<float>(), 0.0f) << v << " tile " << tile;
      auto ref = reference::clip_loss(a.to(torch::kDouble), b.to(torch::kDouble), torch::tensor(std::log(100.0), torch::kDouble),
                                      c10::nullopt, true, 100.0, true);
      EXPECT_NEAR(loss.item<float>(), ref.item<double>(), 1e-4 * std::max(1.0, ref.item<double>()));
    }
  }
}

// Issue 29, item 1: `where(x < log_max, exp, max)` sent a NaN scale to the
// maximum (NaN < log_max is false), a finite loss with a zero scale gradient
// that no divergence check could see. Every scalar of every loss, and a NaN
// feature, must give NaN out; a NaN temperature is refused by name.
TEST(LossExtremes, NaNInAnyScalarGivesNaN) {
  torch::manual_seed(11);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto a = torch::randn({6, 4}, torch::kDouble), b = torch::randn({6, 4}, torch::kDouble);
  auto ok = torch::tensor(std::log(10.0), torch::kDouble), bad = torch::tensor(nan, torch::kDouble);
  auto is_nan = [](const torch::Tensor& t) { return std::isnan(t.item<double>()); };
  for (int64_t tile : {int64_t{-1}, int64_t{2}}) {
    auto o = ClipLossOptions().memory(memory_of(tile));
    auto ls = bad.clone().requires_grad_(true);
    auto loss = clip_loss(a, b, ls, c10::nullopt, o);
    EXPECT_TRUE(is_nan(loss)) << "clip scale, tile " << tile;
    loss.backward();
    EXPECT_TRUE(std::isnan(ls.grad().item<double>())) << "clip scale gradient, tile " << tile;
    EXPECT_TRUE(is_nan(clip_loss(a, b, ok, bad, o))) << "clip bias, tile " << tile;
    EXPECT_TRUE(is_nan(clip_loss(a, b, bad, c10::nullopt, ClipLossOptions(o).normalize(true)))) << tile;
    EXPECT_TRUE(is_nan(clip_loss(a, b, bad, c10::nullopt, ClipLossOptions().memory(MemoryPathOptions().path(
                                                                 MemoryPath::kTiled)))))
        << tile;
    EXPECT_TRUE(is_nan(grouped_loss(a, torch::cat({b, b}, 0), bad, c10::nullopt,
                                    GroupedLossOptions().memory(memory_of(tile))))) << "grouped scale, tile " << tile;
    EXPECT_TRUE(is_nan(grouped_loss(a, torch::cat({b, b}, 0), ok, bad, GroupedLossOptions().memory(memory_of(tile)))))
        << "grouped bias, tile " << tile;
    auto z = a.clone();
    z[2][1] = nan;
    EXPECT_TRUE(is_nan(nt_xent_loss(z, b, NTXentLossOptions().memory(memory_of(tile))))) << "nt_xent feature, tile " << tile;
    EXPECT_TRUE(is_nan(moco_v3_loss(z, b, a, b, MocoV3LossOptions().memory(memory_of(tile))))) << "moco feature " << tile;
    EXPECT_TRUE(is_nan(clip_loss(z, b, ok, c10::nullopt, o))) << "clip feature, tile " << tile;
  }
  for (int64_t tile : {int64_t{0}, int64_t{2}}) {
    auto o = SigLipLossOptions().tile_size(tile);
    EXPECT_TRUE(is_nan(siglip_loss(a, b, bad, ok, o))) << "siglip scale, tile " << tile;
    EXPECT_TRUE(is_nan(siglip_loss(a, b, ok, bad, o))) << "siglip bias, tile " << tile;
    EXPECT_TRUE(is_nan(siglip_loss(a, b, bad, ok, SigLipLossOptions(o).max_logit_scale(100.0)))) << tile;
  }
  EXPECT_NE(error_of([&] { nt_xent_loss(a, b, NTXentLossOptions().temperature(nan)); })
                .find("nt_xent_loss(): argument 'temperature' must be a positive finite number, but got nan"),
            std::string::npos);
  EXPECT_NE(error_of([&] { moco_v3_loss(a, b, a, b, MocoV3LossOptions().temperature(nan)); })
                .find("argument 'temperature' must be a positive finite number"),
            std::string::npos);
}

// F::normalize squares fp32 entries of 1e20 into inf and returns zeros.
TEST(LossExtremes, NormalizeDoesNotOverflow) {
  torch::manual_seed(6);
  auto a = torch::randn({5, 4}) * 1e20, b = torch::randn({5, 4}) * 1e20;
  auto ls = torch::tensor(std::log(10.0f)).requires_grad_(true);
  auto ar = a.clone().requires_grad_(true);
  auto loss = clip_loss(ar, b, ls, c10::nullopt, ClipLossOptions().normalize(true));
  loss.backward();
  auto ref = reference::clip_loss(a.to(torch::kDouble), b.to(torch::kDouble), torch::tensor(std::log(10.0), torch::kDouble),
                                  c10::nullopt, true, 100.0, true);
  EXPECT_NEAR(loss.item<float>(), ref.item<double>(), 1e-5 * ref.item<double>());
  EXPECT_TRUE(ar.grad().isfinite().all().item<bool>());
  auto nt = nt_xent_loss(a, b, NTXentLossOptions().temperature(0.5));
  EXPECT_NEAR(nt.item<float>(), reference::nt_xent_loss(a.to(torch::kDouble), b.to(torch::kDouble), 0.5).item<double>(),
              1e-5);
}
