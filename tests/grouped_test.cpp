// Grouped candidates (hard negatives), labels (multi-positive / duplicate
// masking) and per-row reductions of the InfoNCE-family engine, against the
// plain-autograd single-process references of contrax/losses/reference.h on the
// concatenated batch: fp64, W = 1..4, uneven batches and an empty rank, every
// memory path; finite differences; the error messages; the porting warning.
#include "contrax/losses/grouped.h"

#include <gtest/gtest.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <mutex>

#include "contrax/check/plan.h"
#include "contrax/check/verify.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/tiled.h"
#include "contrax/util/memory.h"
#include "support/errors.h"
#include "support/ranks.h"
#include "support/strict_warnings.h"

using namespace contrax;
using contrax::testing::finite_difference_error;
using contrax::testing::rel_err;
using contrax::testing::run_ranks;
using contrax::testing::run_ranks_collect_errors;
using contrax::testing::shard;

namespace {

// kRing: the ring over send/receive pairs (Gloo's default); kRingAllToAll:
// over one all-to-all per step (NCCL's, run here over Gloo).
enum class Path { kMaterialised, kTiled, kRing, kRingAllToAll };

struct Case {
  std::string name;
  int64_t group = 0;  // 0: clip_loss; >= 1: grouped_loss with g candidates per query
  bool symmetric = true;
  bool labels = false;
  LabelMode mode = LabelMode::kMultiPositive;
  Reduction reduction = Reduction::kMean;
  Path path = Path::kMaterialised;
};

std::string describe(const Case& c) {
  static const char* red[] = {"mean", "sum", "none"};
  static const char* path[] = {"materialised", "tiled", "ring", "ring_all_to_all"};
  return c10::str(c.group == 0 ? (c.symmetric ? "clip" : "infonce") : c10::str("grouped_g", c.group),
                  c.labels ? (c.mode == LabelMode::kMultiPositive ? "+multi" : "+mask") : "",
                  " reduction=", red[static_cast<int>(c.reduction)], " path=", path[static_cast<int>(c.path)]);
}

// Global fp64 inputs, the same on every rank.
struct Inputs {
  torch::Tensor q, k, scale, bias, labels, cand_labels, upstream;
};

Inputs draw(const Case& c, int64_t B, int64_t d = 5) {
  auto gen = at::detail::createCPUGenerator(77);
  const int64_t g = c.group == 0 ? 1 : c.group;
  Inputs in;
  in.q = torch::randn({B, d}, gen, torch::kDouble);
  in.k = torch::randn({B * g, d}, gen, torch::kDouble);
  in.scale = torch::tensor(std::log(3.0), torch::kDouble);
  in.bias = torch::tensor(0.3, torch::kDouble);
  // Few distinct labels: plenty of duplicates, across ranks too.
  in.labels = torch::randint(0, std::max<int64_t>(2, B / 2), {B}, gen, torch::kLong);
  in.cand_labels = torch::randint(0, std::max<int64_t>(2, B / 2), {B * g}, gen, torch::kLong);
  in.cand_labels.view({B, g}).select(1, 0).copy_(in.labels);  // a positive carries its query's id
  in.upstream = torch::randn({B}, gen, torch::kDouble);
  return in;
}

torch::Tensor run_loss(const Case& c, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                       const torch::Tensor& bias, const torch::Tensor& labels, const torch::Tensor& cand_labels,
                       const CommunicatorPtr& comm) {
  const int64_t tile = c.path == Path::kMaterialised ? -1 : 3;
  if (c.group == 0) {
    auto o = ClipLossOptions()
                 .symmetric(c.symmetric)
                 .comm(comm)
                 .reduction(c.reduction)
                 .path(tile < 0 ? MemoryPath::kMaterialised : MemoryPath::kAuto)
                 .tile_size(std::max<int64_t>(tile, 0))
                 .ring(c.path == Path::kRing || c.path == Path::kRingAllToAll);
    if (c.labels) o.labels(labels).label_mode(c.mode);
    return clip_loss(q, k, scale, bias, o);
  }
  auto o = GroupedLossOptions()
               .comm(comm)
               .reduction(c.reduction)
               .path(tile < 0 ? MemoryPath::kMaterialised : MemoryPath::kAuto)
               .tile_size(std::max<int64_t>(tile, 0))
               .ring(c.path == Path::kRing || c.path == Path::kRingAllToAll);
  if (c.labels) o.labels(labels).candidate_labels(cand_labels).label_mode(c.mode);
  return grouped_loss(q, k, scale, bias, o);
}

torch::Tensor reference_rows(const Case& c, const Inputs& in, const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& scale, const torch::Tensor& bias) {
  if (c.group == 0) {
    return reference::clip_rows(q, k, scale, bias, c.symmetric, 100.0, false, c.labels ? in.labels : torch::Tensor(),
                                c.mode);
  }
  return reference::grouped_rows(q, k, scale, bias, 100.0, false, c.labels ? in.labels : torch::Tensor(),
                                 c.labels ? in.cand_labels : torch::Tensor(), c.mode);
}

// One case at one world size and row pattern: the value each rank returns and
// the gradients of its rows and of the scalars, against the reference (see the
// gradient convention in src/engine/engine.h and Reduction in contrax/util/vocabulary.h).
void expect_exact(const Case& c, const std::vector<int64_t>& rows) {
  const int64_t W = static_cast<int64_t>(rows.size());
  int64_t B = 0;
  for (auto r : rows) B += r;
  const int64_t g = c.group == 0 ? 1 : c.group;
  const auto in = draw(c, B);

  // Reference: R = sum_i w_i l_i with w = 1/B (mean), 1 (sum), upstream (none).
  auto q = in.q.clone().requires_grad_(true), k = in.k.clone().requires_grad_(true);
  auto s = in.scale.clone().requires_grad_(true), bias = in.bias.clone().requires_grad_(true);
  auto ref_rows = reference_rows(c, in, q, k, s, bias);
  auto R = c.reduction == Reduction::kNone ? (ref_rows * in.upstream).sum() : reference::reduce(ref_rows, c.reduction);
  R.backward();
  // Expected per-rank gradients: W dR/dx for mean/sum (the mean over ranks is R),
  // dR/dx for none (each rank backpropagates its own weighted sum).
  const double factor = c.reduction == Reduction::kNone ? 1.0 : static_cast<double>(W);

  std::vector<torch::Tensor> out(W), dq(W), dk(W);
  std::vector<double> ds(W), dbias(W);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    auto lq = shard(in.q, rows, r).clone().requires_grad_(true);
    auto lk = shard(in.k.view({B, g, -1}), rows, r).reshape({-1, in.k.size(1)}).clone().requires_grad_(true);
    auto ls = in.scale.clone().requires_grad_(true), lb = in.bias.clone().requires_grad_(true);
    auto labels = shard(in.labels, rows, r).clone();
    auto cand = shard(in.cand_labels.view({B, g}), rows, r).reshape({-1}).clone();
    auto o = run_loss(c, lq, lk, ls, lb, labels, cand, comm);
    if (c.reduction == Reduction::kNone) {
      o.backward(shard(in.upstream, rows, r).clone());
    } else {
      o.backward();
    }
    out[r] = o.detach();
    dq[r] = lq.grad();
    dk[r] = lk.grad();
    ds[r] = ls.grad().item<double>();
    dbias[r] = lb.grad().item<double>();
  }, std::chrono::seconds(30), [&](int64_t, CommunicatorOptions& o) {
    o.ring_transport(c.path == Path::kRingAllToAll ? RingTransport::kAllToAll : RingTransport::kSendRecv);
  });

  const std::string what = c10::str(describe(c), " rows=", c10::ArrayRef<int64_t>(rows));
  constexpr double tol = 1e-10;
  double mean_value = 0.0, sum_ds = 0.0, sum_dbias = 0.0;
  for (int64_t r = 0; r < W; ++r) {
    if (c.reduction == Reduction::kNone) {
      ASSERT_EQ(out[r].dim(), 1) << what;
      EXPECT_LE(rel_err(out[r], shard(ref_rows.detach(), rows, r)), tol) << what << " rank " << r;
    } else {
      mean_value += out[r].item<double>() / static_cast<double>(W);
    }
    if (rows[r] > 0) {
      EXPECT_LE(rel_err(dq[r], shard(q.grad(), rows, r) * factor), tol) << what << " dq rank " << r;
      auto ref_dk = shard(k.grad().view({B, g, -1}), rows, r).reshape({-1, in.k.size(1)}) * factor;
      EXPECT_LE(rel_err(dk[r], ref_dk), tol) << what << " dk rank " << r;
    }
    sum_ds += ds[r];
    sum_dbias += dbias[r];
  }
  if (c.reduction != Reduction::kNone) {
    EXPECT_NEAR(mean_value, R.item<double>(), tol * std::abs(R.item<double>()) + 1e-12) << what;
  }
  // Scalars: the mean over ranks is dL/ds: dR/ds (mean/sum, L = R); for none
  // L = R / W, so the sum over ranks is dR/ds.
  const double scalar_div = c.reduction == Reduction::kNone ? 1.0 : static_cast<double>(W);
  EXPECT_NEAR(sum_ds / scalar_div, s.grad().item<double>(), 1e-9 * (1 + std::abs(s.grad().item<double>())))
      << what << " dlogit_scale";
  EXPECT_NEAR(sum_dbias / scalar_div, bias.grad().item<double>(), 1e-9) << what << " dbias";
}

