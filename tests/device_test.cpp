// The losses and the gather on every device this machine has: CPU always,
// CUDA when a GPU is present (the CUDA cases skip, saying why, elsewhere).
// Each case runs at W = 1 and W = 2 (thread ranks over Gloo, which carries
// CUDA tensors through host memory) with fp64 inputs on the device under test,
// and compares the loss and every gradient with the single-device reference
// computed on the CPU over the concatenated batch.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "contrax/collectives.h"
#include "contrax/losses.h"
#include "contrax/reference.h"
#include "contrax/siglip.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::rel_err;
using contrax::testing::run_ranks;
using contrax::testing::shard;

namespace {

constexpr int64_t kWidth = 6;

// A distributed loss on one rank's rows (already on the device) and its
// reference on the whole batch (CPU). `x` holds the features, `s` the 0-dim
// parameters (each with gradient).
struct DeviceCase {
  std::string name;
  int64_t features = 2;
  int64_t grad_features = 2;  // the first this many features get gradients
  int64_t scalars = 0;
  std::function<torch::Tensor(const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& s,
                              const CommunicatorPtr& comm)>
      distributed;
  std::function<torch::Tensor(const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& s)> reference;
};

std::vector<DeviceCase> device_cases() {
  std::vector<DeviceCase> cases;
  cases.push_back({"clip", 2, 2, 1,
                   [](auto& x, auto& s, auto& comm) {
                     return clip_loss(x[0], x[1], s[0], c10::nullopt, ClipLossOptions().comm(comm));
                   },
                   [](auto& x, auto& s) { return reference::clip_loss(x[0], x[1], s[0], c10::nullopt); }});
  cases.push_back({"clip_tiled", 2, 2, 1,
                   [](auto& x, auto& s, auto& comm) {
                     return clip_loss(x[0], x[1], s[0], c10::nullopt, ClipLossOptions().comm(comm).tile_size(2));
                   },
                   [](auto& x, auto& s) { return reference::clip_loss(x[0], x[1], s[0], c10::nullopt); }});
  cases.push_back({"nt_xent", 2, 2, 0,
                   [](auto& x, auto&, auto& comm) {
                     return nt_xent_loss(x[0], x[1], NTXentLossOptions().temperature(0.2).comm(comm));
                   },
                   [](auto& x, auto&) { return reference::nt_xent_loss(x[0], x[1], 0.2); }});
  cases.push_back({"moco_v3", 4, 2, 0,
                   [](auto& x, auto&, auto& comm) {
                     return moco_v3_loss(x[0], x[1], x[2], x[3], MocoV3LossOptions().temperature(0.2).comm(comm));
                   },
                   [](auto& x, auto&) { return reference::moco_v3_loss(x[0], x[1], x[2], x[3], 0.2); }});
  cases.push_back({"siglip", 2, 2, 2,
                   [](auto& x, auto& s, auto& comm) {
                     return siglip_loss(x[0], x[1], s[0], s[1], SigLipLossOptions().comm(comm));
                   },
                   [](auto& x, auto& s) { return reference::siglip_loss(x[0], x[1], s[0], s[1]); }});
  // The gather alone: every rank's loss is a fixed weighting of all rows.
  cases.push_back({"gather_with_grad", 1, 1, 0,
                   [](auto& x, auto&, auto& comm) {
                     auto all = gather_with_grad(x[0], comm).all;
                     auto w = torch::arange(all.numel(), all.options()).view(all.sizes()).cos();
                     return (all * w).sum();
                   },
                   [](auto& x, auto&) {
                     auto w = torch::arange(x[0].numel(), x[0].options()).view(x[0].sizes()).cos();
                     return (x[0] * w).sum();
                   }});
  return cases;
}

class OnDevice : public ::testing::TestWithParam<std::tuple<std::string, int64_t>> {
 protected:
  void SetUp() override {
    if (std::get<0>(GetParam()) == "cuda") {
      if (!torch::cuda::is_available()) {
        GTEST_SKIP() << "no CUDA device on this machine (torch::cuda::is_available() is false): the CUDA cases run "
                        "only where a GPU is present";
      }
      device_ = torch::Device(torch::kCUDA, 0);
    }
  }
  torch::Device device_{torch::kCPU};
};

TEST_P(OnDevice, EveryCaseEqualsTheCpuReference) {
  const int64_t W = std::get<1>(GetParam());
  const std::vector<int64_t> rows = W == 1 ? std::vector<int64_t>{5} : std::vector<int64_t>{4, 3};
  int64_t B = 0;
  for (auto r : rows) B += r;
  for (const auto& c : device_cases()) {
    SCOPED_TRACE(c.name);
    auto gen = at::detail::createCPUGenerator(7);
    std::vector<torch::Tensor> global;
    for (int64_t i = 0; i < c.features; ++i) global.push_back(torch::randn({B, kWidth}, gen, torch::kDouble));
    std::vector<torch::Tensor> scalars;
    for (int64_t i = 0; i < c.scalars; ++i) scalars.push_back(torch::full({}, i == 0 ? 1.5 : -2.0, torch::kDouble));

    // Per rank: its loss, its feature gradients and its scalar gradients (CPU).
    std::vector<double> losses(W);
    std::vector<std::vector<torch::Tensor>> feature_grads(W), scalar_grads(W);
    std::vector<std::string> devices_seen(W);
    run_ranks(W, [&](const CommunicatorPtr& comm) {
      const int64_t r = comm->rank();
      std::vector<torch::Tensor> x, s;
      for (int64_t i = 0; i < c.features; ++i) {
        // clone(): a fresh leaf per rank, also where to() returns the CPU tensor itself
        x.push_back(shard(global[i], rows, r).to(device_).clone().requires_grad_(i < c.grad_features));
      }
      for (const auto& v : scalars) s.push_back(v.to(device_).clone().requires_grad_(true));
      auto loss = c.distributed(x, s, comm);
      devices_seen[r] = loss.device().str();
      loss.backward();
      losses[r] = loss.item<double>();
      for (int64_t i = 0; i < c.grad_features; ++i) feature_grads[r].push_back(x[i].grad().cpu());
      for (const auto& v : s) scalar_grads[r].push_back(v.grad().cpu());
    });
    for (int64_t r = 0; r < W; ++r) EXPECT_EQ(devices_seen[r], device_.str()) << "the loss left the device";

    std::vector<torch::Tensor> ref_x, ref_s;
    for (int64_t i = 0; i < c.features; ++i) ref_x.push_back(global[i].clone().requires_grad_(i < c.grad_features));
    for (const auto& v : scalars) ref_s.push_back(v.clone().requires_grad_(true));
    auto ref = c.reference(ref_x, ref_s);
    ref.backward();

    double mean_loss = 0;
    for (auto l : losses) mean_loss += l / W;
    EXPECT_NEAR(mean_loss, ref.item<double>(), 1e-10 * std::max(1.0, std::abs(ref.item<double>())));
    // Rank r's feature gradient is sum_s dL_s/dx_r = W dL/dx_r (data-parallel
    // convention); a scalar's is the mean over ranks of dL_r/ds.
    for (int64_t i = 0; i < c.grad_features; ++i) {
      std::vector<torch::Tensor> parts;
      for (int64_t r = 0; r < W; ++r) parts.push_back(feature_grads[r][i] / W);
      EXPECT_LE(rel_err(torch::cat(parts), ref_x[i].grad()), 1e-10) << "feature " << i;
    }
    for (int64_t j = 0; j < c.scalars; ++j) {
      auto mean = torch::zeros({}, torch::kDouble);
      for (int64_t r = 0; r < W; ++r) mean += scalar_grads[r][j] / W;
      EXPECT_LE(rel_err(mean, ref_s[j].grad()), 1e-10) << "scalar " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, OnDevice,
                         ::testing::Combine(::testing::Values("cpu", "cuda"), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_W" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
