// The loss engine under the front ends: one row block per rank, one logits
// buffer, O(B) extra bytes; the bytes each loss moves, finite differences,
// and the errors of a second backward.

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <iostream>

#include "contrax/comm/collectives.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/util/memory.h"
#include "engine/panels.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::run_ranks;

// ---- the engine: one row block per rank, one logits buffer, O(B) extra bytes ----

namespace {
int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}
}  // namespace

// Symmetric CLIP gathers one tower (b_r d) and reduce-scatters its gradient
// ((B - b_r) d), plus the column log-sum-exps ((W-1) B floats); the old
// formulation moved both towers both ways.
TEST(LossEngine, ClipMovesOneTowerPlusOrderB) {
  for (int64_t W : {2, 3}) {
    const int64_t d = 8;
    std::vector<int64_t> counts(W, 5);
    const int64_t B = sum_of(counts);
    run_ranks(W, [&](const CommunicatorPtr& comm) {
      const int64_t b = counts[comm->rank()];
      auto a = torch::randn({b, d}, torch::kDouble).requires_grad_(true);
      auto t = torch::randn({b, d}, torch::kDouble).requires_grad_(true);
      auto ls = torch::tensor(1.0, torch::kDouble).requires_grad_(true);
      comm->reset_stats();
      auto loss = clip_loss(a, t, ls, c10::nullopt, ClipLossOptions().comm(comm).path(MemoryPath::kMaterialised));
      auto fwd = comm->stats();
      EXPECT_EQ(fwd.op("all_gather").bytes_sent, (W - 1) * b * d * 8);
      EXPECT_EQ(fwd.op("lse_all_gather").bytes_sent, (W - 1) * B * 8);
      EXPECT_EQ(fwd.op("reduce_scatter").calls, 0);
      comm->reset_stats();
      loss.backward();
      auto bwd = comm->stats();
      EXPECT_EQ(bwd.op("reduce_scatter").bytes_sent, (B - b) * d * 8);
      EXPECT_EQ(bwd.total_bytes_sent(), (B - b) * d * 8);
    });
  }
}

// NT-Xent gathers Z once without gradient plus every row's lse, and moves
// nothing at all in backward.
TEST(LossEngine, NTXentHasNoBackwardCollective) {
  for (int64_t W : {2, 4}) {
    const int64_t d = 8, b = 3;
    run_ranks(W, [&](const CommunicatorPtr& comm) {
      auto z1 = torch::randn({b, d}, torch::kDouble).requires_grad_(true);
      auto z2 = torch::randn({b, d}, torch::kDouble).requires_grad_(true);
      comm->reset_stats();
      auto loss = nt_xent_loss(z1, z2, NTXentLossOptions().comm(comm).path(MemoryPath::kMaterialised));
      auto fwd = comm->stats();
      EXPECT_EQ(fwd.op("all_gather_no_grad").bytes_sent, (W - 1) * b * 2 * d * 8);
      EXPECT_EQ(fwd.op("lse_all_gather").bytes_sent, (W - 1) * b * 2 * 8);
      EXPECT_EQ(fwd.op("all_gather").calls, 0);
      comm->reset_stats();
      loss.backward();
      EXPECT_EQ(comm->stats().total_calls(), 0);
      EXPECT_EQ(comm->stats().total_bytes_sent(), 0);
    });
  }
}

// Finite differences through the engine's functions on one device: CLIP in
// both forms with bias, InfoNCE keys without gradient (MoCo's use), NT-Xent
// without normalisation (the -inf mask in the raw block).
TEST(LossEngine, FiniteDifferences) {
  auto gen = at::detail::createCPUGenerator(9);
  auto a = torch::randn({5, 3}, gen, torch::kDouble).requires_grad_(true);
  auto b = torch::randn({5, 3}, gen, torch::kDouble).requires_grad_(true);
  auto s = torch::tensor(std::log(2.5), torch::kDouble).requires_grad_(true);
  auto bias = torch::tensor(-0.4, torch::kDouble).requires_grad_(true);
  using V = std::vector<torch::Tensor>;
  for (bool symmetric : {true, false}) {
    EXPECT_LE(contrax::testing::finite_difference_error(
                  [symmetric](const V& x) {
                    return clip_loss(x[0], x[1], x[2], x[3],
                                     ClipLossOptions().symmetric(symmetric).path(MemoryPath::kMaterialised));
                  },
                  {a, b, s, bias}),
              1e-7)
        << "symmetric " << symmetric;
  }
  EXPECT_LE(contrax::testing::finite_difference_error(
                [](const V& x) {
                  return nt_xent_loss(
                      x[0], x[1],
                      NTXentLossOptions().temperature(0.7).normalize(false).path(MemoryPath::kMaterialised));
                },
                {a, b}),
            1e-7);
}

TEST(LossEngine, SecondBackwardThroughTheSameGraphIsAnError) {
  auto a = torch::randn({4, 3}, torch::kDouble).requires_grad_(true);
  auto s = torch::tensor(0.5, torch::kDouble);
  auto loss = clip_loss(a, a * 2, s);
  loss.backward({}, /*retain_graph=*/true);
  CONTRAX_EXPECT_ERROR(loss.backward(), "clip_loss(): backward ran twice through the same graph");
  auto nt = nt_xent_loss(a, a * 2);
  nt.backward({}, /*retain_graph=*/true);
  CONTRAX_EXPECT_ERROR(nt.backward(), "nt_xent_loss(): backward ran twice through the same graph");
}

