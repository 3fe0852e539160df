// The engine's one precision policy (src/engine/precision.h): fp32
// log-sum-exps, softmax and sums for fp16/bf16 features; on CUDA (and on the
// CPU once reduced operands are switched on everywhere) the features gathered,
// sent and multiplied in their own dtype, with the mixed GEMMs' fp32 results;
// and no loss that changes inside torch.autocast. Each dtype against the fp64
// reference on the same rounded inputs, at W = 1..4 with uneven batches and an
// empty rank.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <array>
#include <cmath>
#include <functional>

#include "contrax/check/verify.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"
#include "engine/precision.h"
#include "support/ranks.h"

using namespace contrax;

namespace {

// Reduced operands on the CPU for the scope (the CUDA policy, checked here).
struct ReducedOperandsEverywhere {
  explicit ReducedOperandsEverywhere(bool on) { contrax::detail::set_reduced_operands_everywhere(on); }
  ~ReducedOperandsEverywhere() { contrax::detail::set_reduced_operands_everywhere(false); }
};

}  // namespace

TEST(PrecisionPolicy, DtypesPerDevice) {
  using contrax::detail::compute_dtype;
  using contrax::detail::operand_dtype;
  const torch::Device cpu(torch::kCPU), cuda(torch::kCUDA, 0);
  for (auto t : {torch::kHalf, torch::kBFloat16}) {
    EXPECT_EQ(compute_dtype(t), torch::kFloat) << t;
    EXPECT_EQ(operand_dtype(t, cpu), torch::kFloat) << t;
    EXPECT_EQ(operand_dtype(t, cuda), t) << t;
  }
  for (auto t : {torch::kFloat, torch::kDouble}) {
    EXPECT_EQ(compute_dtype(t), t);
    EXPECT_EQ(operand_dtype(t, cpu), t);
    EXPECT_EQ(operand_dtype(t, cuda), t);
  }
  ReducedOperandsEverywhere on(true);
  EXPECT_EQ(operand_dtype(torch::kBFloat16, cpu), torch::kBFloat16);
  EXPECT_EQ(operand_dtype(torch::kFloat, cpu), torch::kFloat);
}

// A product of an fp32 tile with bf16 keys is the fp32 product of the rounded
// operands, as the CUDA kernel with an fp32 result computes it.
TEST(PrecisionPolicy, MixedGemmsMultiplyTheRoundedOperands) {
  torch::manual_seed(3);
  auto a = torch::randn({9, 5}), k = torch::randn({5, 7}).to(torch::kBFloat16);
  auto want = torch::mm(a.to(torch::kBFloat16).to(torch::kFloat), k.to(torch::kFloat));  // [9, 7]
  EXPECT_TRUE(torch::equal(contrax::detail::gemm(a, k, torch::kFloat), want));
  EXPECT_TRUE(torch::equal(contrax::detail::gemm(a.to(torch::kBFloat16), k, torch::kFloat), want));
  EXPECT_FALSE(torch::equal(torch::mm(a, k.to(torch::kFloat)), want));  // the rounding of a is there
  auto acc = torch::ones({9, 7});
  contrax::detail::gemm_add_(acc, a, k);
  EXPECT_TRUE(torch::allclose(acc, want + 1, 0, 1e-6));
  auto out = torch::empty({9, 7});
  contrax::detail::gemm_out(out, a, k.to(torch::kFloat));  // one dtype: the plain GEMM
  EXPECT_TRUE(torch::allclose(out, torch::mm(a, k.to(torch::kFloat))));
}

// The mixed-dtype kernel is found where LibTorch has it (PyPI's newest: the
// CUDA path of the GEMMs above takes it), and not in Debian's 2.6.
TEST(PrecisionPolicy, MixedGemmIsDetectedFromTheHeaders) {
  const bool newest = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13);
  const bool old = TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 6;
  if (newest) EXPECT_TRUE(contrax::detail::mixed_gemm_available());
  if (old) EXPECT_FALSE(contrax::detail::mixed_gemm_available());
}

// Every verify case (every loss and path, the gradient cache, data parallel)
// in fp32, fp16 and bf16, with the CPU's fp32 operands and with reduced
// operands (CUDA's policy), within the dtype's tolerance of the fp64
// reference on the same rounded inputs.
class PrecisionWorld : public ::testing::TestWithParam<int64_t> {};