std::vector<std::vector<int64_t>> patterns(int64_t W) {
  std::vector<std::vector<int64_t>> p{default_row_counts(W)};  // uneven, with an empty rank from W = 3
  if (W == 2) p.push_back({0, 5});
  if (W >= 2) p.push_back(std::vector<int64_t>(W, 3));
  return p;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (auto red : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    for (auto path : {Path::kMaterialised, Path::kTiled, Path::kRing, Path::kRingAllToAll}) {
      if (path == Path::kRingAllToAll && red != Reduction::kMean) continue;  // one reduction is enough for the transport
      // grouped: plain (g = 1, 2, 4) and with labels in both modes
      for (int64_t g : {1, 2, 4}) cases.push_back({"", g, false, false, LabelMode::kMaskDuplicates, red, path});
      for (auto mode : {LabelMode::kMaskDuplicates, LabelMode::kMultiPositive}) {
        cases.push_back({"", 2, false, true, mode, red, path});
        // CLIP symmetric and one-directional with labels, and plain
        cases.push_back({"", 0, true, true, mode, red, path});
        cases.push_back({"", 0, false, true, mode, red, path});
      }
      cases.push_back({"", 0, true, false, LabelMode::kMultiPositive, red, path});
      cases.push_back({"", 0, false, false, LabelMode::kMultiPositive, red, path});
    }
  }
  return cases;
}

}  // namespace

