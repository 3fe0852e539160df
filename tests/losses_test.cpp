// The distributed losses against the one-device reference on the
// concatenated batch (fp64, W = 1..4, equal, uneven and empty-rank batches),
// finite-difference checks, the error messages, and a negative control showing
// that the exactness check catches the classic all_gather-without-gradient bug.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "contrax/check/plan.h"
#include "contrax/check/verify.h"
#include "contrax/comm/collectives.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"
#include "contrax/losses/tiled.h"
#include "contrax/util/memory.h"
#include "engine/panels.h"
#include "engine/precision.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::error_of;
using contrax::testing::run_ranks;
using contrax::testing::run_ranks_collect_errors;
using contrax::testing::rel_err;

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

// Under static shapes nobody is told of another rank's bad argument: the rank
// that passed it says so and why the others may wait; they end in their next
// collective's timeout or a closed connection, not a hang.
TEST(LossErrors, BadInputUnderStaticShapesIsThisRanksErrorAndNoHang) {
  auto errors = run_ranks_collect_errors(
      3,
      [](const CommunicatorPtr& comm) {
        auto a = torch::randn({3, 4});
        auto b = comm->rank() == 1 ? torch::randn({2, 4}) : torch::randn({3, 4});
        clip_loss(a, b, torch::tensor(1.0), c10::nullopt, ClipLossOptions().comm(comm));
      },
      std::chrono::seconds(3), [](int64_t, CommunicatorOptions& o) { o.static_shapes(true); });
  EXPECT_NE(errors[1].find("arguments 'a' and 'b' must have the same number of rows on each rank"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[1].find("(static shapes: no other rank was told; they wait in their next collective until the "
                           "communicator's timeout)"),
            std::string::npos)
      << errors[1];
  EXPECT_FALSE(errors[0].empty());
  EXPECT_FALSE(errors[2].empty());
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

// Issue 29, item 7: [b, 0] features reached ATen's amax() inside the
// normalisation; every loss refuses a width of 0 by the argument's name.
TEST(LossErrors, ZeroWidthFeaturesAreRefusedByName) {
  auto e = torch::randn({4, 0}), s = torch::tensor(1.0);
  const std::string want = "must have a width of at least 1";
  auto has = [&](const std::string& msg, const char* what) {
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  };
  has(error_of([&] { nt_xent_loss(e, e); }), "nt_xent_loss(): argument 'z1'");
  has(error_of([&] { nt_xent_loss(e, e, NTXentLossOptions().memory(MemoryPathOptions().path(MemoryPath::kTiled))); }),
      "nt_xent_loss(): argument 'z1'");
  has(error_of([&] { moco_v3_loss(e, e, e, e); }), "moco_v3_loss(): argument 'q1'");
  has(error_of([&] { clip_loss(e, e, s); }), "clip_loss(): argument 'a'");
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

// ---- plan_loss: the cost model against real calls ----

// fp64, and bf16 with reduced operands (CUDA's policy, switched on here for
// the CPU): bf16 features and their gradients travel in bf16, the ring's
// gradient partials and the log-sum-exps in fp32.
TEST(LossPlan, BytesMatchTheCommunicatorsCounters) {
  const int64_t W = 2, b = 5, d = 8;
  const int64_t g = 3;  // grouped: the positive and two hard negatives per query
  for (bool reduced : {false, true}) {
    contrax::detail::set_reduced_operands_everywhere(reduced);
    const auto dt = reduced ? torch::kBFloat16 : torch::kDouble;
    for (const std::string loss : {"clip", "infonce", "grouped", "nt_xent", "moco_v3"}) {
      // Materialised, then the ring (blocks of rows travel instead of one gather).
      for (bool ring : {false, true}) {
        const int64_t tile = ring ? 2 : 0;
        auto plan = plan_loss(PlanOptions().loss(loss).group(loss == "grouped" ? g : 1).batch(W * b).width(d).world(W)
                                  .dtype(dt).tile_size(tile).ring(ring));
        EXPECT_EQ(plan.chosen, ring ? "ring" : "materialised");
        const auto& path = plan.paths[ring ? 2 : 0];
        const std::string what = loss + (ring ? " (ring)" : "") + (reduced ? ", bf16 operands" : "");
        run_ranks(W, [&](const CommunicatorPtr& comm) {
          auto x = torch::randn({b, d}).to(dt).requires_grad_(true);
          auto y = torch::randn({b, d}).to(dt).requires_grad_(true);
          auto ls = torch::tensor(0.3, torch::kDouble);
          comm->reset_stats();
          torch::Tensor l =
              loss == "clip"
                  ? clip_loss(x, y, ls, c10::nullopt, ClipLossOptions().comm(comm).tile_size(tile).ring(ring))
              : loss == "infonce"
                  ? clip_loss(x, y, ls, c10::nullopt,
                              ClipLossOptions().symmetric(false).comm(comm).tile_size(tile).ring(ring))
              : loss == "grouped"
                  ? grouped_loss(x, torch::randn({b * g, d}).to(dt).requires_grad_(true), ls, c10::nullopt,
                                 GroupedLossOptions().comm(comm).tile_size(tile).ring(ring))
              : loss == "nt_xent" ? nt_xent_loss(x, y, NTXentLossOptions().comm(comm).tile_size(tile).ring(ring))
                                  : moco_v3_loss(x, y, y, x, MocoV3LossOptions().comm(comm).tile_size(tile).ring(ring));
          auto s = comm->stats();
          EXPECT_EQ(s.total_bytes_sent() - s.op("metadata").bytes_sent, path.bytes_sent_forward) << what;
          comm->reset_stats();
          l.backward();
          EXPECT_EQ(comm->stats().total_bytes_sent(), path.bytes_sent_backward) << what;
        });
      }
    }
  }
  contrax::detail::set_reduced_operands_everywhere(false);
  // On CUDA the plan counts bf16 features at two bytes (the CPU at four): at
  // B = 64 over W = 2, the forward gather sends a rank's 32 rows of width 8 to
  // its one peer, 32 * 8 elements at 4 - 2 = 2 bytes fewer each; the column
  // log-sum-exps (fp32 on both) are the same.
  const auto on = [](torch::Device dev) {
    return plan_loss(PlanOptions().batch(64).width(8).world(2).dtype(torch::kBFloat16).device(dev))
        .paths[0]
        .bytes_sent_forward;
  };
  EXPECT_EQ(on(torch::Device(torch::kCPU)) - on(torch::Device(torch::kCUDA, 0)), 32 * 8 * 2);
}

TEST(LossPlan, RoutingAndErrors) {
  // 8192^2 fp32 logits are exactly the default 256 MiB threshold.
  EXPECT_EQ(plan_loss(PlanOptions().batch(8192)).chosen, "materialised");
  EXPECT_EQ(plan_loss(PlanOptions().batch(8193)).chosen, "tiled");
  EXPECT_EQ(plan_loss(PlanOptions().batch(8192).loss("nt_xent")).chosen, "tiled");  // one [2B x 2B] buffer
  EXPECT_EQ(plan_loss(PlanOptions().batch(8192).dtype(torch::kHalf)).chosen, "materialised");  // fp32 inside
  EXPECT_EQ(plan_loss(PlanOptions().batch(100).world(2).tile_size(16).ring(true)).chosen, "ring");
  auto p = plan_loss(PlanOptions().batch(8192).world(4));
  EXPECT_EQ(p.paths[0].gemms * 2, p.old_gemms);
  EXPECT_EQ(p.paths[0].logits_bytes, int64_t{2048} * 8192 * 4);
  EXPECT_NE(to_string(p).find("materialised (chosen)"), std::string::npos) << to_string(p);
  EXPECT_NE(to_json(p).find("\"chosen\": \"materialised\""), std::string::npos);
  // grouped: one [b x B g] buffer, g blocks against the threshold.
  EXPECT_EQ(plan_loss(PlanOptions().loss("grouped").group(4).batch(4096)).chosen, "materialised");  // 256 MiB
  EXPECT_EQ(plan_loss(PlanOptions().loss("grouped").group(5).batch(4096)).chosen, "tiled");
  auto gp = plan_loss(PlanOptions().loss("grouped").group(4).batch(1024).world(2));
  EXPECT_EQ(gp.paths[0].gemms, 12);
  EXPECT_EQ(gp.paths[0].logits_bytes, int64_t{512} * 1024 * 4 * 4);
  EXPECT_NE(to_string(gp).find("plan: grouped (g = 4)"), std::string::npos) << to_string(gp);
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("triplet")),
                       "plan_loss(): argument 'loss' must be clip, infonce, grouped, nt_xent, moco_v3 or siglip, but "
                       "got 'triplet'");
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("clip").group(2)),
                       "plan_loss(): argument 'group' applies to loss 'grouped' only, but loss is 'clip'");
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("grouped").group(0)),
                       "plan_loss(): argument 'group' must be >= 1, but got 0");
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().batch(0)), "plan_loss(): argument 'batch' must be positive, but got 0");
}
