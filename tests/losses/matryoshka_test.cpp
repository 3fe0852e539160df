// Matryoshka prefixes (MatryoshkaOptions, engine/scorer.h) beyond what
// verify's fp64 cases check at W = 1..4 (tests/check/loss_world_test.cpp):
// every error message, the full width alone is the normalised loss, the
// per-row and summed reductions against the plain loop, fp32 and bf16 within
// the losses' tolerances, the shared pass of CLIP's prefixes (one buffer,
// the loop's results across ranks), and the loop counting one logits block
// per prefix.

#include <gtest/gtest.h>

#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"
#include "contrax/util/memory.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::run_ranks;
using contrax::testing::run_ranks_collect_errors;
using V = std::vector<torch::Tensor>;

namespace {

// One call of `loss` on a fresh copy of `a0` with its backward: the loss, the
// copy's gradient, and in `peak` the bytes held above the call's start.
template <class Loss>
std::pair<torch::Tensor, torch::Tensor> measured(const torch::Tensor& a0, int64_t& peak, const Loss& loss) {
  auto a = a0.clone().requires_grad_(true);
  MemoryTracker::install();
  PeakScope scope;
  auto l = loss(a);
  l.backward();
  peak = scope.peak_above_start();
  return {l.detach(), a.grad()};
}

}  // namespace

TEST(Matryoshka, EveryBadOptionIsNamed) {
  auto x = torch::randn({4, 8}), s = torch::tensor(1.0);
  CONTRAX_EXPECT_ERROR(clip_loss(x, x, s, {}, ClipLossOptions().matryoshka_dims({4, 9})),
                       "clip_loss(): argument 'matryoshka_dims' must hold widths in [1, 8] (the features' width), but "
                       "got 9");
  CONTRAX_EXPECT_ERROR(nt_xent_loss(x, x, NTXentLossOptions().matryoshka_dims({0})),
                       "nt_xent_loss(): argument 'matryoshka_dims' must hold widths in [1, 8] (the features' width), "
                       "but got 0");
  CONTRAX_EXPECT_ERROR(moco_v3_loss(x, x, x, x, MocoV3LossOptions().matryoshka_dims({2, 4, 2})),
                       "moco_v3_loss(): argument 'matryoshka_dims' must not repeat a width, but 2 appears more than "
                       "once");
  CONTRAX_EXPECT_ERROR(siglip_loss(x, x, s, {}, SigLipLossOptions().matryoshka_dims({2, 4}).matryoshka_weights({1})),
                       "siglip_loss(): argument 'matryoshka_weights' must hold one weight per entry of "
                       "'matryoshka_dims' (2) or none, but got 1");
  CONTRAX_EXPECT_ERROR(grouped_loss(x, x, s, {}, GroupedLossOptions().matryoshka_dims({2}).matryoshka_weights({NAN})),
                       "grouped_loss(): argument 'matryoshka_weights' must hold finite numbers, but got nan");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x, s, {}, ClipLossOptions().matryoshka_weights({1.0})),
                       "clip_loss(): argument 'matryoshka_weights' needs 'matryoshka_dims'");
  // One rank's bad prefix is an error on every rank, and no rank hangs.
  const auto errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto a = torch::randn({3, comm->rank() == 1 ? 2 : 4});
    clip_loss(a, a, torch::tensor(1.0), {}, ClipLossOptions().comm(comm).matryoshka_dims({3}));
  });
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[1].find("clip_loss(): argument 'matryoshka_dims' must hold widths in [1, 2]"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("rank 1 passed an invalid argument"), std::string::npos) << errors[0];
}

// The full width alone (given, or the only prefix) is the loss on normalised
// features, to round-off.
TEST(Matryoshka, TheFullWidthAloneIsTheNormalisedLoss) {
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  auto a = torch::randn({6, 5}, opt), b = torch::randn({6, 5}, opt), s = torch::tensor(2.0, opt);
  const auto plain = clip_loss(a, b, s, {}, ClipLossOptions().normalize(true));
  for (double w : {1.0, 0.25}) {
    const auto one = clip_loss(a, b, s, {}, ClipLossOptions().matryoshka_dims({5}).matryoshka_weights({w}));
    EXPECT_NEAR(one.item<double>(), w * plain.item<double>(), 1e-13);
  }
}