class GroupedWorld : public ::testing::TestWithParam<int64_t> {};

TEST_P(GroupedWorld, EveryCaseEqualsTheSingleProcessReference) {
  const int64_t W = GetParam();
  for (const auto& c : all_cases()) {
    if ((c.path == Path::kRing || c.path == Path::kRingAllToAll) && W == 1) continue;  // no ring without peers
    for (const auto& rows : patterns(W)) expect_exact(c, rows);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, GroupedWorld, ::testing::Values(1, 2, 3, 4));

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

TEST(GroupedErrors, LocalArgumentChecks) {
  auto q = torch::randn({3, 4}), k = torch::randn({6, 4}), s = torch::tensor(1.0);
  CONTRAX_EXPECT_ERROR(grouped_loss(q, torch::randn({7, 4}), s),
                       "grouped_loss(): argument 'candidates' must have g * queries.size(0) rows");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, torch::randn({2, 4}), s),
                       "grouped_loss(): argument 'candidates' must have g * queries.size(0) rows");
  CONTRAX_EXPECT_ERROR(grouped_loss(torch::randn({0, 4}), torch::randn({2, 4}), s),
                       "argument 'candidates' must be empty on a rank with no queries");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, torch::randn({6, 5}), s),
                       "arguments 'queries' and 'candidates' must have the same width");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, torch::randn({6, 4}, torch::kDouble), s),
                       "arguments 'queries' and 'candidates' must have the same dtype");
  CONTRAX_EXPECT_ERROR(grouped_loss(torch::randn({4}), k, s), "argument 'queries' must be a 2-D tensor");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, torch::ones({2})), "argument 'logit_scale' must be a 0-dim tensor");
  auto lab = torch::tensor({0, 1, 2}, torch::kLong), cand = torch::zeros({6}, torch::kLong);
  CONTRAX_EXPECT_ERROR(
      grouped_loss(q, k, s, {}, GroupedLossOptions().labels(lab.to(torch::kInt)).candidate_labels(cand)),
      "argument 'labels' must be an int64 tensor");
  CONTRAX_EXPECT_ERROR(
      grouped_loss(q, k, s, {}, GroupedLossOptions().labels(torch::zeros({4}, torch::kLong)).candidate_labels(cand)),
      "argument 'labels' must have shape [3]");
  CONTRAX_EXPECT_ERROR(
      grouped_loss(q, k, s, {}, GroupedLossOptions().labels(lab).candidate_labels(torch::zeros({3}, torch::kLong))),
      "argument 'candidate_labels' must have shape [6]");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, s, {}, GroupedLossOptions().labels(lab)),
                       "argument 'labels' needs 'candidate_labels' when there are hard negatives (g = 2");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, s, {}, GroupedLossOptions().candidate_labels(cand)),
                       "argument 'candidate_labels' needs 'labels'");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, s, {}, GroupedLossOptions().label_mode(LabelMode::kMultiPositive)),
                       "argument 'label_mode' (kMultiPositive) needs 'labels'");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, s, {}, GroupedLossOptions().tile_size(-2)),
                       "grouped_loss(): argument 'tile_size' must be >= 0 (the tile side");
  CONTRAX_EXPECT_ERROR(grouped_loss(torch::randn({0, 4}), torch::randn({0, 4}), s),
                       "grouped_loss(): the global batch is empty");
  // clip_loss
  auto a = torch::randn({3, 4}), b = torch::randn({3, 4});
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().labels(torch::zeros({3}))),
                       "clip_loss(): argument 'labels' must be an int64 tensor, but got dtype Float");
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().labels(torch::zeros({3, 1}, torch::kLong))),
                       "argument 'labels' must have shape [3]");
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().label_mode(LabelMode::kMaskDuplicates)),
                       "argument 'label_mode' (kMaskDuplicates) needs 'labels'");
}

