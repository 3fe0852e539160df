// The grouped and labelled losses case by case: the reference itself, what
// labels change, finite differences, the reductions of NT-Xent and MoCo
// across ranks, and half precision with labels.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "contrax/check/verify.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::finite_difference_error;
using contrax::testing::rel_err;
using contrax::testing::run_ranks;
using contrax::testing::shard;

// The reference itself: labels that are all distinct change nothing, and the
// multi-positive form with every label equal and a single row per label agrees
// with the textbook cross-entropy.
TEST(GroupedReference, DistinctLabelsAreThePlainLoss) {
  auto gen = at::detail::createCPUGenerator(3);
  auto a = torch::randn({6, 4}, gen, torch::kDouble), b = torch::randn({6, 4}, gen, torch::kDouble);
  auto s = torch::tensor(1.0, torch::kDouble);
  auto distinct = torch::arange(6, torch::kLong);
  auto plain = reference::clip_loss(a, b, s, c10::nullopt);
  for (auto mode : {LabelMode::kMultiPositive, LabelMode::kMaskDuplicates}) {
    EXPECT_NEAR(reference::clip_rows(a, b, s, c10::nullopt, true, 100.0, false, distinct, mode).mean().item<double>(),
                plain.item<double>(), 1e-12);
  }
  // grouped with g = 1 is one-directional InfoNCE
  EXPECT_NEAR(reference::grouped_rows(a, b, s, c10::nullopt, 100.0, false).mean().item<double>(),
              reference::clip_loss(a, b, s, c10::nullopt, false).item<double>(), 1e-12);
  // duplicates do change it (the test above would not catch a no-op otherwise)
  auto dup = torch::tensor({0, 0, 1, 1, 2, 2}, torch::kLong);
  EXPECT_GT(std::abs(reference::clip_rows(a, b, s, c10::nullopt, true, 100.0, false, dup, LabelMode::kMaskDuplicates)
                         .mean()
                         .item<double>() -
                     plain.item<double>()),
            1e-3);
}

TEST(Grouped, LabelsChangeTheLoss) {
  // A regression guard against labels being ignored: with duplicates, both
  // modes differ from the unlabeled loss and from each other.
  auto gen = at::detail::createCPUGenerator(4);
  auto q = torch::randn({4, 3}, gen, torch::kDouble), k = torch::randn({8, 3}, gen, torch::kDouble);
  auto s = torch::tensor(1.0, torch::kDouble);
  auto labels = torch::tensor({0, 0, 1, 2}, torch::kLong), cand = torch::tensor({0, 1, 0, 2, 1, 1, 2, 0}, torch::kLong);
  auto plain = grouped_loss(q, k, s).item<double>();
  auto mask = grouped_loss(q, k, s, {}, GroupedLossOptions().labels(labels).candidate_labels(cand)).item<double>();
  auto multi =
      grouped_loss(q, k, s, {},
                   GroupedLossOptions().labels(labels).candidate_labels(cand).label_mode(LabelMode::kMultiPositive))
          .item<double>();
  EXPECT_GT(std::abs(plain - mask), 1e-3);
  EXPECT_GT(std::abs(plain - multi), 1e-3);
  EXPECT_GT(std::abs(mask - multi), 1e-3);
  // g = 1: candidate_labels default to labels, and the loss is one-directional
  // CLIP with the same labels.
  auto k1 = k.narrow(0, 0, 4);
  for (auto mode : {LabelMode::kMaskDuplicates, LabelMode::kMultiPositive}) {
    EXPECT_NEAR(
        grouped_loss(q, k1, s, {}, GroupedLossOptions().labels(labels).label_mode(mode)).item<double>(),
        clip_loss(q, k1, s, {}, ClipLossOptions().symmetric(false).labels(labels).label_mode(mode)).item<double>(),
        1e-12);
  }
}

