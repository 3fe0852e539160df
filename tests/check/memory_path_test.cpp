// One memory-path vocabulary for every loss, and plan_loss routing as the
// losses do.

#include <gtest/gtest.h>

#include "contrax/check/plan.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/util/memory.h"
#include "support/errors.h"

using namespace contrax;

// One memory-path vocabulary for every loss: path(kAuto / kMaterialised /
// kTiled) picks the path, tile_size is the tile side (0: from tile_bytes). The
// old spelling tile_size(-1), past its release, is an error naming what
// replaced it.
TEST(MemoryPath, EveryPathGivesTheSameLossTheTiledHoldsLessAndTheOldSpellingIsNamed) {
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  const int64_t B = 96;
  auto a0 = torch::randn({B, 8}, opt), b0 = torch::randn({B, 8}, opt);
  auto ls = torch::tensor(1.0, opt);
  auto run = [&](const ClipLossOptions& o, int64_t* peak = nullptr) {
    auto a = a0.clone().requires_grad_(true);
    MemoryTracker::install();
    PeakScope scope;
    auto l = clip_loss(a, b0, ls, {}, o);
    l.backward();
    if (peak) *peak = scope.peak_above_start();
    return std::make_pair(l.detach(), a.grad());
  };
  int64_t mat_peak = 0, tiled_peak = 0;
  const auto ref = run(ClipLossOptions().path(MemoryPath::kMaterialised), &mat_peak);
  const auto tiled = run(ClipLossOptions().path(MemoryPath::kTiled).tile_size(16), &tiled_peak);
  // Materialised: at least the one [B x B] fp64 logits buffer (73728 bytes at
  // B = 96; 89120 measured with the feature-sized arrays). Tiled with 16 x 16
  // tiles: a few feature-sized [96 x 8] fp64 arrays (6144 bytes each: the
  // scaled queries, the dq and dk accumulators), O(B) row statistics and
  // 2 KiB tiles (20008 bytes measured), under half the buffer (36864).
  EXPECT_GE(mat_peak, B * B * 8);
  EXPECT_LT(tiled_peak, B * B * 8 / 2);
  for (const auto& got : {tiled, run(ClipLossOptions()), run(ClipLossOptions().tile_size(16)),
                          run(ClipLossOptions().path(MemoryPath::kTiled).tile_bytes(2048)),
                          run(ClipLossOptions().max_logits_bytes(64))}) {
    EXPECT_LE((got.first - ref.first).abs().item<double>(), 1e-12);
    EXPECT_LE((got.second - ref.second).abs().max().item<double>(), 1e-12);
  }
  auto a = torch::randn({4, 8}), b = torch::randn({4, 8}), s = torch::tensor(1.0);
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().tile_size(-2)),
                       "clip_loss(): argument 'tile_size' must be >= 0 (the tile side; 0 chooses it from tile_bytes), "
                       "but got -2");
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().tile_bytes(0)),
                       "clip_loss(): argument 'tile_bytes' must be positive, but got 0");
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().tile_size(-1)),
                       "clip_loss(): argument 'tile_size' must be >= 0 (the tile side; 0 chooses it from tile_bytes; "
                       "the materialised path is path kMaterialised), but got -1");
  CONTRAX_EXPECT_ERROR(moco_v3_loss(a, b, a, b, MocoV3LossOptions().path(MemoryPath::kMaterialised).ring(true)),
                       "moco_v3_loss(): 'ring' needs the tiled path, but the path is materialised ('path' is "
                       "kMaterialised)");
  CONTRAX_EXPECT_ERROR(grouped_loss(a, b, s, {}, GroupedLossOptions().path(MemoryPath::kMaterialised).ring(true)),
                       "grouped_loss(): 'ring' needs the tiled path, but the path is materialised ('path' is "
                       "kMaterialised)");
  // plan_loss routes as the losses do.
  EXPECT_EQ(plan_loss(PlanOptions().batch(64).path(MemoryPath::kTiled)).chosen, "tiled");
  EXPECT_EQ(plan_loss(PlanOptions().batch(16384).path(MemoryPath::kMaterialised)).chosen, "materialised");
  EXPECT_EQ(plan_loss(PlanOptions().batch(64).tile_size(16)).chosen, "tiled");
}