// The engine's backward errors name the function that was called, whichever
// front end led to the block (issue 26: they used to say clip_loss()).
TEST(LossEngine, BackwardErrorsNameTheCaller) {
  auto q = torch::randn({4, 3}, torch::kDouble).requires_grad_(true);
  auto s = torch::tensor(0.5, torch::kDouble);
  auto grouped = [&](MemoryPath path) {
    return grouped_loss(q, q * 2, s, {}, GroupedLossOptions().path(path));
  };
  auto moco = [&](MemoryPath path) {
    return moco_v3_loss(q, q * 2, q * 3, q * 4, MocoV3LossOptions().path(path));
  };
  auto twice = grouped(MemoryPath::kMaterialised);
  twice.backward({}, /*retain_graph=*/true);
  CONTRAX_EXPECT_ERROR(twice.backward(), "grouped_loss(): backward ran twice through the same graph");
  twice = moco(MemoryPath::kMaterialised);
  twice.backward({}, /*retain_graph=*/true);
  CONTRAX_EXPECT_ERROR(twice.backward(), "moco_v3_loss(): backward ran twice through the same graph");
  auto grad_of_grad = [&](const torch::Tensor& loss) {
    torch::autograd::grad({loss}, {q}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  };
  for (auto path : {MemoryPath::kMaterialised, MemoryPath::kTiled}) {
    CONTRAX_EXPECT_ERROR(grad_of_grad(grouped(path)), "grouped_loss(): double backward (create_graph=true)");
    CONTRAX_EXPECT_ERROR(grad_of_grad(moco(path)), "moco_v3_loss(): double backward (create_graph=true)");
  }
  const auto tiles = MemoryPathOptions().path(MemoryPath::kTiled);
  CONTRAX_EXPECT_ERROR(grad_of_grad(clip_loss(q, q * 2, s, c10::nullopt, ClipLossOptions().memory(tiles))),
                       "clip_loss(): double backward");
  CONTRAX_EXPECT_ERROR(grad_of_grad(nt_xent_loss(q, q * 2, NTXentLossOptions().memory(tiles))),
                       "nt_xent_loss(): double backward");
}

// The materialised path holds one logits buffer per rank and no second one:
// the old formulation held three per direction (logits, log_softmax, its
// gradient).
TEST(LossEngine, MaterialisedPathAllocatesOneLogitsBuffer) {
  at::set_num_threads(1);
  const int64_t B = 2048, d = 16;
  const int64_t logits = B * B * 4;
  // Besides the buffer: one 1 MiB chunk temporary (log-sum-exps, G), a few
  // feature-sized tensors (copies, gradients) of B d 4 bytes each, and where
  // the fused kernels are off (CONTRAX_FUSED_KERNELS=0) the ATen passes'
  // temporary of one panel: the CPU's panels hold about 8 MiB of logits
  // (engine/panels.h), here 8 MiB / (B x 4 bytes) = 1,024 rows of B columns,
  // 8 MiB (measured 25.9 MB peak against the buffer's 16.8 MB).
  const int64_t panel = contrax::detail::buffer_panel_rows(c10::kCPU, torch::kFloat, B, B, d, 0) * B * 4;
  const int64_t allowance =
      (int64_t{1} << 20) + 8 * B * d * 4 + (contrax::detail::fused_passes(c10::kCPU) ? 0 : panel);
  torch::manual_seed(4);
  auto a = torch::randn({B, d}).requires_grad_(true), t = torch::randn({B, d}).requires_grad_(true);
  auto ls = torch::tensor(2.0f).requires_grad_(true);
  auto peak = [](const std::function<void()>& fn) {
    MemoryTracker::install();
    PeakScope scope;
    fn();
    return scope.peak_above_start();
  };
  for (bool symmetric : {true, false}) {
    const int64_t p = peak([&] {
      clip_loss(a, t, ls, c10::nullopt,
                ClipLossOptions().symmetric(symmetric).normalize(true).path(MemoryPath::kMaterialised))
          .backward();
    });
    std::cout << "[ memory ] clip symmetric=" << symmetric << " B=" << B << ": peak " << p << " bytes, [B x B] = "
              << logits << "\n";
    EXPECT_GE(p, logits);
    EXPECT_LE(p, logits + allowance) << "symmetric " << symmetric;
  }
  // NT-Xent: one [2b x 2B] buffer.
  const int64_t b = B / 2;
  auto z1 = a.narrow(0, 0, b), z2 = t.narrow(0, 0, b);
  const int64_t p = peak([&] { nt_xent_loss(z1, z2, NTXentLossOptions().path(MemoryPath::kMaterialised)).backward(); });
  std::cout << "[ memory ] nt_xent b=" << b << ": peak " << p << " bytes, [2b x 2b] = " << 4 * b * b * 4 << "\n";
  EXPECT_GE(p, 4 * b * b * 4);
  EXPECT_LE(p, 4 * b * b * 4 + allowance);
}