// `o` on a finite-difference case's path: materialised (tile < 0) or the
// automatic path with that tile size; reduced by `red`.
template <typename Options>
Options on_path(Options o, int64_t tile, Reduction red) {
  return o.path(tile < 0 ? MemoryPath::kMaterialised : MemoryPath::kAuto)
      .tile_size(std::max<int64_t>(tile, 0))
      .reduction(red);
}

TEST(Grouped, FiniteDifferences) {
  auto gen = at::detail::createCPUGenerator(9);
  auto q = torch::randn({4, 3}, gen, torch::kDouble).requires_grad_(true);
  auto k = torch::randn({8, 3}, gen, torch::kDouble).requires_grad_(true);
  auto b2 = torch::randn({4, 3}, gen, torch::kDouble).requires_grad_(true);
  auto s = torch::tensor(std::log(2.0), torch::kDouble).requires_grad_(true);
  auto bias = torch::tensor(0.1, torch::kDouble).requires_grad_(true);
  auto labels = torch::tensor({0, 1, 0, 2}, torch::kLong), cand = torch::tensor({0, 1, 1, 0, 0, 2, 2, 1}, torch::kLong);
  using V = std::vector<torch::Tensor>;
  for (int64_t tile : {-1, 3}) {
    for (auto red : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      for (auto mode : {LabelMode::kMaskDuplicates, LabelMode::kMultiPositive}) {
        auto go = on_path(GroupedLossOptions(), tile, red).labels(labels).candidate_labels(cand).label_mode(mode);
        EXPECT_LE(finite_difference_error([&](const V& x) { return grouped_loss(x[0], x[1], x[2], x[3], go); },
                                          {q, k, s, bias}),
                  1e-7)
            << "grouped tile " << tile;
        for (bool sym : {true, false}) {
          auto co = on_path(ClipLossOptions().symmetric(sym), tile, red).labels(labels).label_mode(mode);
          EXPECT_LE(finite_difference_error([&](const V& x) { return clip_loss(x[0], x[1], x[2], x[3], co); },
                                            {q, b2, s, bias}),
                    1e-7)
              << "clip tile " << tile << " symmetric " << sym;
        }
      }
      auto go = on_path(GroupedLossOptions(), tile, red).normalize(true);
      EXPECT_LE(finite_difference_error([&](const V& x) { return grouped_loss(x[0], x[1], x[2], x[3], go); },
                                        {q, k, s, bias}),
                1e-7);
      auto mo = on_path(MocoV3LossOptions().temperature(0.5), tile, red);
      EXPECT_LE(finite_difference_error([&](const V& x) { return moco_v3_loss(x[0], x[1], x[2], x[3], mo); },
                                        {q, b2, k.narrow(0, 0, 4).detach(), k.narrow(0, 4, 4).detach()}),
                1e-7);
    }
  }
}

TEST(Grouped, SumAndNoneOfNTXentAndMoco) {
  auto gen = at::detail::createCPUGenerator(10);
  auto z1 = torch::randn({5, 3}, gen, torch::kDouble), z2 = torch::randn({5, 3}, gen, torch::kDouble);
  auto mean = nt_xent_loss(z1, z2, NTXentLossOptions().temperature(0.3)).item<double>();
  EXPECT_NEAR(nt_xent_loss(z1, z2, NTXentLossOptions().temperature(0.3).reduction(Reduction::kSum)).item<double>(),
              5 * mean, 1e-11);
  EXPECT_NEAR(mean, reference::nt_xent_loss(z1, z2, 0.3).item<double>(), 1e-12);
  auto k1 = torch::randn({5, 3}, gen, torch::kDouble), k2 = torch::randn({5, 3}, gen, torch::kDouble);
  auto mo = MocoV3LossOptions().temperature(0.2);
  auto m = moco_v3_loss(z1, z2, k1, k2, mo).item<double>();
  EXPECT_NEAR(m, reference::moco_v3_loss(z1, z2, k1, k2, 0.2).item<double>(), 1e-12);
  EXPECT_NEAR(moco_v3_loss(z1, z2, k1, k2, MocoV3LossOptions(mo).reduction(Reduction::kSum)).item<double>(), 5 * m,
              1e-11);
  auto rows = moco_v3_loss(z1, z2, k1, k2, MocoV3LossOptions(mo).reduction(Reduction::kNone));
  ASSERT_EQ(rows.sizes(), torch::IntArrayRef({5}));
  EXPECT_NEAR(rows.mean().item<double>(), m, 1e-12);
}

