// Grouped candidates (hard negatives), labels (multi-positive / duplicate
// masking) and per-row reductions of the InfoNCE-family engine, every case
// against the plain-autograd single-process reference of
// contrax/losses/reference.h on the concatenated batch: fp64, W = 1..4,
// uneven batches and an empty rank, every memory path.

#include <gtest/gtest.h>

#include <cmath>

#include "contrax/check/verify.h"
#include "contrax/comm/collectives.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::rel_err;
using contrax::testing::run_ranks;
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