TEST_P(PrecisionWorld, EveryDtypeWithinItsToleranceOfTheReference) {
  const int64_t W = GetParam();
  for (bool reduced : {false, true}) {
    ReducedOperandsEverywhere policy(reduced);
    for (auto dt : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      if (reduced && dt == torch::kFloat) continue;  // fp32 has no reduced operands
      std::vector<std::vector<VerifyResult>> results(W);
      contrax::testing::run_ranks(W, [&](const CommunicatorPtr& comm) {
        results[comm->rank()] =
            verify(comm, VerifyOptions().dtype(dt).tolerance(default_tolerance(dt)).width(8).seed(5));
      });
      for (const auto& r : results[0]) {
        EXPECT_TRUE(r.passed) << r.loss << " W=" << W << " " << dt << (reduced ? ", reduced operands" : "")
                              << ": " << to_json(r);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, PrecisionWorld, ::testing::Values(1, 2, 3, 4));

// Reduced operands halve the bytes of the features' gather and of their
// gradient's reduce-scatter (bf16 instead of fp32), and change the loss only
// by the rounding of the products' operands.
// Bytes of rank 0 at W = 2, b = 6, d = 16: the gather sends its [6, 16] rows
// to the other rank, 96 elements (384 bytes in fp32, 192 in bf16); the
// reduce-scatter sends the other rank's [6, 16] slice of dB_all, the same 96
// elements. Loss: each bf16 rounding (of q, of k, and of s q) moves a unit
// row by at most 2^-9 relative, so a logit s q.k (s = 2, |q.k| <= 1) by at
// most 3 * 2 * 2^-9 = 1.2e-2; a log-softmax term by at most twice that,
// 2.4e-2, about 1% of a loss near log(12) = 2.5: under the 2% allowed.
TEST(PrecisionPolicy, ReducedOperandsHalveTheFeatureBytes) {
  std::vector<std::array<int64_t, 2>> bytes(2);  // per policy: {all_gather, reduce_scatter} of rank 0
  std::vector<double> losses(2);
  for (bool reduced : {false, true}) {
    ReducedOperandsEverywhere policy(reduced);
    contrax::testing::run_ranks(2, [&](const CommunicatorPtr& comm) {
      auto gen = at::detail::createCPUGenerator(40 + comm->rank());
      auto a = torch::randn({6, 16}, gen).to(torch::kBFloat16).requires_grad_(true);
      auto b = torch::randn({6, 16}, gen).to(torch::kBFloat16).requires_grad_(true);
      comm->reset_stats();
      auto loss = clip_loss(a, b, torch::tensor(2.0), c10::nullopt,
                            ClipLossOptions().comm(comm).normalize(true).path(MemoryPath::kMaterialised));
      loss.backward();
      EXPECT_EQ(b.grad().scalar_type(), torch::kBFloat16);
      if (comm->rank() == 0) {
        bytes[reduced] = {comm->stats().op("all_gather").bytes_sent, comm->stats().op("reduce_scatter").bytes_sent};
        losses[reduced] = loss.item<double>();
      }
    });
  }
  EXPECT_GT(bytes[0][0], 0);
  EXPECT_EQ(bytes[1][0] * 2, bytes[0][0]);
  EXPECT_EQ(bytes[1][1] * 2, bytes[0][1]);
  EXPECT_NEAR(losses[1], losses[0], 2e-2 * std::abs(losses[0]));
}

// Issue 29, item 7: a reduced-precision scale (as autocast users hold it)
// gave ATen's "clamp_max_scalar_cpu not implemented for 'Half'"; it is
// computed in fp32 and gives the fp32 scale's loss and gradient.
TEST(LossExtremes, ReducedPrecisionScaleIsComputedInFp32) {
  torch::manual_seed(12);
  auto a = torch::randn({5, 3}), b = torch::randn({5, 3});
  for (auto dt : {torch::kHalf, torch::kBFloat16}) {
    auto ls = torch::tensor(2.5, dt).requires_grad_(true);
    auto ref_ls = ls.detach().to(torch::kFloat).requires_grad_(true);
    auto loss = clip_loss(a, b, ls);
    auto ref = clip_loss(a, b, ref_ls);
    loss.backward();
    ref.backward();
    EXPECT_FLOAT_EQ(loss.item<float>(), ref.item<float>()) << dt;
    EXPECT_EQ(ls.grad().scalar_type(), dt);
    EXPECT_NEAR(ls.grad().to(torch::kFloat).item<float>(), ref_ls.grad().item<float>(),
                1e-2 * std::abs(ref_ls.grad().item<float>()) + 1e-3) << dt;
    EXPECT_TRUE(std::isfinite(siglip_loss(a, b, ls.detach()).item<float>())) << dt;
  }
}

// Issue 28, item 3: one precision policy. Every loss computes the same
// function inside and outside autocast, forward and backward, on each path:
// the engine's GEMMs ran in bf16 under torch.autocast("cpu", bfloat16)
// before (relative differences of about 1e-2), and a backward() called
// inside autocast changed the gradients of a forward taken outside.
TEST(LossPrecision, AutocastChangesNoLossOrGradient) {
  torch::manual_seed(13);
  const std::vector<torch::Tensor> inputs{torch::randn({7, 6}), torch::randn({7, 6}), torch::randn({7, 6}),
                                          torch::randn({7, 6}), torch::randn({14, 6}), torch::tensor(std::log(8.0f)),
                                          torch::tensor(-2.0f)};
  using V = std::vector<torch::Tensor>;
  const std::vector<std::pair<std::string, std::function<torch::Tensor(const V&)>>> cases{
      {"clip", [](const V& x) { return clip_loss(x[0], x[1], x[5], c10::nullopt, ClipLossOptions().normalize(true)); }},
      {"clip tiled", [](const V& x) { return clip_loss(x[0], x[1], x[5], x[6], ClipLossOptions().tile_size(3)); }},
      {"nt_xent", [](const V& x) { return nt_xent_loss(x[0], x[1]); }},
      {"nt_xent tiled", [](const V& x) { return nt_xent_loss(x[0], x[1], NTXentLossOptions().tile_size(3)); }},
      {"moco_v3", [](const V& x) { return moco_v3_loss(x[0], x[1], x[2], x[3], MocoV3LossOptions().tile_size(4)); }},
      {"grouped", [](const V& x) { return grouped_loss(x[0], x[4], x[5], x[6]); }},
      {"siglip", [](const V& x) { return siglip_loss(x[0], x[1], x[5], x[6], SigLipLossOptions().tile_size(3)); }},
  };
  auto set_autocast = [](bool on) {
    at::autocast::set_autocast_enabled(at::kCPU, on);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    if (!on) at::autocast::clear_cache();
  };
  for (const auto& [name, fn] : cases) {
    std::vector<std::pair<torch::Tensor, V>> runs;  // (loss, gradients) per (forward, backward) placement
    for (int placement = 0; placement < 4; ++placement) {
      V leaves;
      for (const auto& t : inputs) leaves.push_back(t.clone().requires_grad_(true));
      set_autocast(placement & 1);
      auto loss = fn(leaves);
      set_autocast(placement & 2);
      loss.backward();
      set_autocast(false);
      V grads;
      for (const auto& l : leaves) grads.push_back(l.grad().defined() ? l.grad() : torch::zeros_like(l));
      runs.emplace_back(loss.detach(), grads);
    }
    for (int placement = 1; placement < 4; ++placement) {
      const auto where = name + (placement & 1 ? ", forward inside" : ", forward outside") +
                         (placement & 2 ? ", backward inside" : ", backward outside");
      EXPECT_EQ(runs[placement].first.scalar_type(), torch::kFloat) << where;
      EXPECT_TRUE(torch::allclose(runs[placement].first, runs[0].first, 1e-6, 1e-7)) << where;
      for (size_t k = 0; k < inputs.size(); ++k) {
        EXPECT_TRUE(torch::allclose(runs[placement].second[k], runs[0].second[k], 1e-6, 1e-7))
            << where << ", gradient of input " << k << ": max diff "
            << (runs[placement].second[k] - runs[0].second[k]).abs().max().item<float>();
      }
    }
  }
}

// fp16 and bf16 features are computed with fp32 accumulation; on CPU they used
// to fail inside ATen ("exp_vml_cpu" not implemented for 'Half'). Tolerances:
// the inputs are rounded to 8 (bf16) or 11 (fp16) bits before the reference
// sees them, so the reference gets the same rounded inputs; what remains is
// fp32 accumulation, 1e-5 relative.
TEST(LossExtremes, HalfAndBFloat16AccumulateInFloat) {
  torch::manual_seed(8);
  for (auto dt : {torch::kHalf, torch::kBFloat16}) {
    for (auto path : {MemoryPath::kMaterialised, MemoryPath::kTiled}) {
      const int64_t tile = path == MemoryPath::kTiled ? 3 : 0;
      auto a = torch::randn({7, 8}).to(dt).requires_grad_(true), b = torch::randn({7, 8}).to(dt).requires_grad_(true);
      auto ls = torch::tensor(std::log(10.0f)).requires_grad_(true);
      auto loss = clip_loss(a, b, ls, c10::nullopt, ClipLossOptions().normalize(true).path(path).tile_size(tile));
      EXPECT_EQ(loss.scalar_type(), torch::kFloat);
      loss.backward();
      EXPECT_EQ(a.grad().scalar_type(), dt);
      auto a64 = a.detach().to(torch::kDouble).requires_grad_(true), b64 = b.detach().to(torch::kDouble);
      auto ls64 = torch::tensor(std::log(10.0), torch::kDouble).requires_grad_(true);
      auto ref = reference::clip_loss(a64, b64, ls64, c10::nullopt, true, 100.0, true);
      ref.backward();
      EXPECT_NEAR(loss.item<float>(), ref.item<double>(), 1e-5 * ref.item<double>()) << dt << " tile " << tile;
      // The gradient is rounded to the feature dtype on the way out.
      const double grad_tol = dt == torch::kHalf ? 2e-3 : 1e-2;
      EXPECT_LE(contrax::testing::rel_err(a.grad().to(torch::kDouble), a64.grad()), grad_tol) << dt;
      EXPECT_NEAR(ls.grad().item<float>(), ls64.grad().item<double>(), 1e-4) << dt;
      auto nt = nt_xent_loss(a, b, NTXentLossOptions().temperature(0.5).path(path).tile_size(tile));
      EXPECT_NEAR(nt.item<float>(), reference::nt_xent_loss(a64.detach(), b64, 0.5).item<double>(), 1e-5) << dt;
      auto mo = moco_v3_loss(a, b, b, a, MocoV3LossOptions().temperature(0.5).path(path).tile_size(tile));
      EXPECT_NEAR(mo.item<float>(), reference::moco_v3_loss(a64.detach(), b64, b64, a64.detach(), 0.5).item<double>(),
                  1e-5) << dt;
    }
  }
}