TEST(Grouped, NTXentReductionsAcrossRanks) {
  // kSum across ranks: the mean over ranks of L_r is the global sum.
  const std::vector<int64_t> rows{3, 0, 4};
  auto gen = at::detail::createCPUGenerator(12);
  auto z1 = torch::randn({7, 3}, gen, torch::kDouble), z2 = torch::randn({7, 3}, gen, torch::kDouble);
  const double ref = reference::nt_xent_loss(z1, z2, 0.5).item<double>() * 7;
  std::vector<double> v(3);
  run_ranks(3, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    v[r] = nt_xent_loss(shard(z1, rows, r), shard(z2, rows, r),
                        NTXentLossOptions().temperature(0.5).comm(comm).reduction(Reduction::kSum))
               .item<double>();
  });
  EXPECT_NEAR((v[0] + v[1] + v[2]) / 3, ref, 1e-10);
}

namespace {
// NT-Xent per-example losses on the whole batch (no normalisation): the mean of
// the two views' cross-entropies. [B].
torch::Tensor nt_xent_rows_ref(const torch::Tensor& z1, const torch::Tensor& z2, double T) {
  const int64_t B = z1.size(0);
  auto z = torch::cat({z1, z2});
  auto sim = torch::mm(z, z.t()) / T;
  sim = sim.masked_fill(torch::eye(2 * B, torch::kBool), -std::numeric_limits<double>::infinity());
  auto idx = torch::arange(2 * B, torch::kLong);
  auto labels = torch::where(idx < B, idx + B, idx - B);
  namespace F = torch::nn::functional;
  auto rows = F::cross_entropy(sim, labels, F::CrossEntropyFuncOptions().reduction(torch::kNone));
  return rows.view({2, B}).mean(0);
}
}  // namespace

TEST(Grouped, NTXentEveryReductionAcrossRanks) {
  for (int64_t W : {1, 2, 3, 4}) {
    const auto rows = default_row_counts(W);
    int64_t B = 0;
    for (auto r : rows) B += r;
    auto gen = at::detail::createCPUGenerator(13);
    auto z1 = torch::randn({B, 4}, gen, torch::kDouble), z2 = torch::randn({B, 4}, gen, torch::kDouble);
    auto up = torch::randn({B}, gen, torch::kDouble);
    for (auto red : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      // tile -1: materialised; 3: tiled over the gathered Z; 3 with ring: the
      // blocks travel (kNone included: the upstream gradients are gathered).
      for (auto [tile, ring] : std::vector<std::pair<int64_t, bool>>{{-1, false}, {3, false}, {3, true}}) {
        auto r1 = z1.clone().requires_grad_(true), r2 = z2.clone().requires_grad_(true);
        auto ref_rows = nt_xent_rows_ref(r1, r2, 0.5);
        auto R = red == Reduction::kNone ? (ref_rows * up).sum() : reference::reduce(ref_rows, red);
        R.backward();
        const double factor = red == Reduction::kNone ? 1.0 : static_cast<double>(W);
        std::vector<double> values(W);
        run_ranks(W, [&](const CommunicatorPtr& comm) {
          const int64_t r = comm->rank();
          auto l1 = shard(z1, rows, r).clone().requires_grad_(true),
               l2 = shard(z2, rows, r).clone().requires_grad_(true);
          auto out = nt_xent_loss(l1, l2,
                                  NTXentLossOptions()
                                      .temperature(0.5)
                                      .normalize(false)
                                      .comm(comm)
                                      .reduction(red)
                                      .path(tile < 0 ? MemoryPath::kMaterialised : MemoryPath::kAuto)
                                      .tile_size(std::max<int64_t>(tile, 0))
                                      .ring(ring));
          const std::string what = c10::str("W=", W, " tile ", tile, ring ? " ring" : "", " reduction ",
                                            static_cast<int>(red), " rank ", r);
          if (red == Reduction::kNone) {
            EXPECT_LE(rel_err(out.detach(), shard(ref_rows.detach(), rows, r)), 1e-10) << what;
            out.backward(shard(up, rows, r).clone());
          } else {
            values[r] = out.item<double>();
            out.backward();
          }
          if (rows[r] > 0) {
            EXPECT_LE(rel_err(l1.grad(), shard(r1.grad(), rows, r) * factor), 1e-10) << what;
            EXPECT_LE(rel_err(l2.grad(), shard(r2.grad(), rows, r) * factor), 1e-10) << what;
          }
        });
        if (red != Reduction::kNone) {
          double mean = 0;
          for (auto v : values) mean += v / static_cast<double>(W);
          EXPECT_NEAR(mean, R.item<double>(), 1e-10 * std::abs(R.item<double>()));
        }
      }
    }
  }
}