// reduction kNone and kSum over prefixes at W = 2 with an empty rank: each
// rank's rows of the plain loop's per-row losses, and W times their sum.
TEST(Matryoshka, PerRowAndSummedReductionsAreTheLoopsRows) {
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  auto gen = at::detail::createCPUGenerator(5);
  const auto a = torch::randn({7, 9}, gen, opt), b = torch::randn({7, 9}, gen, opt);
  const auto s = torch::tensor(1.2, opt);
  const std::vector<int64_t> dims{6, 3};
  const std::vector<double> weights{1.5, 0.5};
  const auto want = reference::matryoshka(dims, weights, {a, b}, [&](const V& f) {
    return reference::clip_rows(f[0], f[1], s, c10::nullopt, true, 100.0, false);
  });  // [7]
  const std::vector<int64_t> rows{7, 0};
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank(), off = r == 0 ? 0 : 7;
    auto o = ClipLossOptions().comm(comm).matryoshka_dims(dims).matryoshka_weights(weights);
    auto mine_a = a.narrow(0, off, rows[r]), mine_b = b.narrow(0, off, rows[r]);
    auto per_row = clip_loss(mine_a, mine_b, s, {}, o.reduction(Reduction::kNone));
    ASSERT_EQ(per_row.size(0), rows[r]);
    if (rows[r] > 0) EXPECT_LE((per_row - want.narrow(0, off, rows[r])).abs().max().item<double>(), 1e-12);
    auto sum = clip_loss(mine_a, mine_b, s, {}, o.reduction(Reduction::kSum));
    EXPECT_NEAR(sum.item<double>(), 2.0 * want.narrow(0, off, rows[r]).sum().item<double>(), 1e-11);
  });
}

// fp32 and bf16 features against fp64, loss and gradients, within the
// losses' own tolerances (precision_test: fp32 1e-5, bf16 a few percent).
TEST(Matryoshka, ReducedPrecisionStaysWithinTheLossesTolerances) {
  auto gen = at::detail::createCPUGenerator(9);
  const auto a64 = torch::randn({32, 64}, gen, torch::kDouble), b64 = torch::randn({32, 64}, gen, torch::kDouble);
  auto run = [&](c10::ScalarType dt) {
    auto a = a64.to(dt).clone().requires_grad_(true), b = b64.to(dt).clone().requires_grad_(true);
    auto l = clip_loss(a, b, torch::tensor(std::log(20.0), dt), {},
                       ClipLossOptions().matryoshka_dims({16, 32}).matryoshka_weights({1.0, 0.5}));
    l.backward();
    return V{l.detach().to(torch::kDouble), a.grad().to(torch::kDouble), b.grad().to(torch::kDouble)};
  };
  const auto want = run(torch::kDouble);
  for (auto [dt, tol] : {std::pair{torch::kFloat, 1e-5}, std::pair{torch::kBFloat16, 3e-2}}) {
    const auto got = run(dt);
    for (size_t i = 0; i < got.size(); ++i) {
      const double scale = want[i].abs().max().item<double>();
      EXPECT_LE((got[i] - want[i]).abs().max().item<double>() / scale, tol) << c10::toString(dt) << " output " << i;
    }
  }
}