TEST(GroupedErrors, LabelsOnAnotherDevice) {
  // The meta device stands in for a GPU: any device but the features' is refused.
  auto a = torch::randn({3, 4}), s = torch::tensor(1.0);
  auto meta = torch::empty({3}, torch::TensorOptions().dtype(torch::kLong).device(torch::kMeta));
  CONTRAX_EXPECT_ERROR(clip_loss(a, a, s, {}, ClipLossOptions().labels(meta)),
                       "clip_loss(): argument 'labels' must be on the features' device (cpu), but got meta");
  auto cand = torch::empty({6}, torch::TensorOptions().dtype(torch::kLong).device(torch::kMeta));
  CONTRAX_EXPECT_ERROR(
      grouped_loss(a, torch::randn({6, 4}), s, {},
                   GroupedLossOptions().labels(torch::zeros({3}, torch::kLong)).candidate_labels(cand)),
      "grouped_loss(): argument 'candidate_labels' must be on the features' device (cpu)");
}

TEST(GroupedErrors, GroupSizeMustAgreeAcrossRanks) {
  auto errors = run_ranks_collect_errors(3, [](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    const int64_t g = r == 2 ? 3 : 2;
    const int64_t b = r == 1 ? 0 : 2;  // the empty rank knows no g and must not object
    grouped_loss(torch::randn({b, 4}), torch::randn({b * g, 4}), torch::tensor(1.0), {},
                 GroupedLossOptions().comm(comm));
  });
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("grouped_loss(): argument 'candidates' must hold the same number of candidates per query "
                             "(g) on every rank, but g is 3 on rank 2 and 2 on rank 0"),
              std::string::npos)
        << errors[r];
  }
  // An empty rank next to g = 3 ranks works (checked for value above in GroupedWorld).
  auto ok = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    const int64_t b = comm->rank() == 0 ? 0 : 2;
    grouped_loss(torch::randn({b, 4}), torch::randn({b * 3, 4}), torch::tensor(1.0), {},
                 GroupedLossOptions().comm(comm));
  });
  EXPECT_EQ(ok[0], "");
  EXPECT_EQ(ok[1], "");
}

