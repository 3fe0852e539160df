// The CUDA panel kernels (src/engine/kernels/cuda_*_panel.cu) on a GPU,
// through the engine's front (engine/lse_kernels.h) with them switched on,
// against the ATen path on the same device: the tile log-sum-exps and running
// column pairs, the softmax gradient, and every InfoNCE-family loss on both
// memory paths in fp64 (<= 1e-10) and fp32. Skipped, saying why, where there
// is no GPU or the build has no CUDA kernels; tools/gpu_check.sh runs it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "contrax/losses/losses.h"
#include "engine/lse_kernels.h"

namespace {

namespace d = contrax::detail;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Switches the CUDA kernels for one scope and restores the switch.
struct CudaKernels {
  bool was = d::cuda_fused_kernels_enabled();
  explicit CudaKernels(bool on) { d::set_cuda_fused_kernels_enabled(on); }
  ~CudaKernels() { d::set_cuda_fused_kernels_enabled(was); }
};

class CudaPanels : public testing::Test {
 protected:
  void SetUp() override {
    if (!d::cuda_fused_kernels_built()) GTEST_SKIP() << "this build has no CUDA panel kernels (CONTRAX_CUDA_KERNELS)";
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device (torch::cuda::is_available() is false)";
  }
};

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kCPU, torch::kDouble), y = b.to(torch::kCPU, torch::kDouble);
  auto same = (x == y) | (torch::isnan(x) & torch::isnan(y));
  auto diff = ((x - y).abs() / (y.abs() + 1.0)).masked_fill(same, 0.0);
  return diff.numel() ? diff.max().item<double>() : 0.0;
}

const std::vector<std::pair<int64_t, int64_t>> kShapes = {{1, 1}, {1, 300}, {300, 1}, {33, 257},
                                                          {65, 513}, {5, 0},   {0, 5},   {1000, 3000}};

TEST_F(CudaPanels, TileLseAndColumnPairsMatchTheAtenPath) {
  for (auto dt : {torch::kDouble, torch::kFloat}) {
    const double tol = dt == torch::kDouble ? 1e-12 : 2e-6;
    for (auto [R, C] : kShapes) {
      SCOPED_TRACE(testing::Message() << R << " x " << C << " " << dt);
      auto t = (torch::randn({R, C + 3}, torch::TensorOptions().dtype(dt).device(torch::kCUDA)) * 30).narrow(1, 1, C);
      if (R > 2 && C > 2) t[1].fill_(-kInf);  // a wholly masked row
      d::TileLse want, got;
      {
        CudaKernels off(false);
        want = d::tile_lse(t, true, true);
      }
      const auto calls = d::cuda_panel_calls();
      {
        CudaKernels on(true);
        got = d::tile_lse(t, true, true);
      }
      EXPECT_GT(d::cuda_panel_calls(), calls);
      EXPECT_LE(max_diff(got.row, want.row), tol);
      EXPECT_LE(max_diff(got.col, want.col), tol);
    }
  }
}

TEST_F(CudaPanels, SoftmaxGradientMatchesTheAtenPath) {
  for (auto dt : {torch::kDouble, torch::kFloat}) {
    const double tol = dt == torch::kDouble ? 1e-13 : 1e-6;
    auto opt = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
    auto t = torch::randn({257, 301}, opt) * 4;
    t.diagonal().fill_(-kInf);
    auto lr = t.logsumexp(1), lc = t.logsumexp(0);
    auto wr = torch::rand({257}, opt), wc = torch::rand({301}, opt);
    for (int form = 0; form < 4; ++form) {
      const bool col = form & 1, weights = form & 2;
      torch::Tensor out[2];
      for (bool on : {false, true}) {
        CudaKernels k(on);
        out[on] = t.clone();
        d::softmax_grad_(out[on], lr, weights ? wr : torch::Tensor(), col ? lc : torch::Tensor(),
                         col && weights ? wc : torch::Tensor());
      }
      EXPECT_LE(max_diff(out[1], out[0]), tol) << "form " << form << " " << dt;
    }
  }
}

// Every InfoNCE-family loss, materialised and tiled, forward and backward, in
// fp64: the kernels against the ATen path within 1e-10.
TEST_F(CudaPanels, LossesMatchTheAtenPathInFp64) {
  auto opt = torch::TensorOptions().dtype(torch::kDouble).device(torch::kCUDA);
  torch::manual_seed(7);
  auto a0 = torch::randn({300, 64}, opt), b0 = torch::randn({300, 64}, opt);
  for (auto path : {contrax::MemoryPath::kMaterialised, contrax::MemoryPath::kTiled}) {
    std::vector<torch::Tensor> results[2];
    for (bool on : {false, true}) {
      CudaKernels k(on);
      auto a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      auto scale = torch::tensor(1.0 / 0.01, opt).requires_grad_(true);
      auto l1 = contrax::clip_loss(a, b, scale, {}, contrax::ClipLossOptions().path(path).tile_size(96));
      auto l2 = contrax::nt_xent_loss(a, b, contrax::NTXentLossOptions().path(path).tile_size(96));
      (l1 + l2).backward();
      results[on] = {l1.detach(), l2.detach(), a.grad(), b.grad(), scale.grad()};
    }
    for (size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_LE(max_diff(results[1][i], results[0][i]), 1e-10) << "output " << i;
    }
  }
}

}  // namespace