// CLIP's prefixes share one pass (engine/prefix_block.h): one logits buffer
// and panels of a sixteenth of its rows each, where the loop held one buffer per
// prefix; the same loss and gradients as the loop of the tiled path.
TEST(Matryoshka, TheSharedPassHoldsOneLogitsBuffer) {
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  const int64_t B = 256;  // the features' cuts small beside a block
  const auto a0 = torch::randn({B, 12}, opt), b0 = torch::randn({B, 12}, opt);
  const auto s = torch::tensor(1.0, opt);
  auto run = [&](ClipLossOptions o, int64_t& peak) {
    return measured(a0, peak,
                    [&](const torch::Tensor& a) { return clip_loss(a, b0, s, {}, o.matryoshka_dims({4, 8})); });
  };
  const int64_t block = B * B * 8;
  int64_t shared_peak = 0, loop_peak = 0;
  const auto shared = run(ClipLossOptions().path(MemoryPath::kMaterialised), shared_peak);
  const auto loop = run(ClipLossOptions().path(MemoryPath::kTiled).tile_bytes(2048), loop_peak);
  EXPECT_GE(shared_peak, block);
  // The buffer, two panels of a sixteenth of its rows, and the features'
  // cuts and gradients (each d / B of a block); the loop held three buffers.
  EXPECT_LT(shared_peak, 2 * block);
  EXPECT_LE((shared.first - loop.first).abs().item<double>(), 1e-12);
  EXPECT_LE((shared.second - loop.second).abs().max().item<double>(), 1e-12);
  // The buffer becomes the gradient in place: a second backward is refused.
  auto a = a0.clone().requires_grad_(true);
  auto twice = clip_loss(a, b0, s, {}, ClipLossOptions().matryoshka_dims({4, 8}));
  twice.backward({}, /*retain_graph=*/true);
  CONTRAX_EXPECT_ERROR(twice.backward(),
                       "clip_loss(): backward ran twice through the same graph; the Matryoshka prefixes' shared pass "
                       "turns its buffer into the gradient in place");
}

// Nine prefixes: the backward's P - 1 recomputed panels shrink (three
// logits panels' rows together, engine/prefix_block.h), so its row panels are
// many and the last one short; the shared pass still equals the loop, and
// still holds less than two buffers.
TEST(Matryoshka, ManyPrefixesShareThePassInSmallerPanels) {
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  const int64_t B = 256;
  const auto a0 = torch::randn({B, 12}, opt), b0 = torch::randn({B, 12}, opt);
  const auto s = torch::tensor(2.0, opt);
  const std::vector<int64_t> dims{1, 2, 3, 4, 5, 6, 8, 10};
  const std::vector<double> weights{1, 2, 0.5, 1, 1, 3, 1, 0.25};
  auto run = [&](ClipLossOptions o, int64_t& peak) {
    return measured(a0, peak, [&](const torch::Tensor& a) {
      return clip_loss(a, b0, s, {}, o.matryoshka_dims(dims).matryoshka_weights(weights));
    });
  };
  int64_t shared_peak = 0, loop_peak = 0;
  const auto shared = run(ClipLossOptions().path(MemoryPath::kMaterialised), shared_peak);
  const auto loop = run(ClipLossOptions().path(MemoryPath::kTiled).tile_bytes(2048), loop_peak);
  EXPECT_LT(shared_peak, 2 * B * B * 8);
  EXPECT_LE((shared.first - loop.first).abs().item<double>(), 1e-12);
  EXPECT_LE((shared.second - loop.second).abs().max().item<double>(), 1e-12);
}

// Features of any magnitude: rows of 1e20 (whose products and squares
// overflow fp32) give the loss and gradient directions of the same rows at
// unit scale, and rows of 1e-14 (norms under safe_normalize's 1e-12 floor)
// the loop's results (the tiled path).
TEST(Matryoshka, TheSharedPassTakesFeaturesOfAnyMagnitude) {
  auto gen = at::detail::createCPUGenerator(3);
  const auto a = torch::randn({16, 24}, gen), b = torch::randn({16, 24}, gen);
  const auto s = torch::tensor(std::log(10.0));
  auto run = [&](double fa, double fb, MemoryPath path) {
    auto x = (a * fa).requires_grad_(true), y = (b * fb).requires_grad_(true);
    auto l = clip_loss(x, y, s, {}, ClipLossOptions().matryoshka_dims({8, 16}).path(path));
    l.backward();
    return V{l.detach(), x.grad() * fa, y.grad() * fb};
  };
  auto expect_near = [](const V& got, const V& want, const char* what) {
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(torch::isfinite(got[i]).all().item<bool>()) << what << " output " << i;
      EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-5 * (1.0 + want[i].abs().max().item<double>()))
          << what << " output " << i;
    }
  };
  const auto shared = MemoryPath::kMaterialised;
  expect_near(run(1e20, 1.0, shared), run(1.0, 1.0, shared), "1e20");
  expect_near(run(1e20, 1e-14, shared), run(1e20, 1e-14, MemoryPath::kTiled), "1e20 and 1e-14");
}