TEST(GroupedErrors, BadLabelsOnOneRankIsAnErrorOnAllRanks) {
  auto errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto labels = comm->rank() == 1 ? torch::zeros({2}, torch::kLong) : torch::zeros({3}, torch::kLong);
    clip_loss(torch::randn({3, 4}), torch::randn({3, 4}), torch::tensor(1.0), {},
              ClipLossOptions().comm(comm).labels(labels));
  });
  EXPECT_NE(errors[1].find("argument 'labels' must have shape [3]"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("clip_loss(): rank 1 passed an invalid argument"), std::string::npos) << errors[0];
}

using contrax::testing::WarningCapture;

TEST(GroupedWarnings, ScaleInsteadOfItsLogWarnsOnce) {
  auto a = torch::randn({3, 4}), b = torch::randn({3, 4});
  WarningCapture capture;
  // Normal values (the log of 1/0.07, and the clamp itself) say nothing.
  clip_loss(a, b, torch::tensor(std::log(1 / 0.07)));
  clip_loss(a, b, torch::tensor(std::log(100.0) + 0.5));
  grouped_loss(a, b, torch::tensor(2.0));
  EXPECT_TRUE(capture.messages.empty()) << capture.messages.front();
  // 1/0.07 = 14.3 passed as the log: one warning, however many calls.
  for (int i = 0; i < 3; ++i) clip_loss(a, b, torch::tensor(1 / 0.07));
  ASSERT_EQ(capture.messages.size(), 1u);
  EXPECT_NE(capture.messages[0].find("logit_scale=14.2857 is the log of the scale (Contrax clamps exp(logit_scale) at "
                                     "100): pass log(1/0.07)=2.66, not 1/0.07=14.3 as open_clip/Inf-CL do"),
            std::string::npos)
      << capture.messages[0];
  grouped_loss(a, b, torch::tensor(100.0));
  EXPECT_EQ(capture.messages.size(), 1u);  // once per process, whichever loss
}

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

// The README's snippet, as written there (single device here; `comm` may be any
// communicator).
TEST(GroupedReadme, SnippetRuns) {
  auto comm = Communicator::single();
  const int64_t b = 4, g = 3, d = 8;
  auto q = torch::randn({b, d}, torch::requires_grad()), cands = torch::randn({b * g, d}, torch::requires_grad());
  auto logit_scale = torch::tensor(std::log(1 / 0.05), torch::requires_grad());
  auto doc_id = torch::tensor({10, 11, 12, 10}, torch::kLong);  // queries 0 and 3 share their answer
  auto cand_doc_id = torch::randint(0, 100, {b * g}, torch::kLong);
  cand_doc_id.view({b, g}).select(1, 0).copy_(doc_id);
  auto img = torch::randn({b, d}, torch::requires_grad()), txt = torch::randn({b, d}, torch::requires_grad());
  auto cls = torch::tensor({0, 1, 0, 2}, torch::kLong);
  auto weight = torch::rand({b});
  // --- README snippet begins
  // Retrieval with hard negatives: queries [b, d], candidates [b * g, d] (each
  // query's positive, then g-1 mined negatives); every rank's candidates are
  // negatives of every query. A candidate that is the same document as the
  // query's answer (elsewhere in the global batch) is masked, not a negative.
  auto loss = contrax::grouped_loss(
      q, cands, logit_scale, {},
      contrax::GroupedLossOptions().comm(comm).normalize(true).labels(doc_id).candidate_labels(cand_doc_id));
  loss.backward();
  // CLIP with class labels (supervised-contrastive positives), per-row losses
  // weighted by the caller.
  auto rows = contrax::clip_loss(img, txt, logit_scale, {},
                                 contrax::ClipLossOptions()
                                     .comm(comm)
                                     .normalize(true)
                                     .labels(cls)
                                     .label_mode(contrax::LabelMode::kMultiPositive)
                                     .reduction(contrax::Reduction::kNone));  // [b_r]
  (rows * weight).sum().backward();
  // --- README snippet ends
  EXPECT_EQ(rows.sizes(), torch::IntArrayRef({b}));
  EXPECT_TRUE(q.grad().defined() && cands.grad().defined() && img.grad().defined());
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
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