TEST(Grouped, NTXentFiniteDifferences) {
  auto gen = at::detail::createCPUGenerator(14);
  auto z1 = torch::randn({4, 3}, gen, torch::kDouble).requires_grad_(true);
  auto z2 = torch::randn({4, 3}, gen, torch::kDouble).requires_grad_(true);
  using V = std::vector<torch::Tensor>;
  for (int64_t tile : {-1, 3}) {
    for (auto red : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      auto o = NTXentLossOptions()
                   .temperature(0.4)
                   .path(tile < 0 ? MemoryPath::kMaterialised : MemoryPath::kAuto)
                   .tile_size(std::max<int64_t>(tile, 0))
                   .reduction(red);
      EXPECT_LE(finite_difference_error([&](const V& x) { return nt_xent_loss(x[0], x[1], o); }, {z1, z2}), 1e-7)
          << "tile " << tile << " reduction " << static_cast<int>(red);
    }
  }
}

TEST(Grouped, HalfPrecisionWithLabelsAccumulatesInFloat) {
  auto gen = at::detail::createCPUGenerator(15);
  auto q = torch::randn({6, 8}, gen, torch::kDouble), k = torch::randn({12, 8}, gen, torch::kDouble);
  auto s = torch::tensor(std::log(10.0), torch::kDouble);
  auto labels = torch::tensor({0, 1, 0, 2, 1, 3}, torch::kLong);
  auto cand = torch::tensor({0, 1, 1, 0, 0, 2, 2, 1, 1, 3, 3, 0}, torch::kLong);
  for (auto dt : {torch::kHalf, torch::kBFloat16}) {
    for (auto mode : {LabelMode::kMaskDuplicates, LabelMode::kMultiPositive}) {
      for (int64_t tile : {-1, 4}) {
        auto o = GroupedLossOptions()
                     .labels(labels)
                     .candidate_labels(cand)
                     .label_mode(mode)
                     .path(tile < 0 ? MemoryPath::kMaterialised : MemoryPath::kAuto)
                     .tile_size(std::max<int64_t>(tile, 0))
                     .normalize(true);
        auto want = grouped_loss(q, k, s, {}, o).item<double>();
        auto qh = q.to(dt).requires_grad_(true);
        auto l = grouped_loss(qh, k.to(dt), s.to(torch::kFloat), {}, o);
        EXPECT_EQ(l.scalar_type(), torch::kFloat);
        EXPECT_NEAR(l.item<double>(), want, 2e-2 * std::abs(want));
        l.backward();
        EXPECT_TRUE(qh.grad().isfinite().all().item<bool>());
      }
    }
  }
}