// Where each prefix's block runs in turn (SigLIP, and any loss off the
// shared pass), it keeps its own logits until the backward, so the automatic
// path counts P blocks: logits that fit max_logits_bytes once but not three
// times go the tiled way (and hold less), with the same loss.
TEST(Matryoshka, TheLoopCountsOneLogitsBlockPerPrefix) {
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  const int64_t B = 256;  // the features' cuts small beside a block
  const auto a0 = torch::randn({B, 12}, opt), b0 = torch::randn({B, 12}, opt);
  const auto s = torch::tensor(1.0, opt), bias = torch::tensor(-2.0, opt);
  auto run = [&](SigLipLossOptions o, int64_t& peak) {
    return measured(a0, peak,
                    [&](const torch::Tensor& a) { return siglip_loss(a, b0, s, bias, o.matryoshka_dims({4, 8})); });
  };
  const int64_t block = B * B * 8;
  int64_t mat_peak = 0, auto_peak = 0;
  const auto mat = run(SigLipLossOptions().path(MemoryPath::kMaterialised), mat_peak);
  const auto chosen = run(SigLipLossOptions().max_logits_bytes(2 * block).tile_bytes(2048), auto_peak);
  EXPECT_GE(mat_peak, 3 * block);  // three prefixes' buffers at once
  EXPECT_LT(auto_peak, 2 * block);  // tiles (and the prefixes' cuts of the features)
  EXPECT_LE((chosen.first - mat.first).abs().item<double>(), 1e-12);
  EXPECT_LE((chosen.second - mat.second).abs().max().item<double>(), 1e-12);
}

// The shared pass against the loop of the tiled path at W = 3 with uneven
// rows and an empty rank, fp64: one-directional with a bias, multi-positive
// labels, duplicates masked with per-row losses, and grouped candidates.
TEST(Matryoshka, TheSharedPassIsTheLoopAcrossRanks) {
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  auto gen = at::detail::createCPUGenerator(21);
  const std::vector<int64_t> rows{5, 0, 4};
  const auto a = torch::randn({9, 10}, gen, opt), b = torch::randn({9, 10}, gen, opt);
  const auto c = torch::randn({18, 10}, gen, opt), labels = torch::randint(0, 3, {9}, gen, torch::kLong);
  const auto s = torch::tensor(0.8, opt), bias = torch::tensor(0.3, opt);
  const std::vector<int64_t> dims{7, 2, 4};
  const std::vector<double> weights{0.5, 2.0, 1.0};
  for (int form = 0; form < 4; ++form) {
    SCOPED_TRACE(form);
    run_ranks(3, [&](const CommunicatorPtr& comm) {
      const int64_t r = comm->rank(), off = r == 0 ? 0 : r == 1 ? 5 : 5;
      auto run = [&](MemoryPath path) {
        auto x = a.narrow(0, off, rows[r]).clone().requires_grad_(true);
        auto y = (form == 3 ? c.narrow(0, 2 * off, 2 * rows[r]) : b.narrow(0, off, rows[r])).clone().requires_grad_(true);
        auto ls = s.clone().requires_grad_(true), lb = bias.clone().requires_grad_(true);
        const auto lab = labels.narrow(0, off, rows[r]);
        torch::Tensor l;
        if (form == 3) {
          l = grouped_loss(x, y, ls, lb, GroupedLossOptions().comm(comm).path(path).matryoshka_dims(dims).matryoshka_weights(weights));
        } else {
          auto o = ClipLossOptions().comm(comm).path(path).matryoshka_dims(dims).matryoshka_weights(weights);
          if (form == 0) o.symmetric(false);
          if (form == 1) o.labels(lab);
          if (form == 2) o.labels(lab).label_mode(LabelMode::kMaskDuplicates).reduction(Reduction::kNone);
          l = clip_loss(x, y, ls, lb, o);
        }
        l.sum().backward();
        return V{l.detach(), x.grad(), y.grad(), ls.grad(), lb.grad()};
      };
      const auto shared = run(MemoryPath::kMaterialised), loop = run(MemoryPath::kTiled);
      for (size_t i = 0; i < shared.size(); ++i) {
        if (shared[i].numel() == 0) continue;
        EXPECT_LE((shared[i] - loop[i]).abs().max().item<double>(), 1e-12) << "output " << i << " rank " << r;
      }
    });
  }
}
