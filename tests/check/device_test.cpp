// The losses, the gather, GradCache and DataParallel on every device this
// machine has: CPU always, CUDA when a GPU is present (the CUDA cases skip,
// saying why, elsewhere). Each case runs at W = 1 and W = 2 (thread ranks over
// Gloo, which carries CUDA tensors through host memory) with fp64 inputs on
// the device under test, and compares the loss and every gradient with the
// single-device reference computed on the CPU over the concatenated batch.
// Every case also checks that its results were computed on the device under
// test, so that a GPU machine really runs the CUDA code paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "contrax/check/verify.h"
#include "contrax/comm/collectives.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::rel_err, contrax::testing::run_ranks, contrax::testing::shard;

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

// The device a parameter names; false (the caller skips) for "cuda" where no
// GPU is present.
bool device_of(const std::string& name, torch::Device& device) {
  device = torch::Device(torch::kCPU);
  if (name != "cuda") return true;
  if (!torch::cuda::is_available()) return false;
  device = torch::Device(torch::kCUDA, 0);
  return true;
}

constexpr const char* kNoCuda =
    "no CUDA device on this machine (torch::cuda::is_available() is false): the CUDA cases run only where a GPU is "
    "present";

class OnDevice : public ::testing::TestWithParam<std::tuple<std::string, int64_t>> {
 protected:
  void SetUp() override {
    if (!device_of(std::get<0>(GetParam()), device_)) GTEST_SKIP() << kNoCuda;
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

// verify's whole table on the device: every loss in its materialised, tiled
// and ring forms, SigLIP, and the gradient-cache steps (GradCache over two
// dropout towers, each behind DataParallel, whose averaged gradients are
// compared rank by rank with the full-batch ones).
TEST_P(OnDevice, VerifyPassesEveryCaseOnTheDevice) {
  const int64_t W = std::get<1>(GetParam());
  std::vector<std::vector<VerifyResult>> results(W);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    results[comm->rank()] = verify(comm, VerifyOptions().device(device_));
  }, std::chrono::seconds(60));
  ASSERT_EQ(results[0].size(), verify_cases().size());
  std::vector<std::string> names;
  for (const auto& r : results[0]) {
    names.push_back(r.loss);
    EXPECT_TRUE(r.passed) << to_json(r);
    EXPECT_EQ(r.device, device_.str()) << to_json(r);
    EXPECT_EQ(r.world_size, W);
  }
  for (const char* name : {"clip_ring", "siglip", "grad_cache_clip", "grad_cache_tiled_ring"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
}

// A two-tower CLIP model in small: tower a [6 -> 8 -> 4], tower b [5 -> 8 -> 4]
// and the logit scale, drawn from `seed` on the CPU and moved to `device`.
struct Towers : torch::nn::Module {
  Towers(uint64_t seed, torch::Device device) {
    auto gen = at::detail::createCPUGenerator(seed);
    auto draw = [&](std::vector<int64_t> shape) { return torch::randn(shape, gen, torch::kDouble) * 0.4; };
    a1 = register_parameter("a1", draw({8, 6}).to(device));
    a2 = register_parameter("a2", draw({4, 8}).to(device));
    b1 = register_parameter("b1", draw({8, 5}).to(device));
    b2 = register_parameter("b2", draw({4, 8}).to(device));
    logit_scale = register_parameter("logit_scale", torch::full({}, 2.0, torch::kDouble).to(device));
  }
  torch::Tensor a(const torch::Tensor& x /* [n, 6] */) { return torch::tanh(x.matmul(a1.t())).matmul(a2.t()); }
  torch::Tensor b(const torch::Tensor& y /* [n, 5] */) { return torch::tanh(y.matmul(b1.t())).matmul(b2.t()); }
  torch::Tensor a1, a2, b1, b2, logit_scale;
};

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad() : torch::zeros_like(p));
  return g;
}

// DataParallel: each rank's gradients after the reducer's average equal the
// single-process full-batch gradients, for two steps (the second after an SGD
// update, on the reducer's rebuilt buckets), and stay on the device.
TEST_P(OnDevice, DataParallelAveragesToTheSingleProcessGradients) {
  const int64_t W = std::get<1>(GetParam());
  const std::vector<int64_t> rows = W == 1 ? std::vector<int64_t>{7} : std::vector<int64_t>{4, 3};
  const int64_t B = 7;
  auto gen = at::detail::createCPUGenerator(11);
  std::vector<torch::Tensor> xs, ys;
  for (int step = 0; step < 2; ++step) {
    xs.push_back(torch::randn({B, 6}, gen, torch::kDouble));
    ys.push_back(torch::randn({B, 5}, gen, torch::kDouble));
  }
  // The reference on the CPU: the same two SGD steps on the whole batch.
  std::vector<std::vector<torch::Tensor>> want;
  {
    Towers m(5, torch::kCPU);
    torch::optim::SGD opt(m.parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      clip_loss(m.a(xs[step]), m.b(ys[step]), m.logit_scale).backward();
      want.push_back({});
      for (const auto& g : grads_of(m)) want.back().push_back(g.clone());
      opt.step();
    }
  }
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    auto m = std::make_shared<Towers>(5, device_);
    DataParallel dp(m, comm);
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      auto x = shard(xs[step], rows, r).to(device_), y = shard(ys[step], rows, r).to(device_);
      auto [za, zb] = dp.forward([&] { return std::make_tuple(m->a(x), m->b(y)); });
      clip_loss(za, zb, m->logit_scale, c10::nullopt, ClipLossOptions().comm(comm)).backward();
      const auto got = grads_of(*m);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].device(), device_) << "rank " << r << " step " << step << " parameter " << i;
        EXPECT_LE(rel_err(got[i].cpu(), want[step][i]), 1e-10)
            << "rank " << r << " step " << step << " parameter " << i;
      }
      opt.step();
    }
    EXPECT_EQ(dp.sync_count(), W > 1 ? 2 : 0);
  });
}

// GradCache on the device with torch's own dropout, whose masks come from the
// default generator of the input's device (the CUDA generator for CUDA
// inputs): the second pass must replay the first pass's random state, and the
// generator is left where one pass would have left it. One process only:
// thread ranks would share the device's generator and interleave their draws
// (as separate processes do not), so the masks would depend on scheduling;
// the distributed GradCache steps on the device are verify's cases above.
class GradCacheOnDevice : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!device_of(GetParam(), device_)) GTEST_SKIP() << kNoCuda;
  }
  torch::Device device_{torch::kCPU};
};

TEST_P(GradCacheOnDevice, ReplaysTheDevicesRandomStateForDropout) {
  const int64_t B = 10, ca = 3, cb = 4;
  auto gen = at::detail::createCPUGenerator(21);
  const auto x = torch::randn({B, 6}, gen, torch::kDouble).to(device_);
  const auto y = torch::randn({B, 5}, gen, torch::kDouble).to(device_);
  auto tower = [](const std::shared_ptr<Towers>& m, bool first) {
    return [m, first](const BatchInput& in) -> c10::IValue {
      const auto& w1 = first ? m->a1 : m->b1;
      const auto& w2 = first ? m->a2 : m->b2;
      return torch::dropout(torch::tanh(in.tensor().matmul(w1.t())), 0.3, /*train=*/true).matmul(w2.t());
    };
  };
  auto loss_of = [](const std::shared_ptr<Towers>& m) {
    return [m](const std::vector<torch::Tensor>& z) { return clip_loss(z[0], z[1], m->logit_scale); };
  };

  // Reference: the chunks in pass 1's order (a's chunks, then b's) in one graph.
  auto ref = std::make_shared<Towers>(3, device_);
  torch::manual_seed(1234);
  {
    std::vector<torch::Tensor> za, zb;
    const auto encode_a = tower(ref, true), encode_b = tower(ref, false);
    for (int64_t s = 0; s < B; s += ca) za.push_back(encode_a(x.narrow(0, s, std::min(ca, B - s))).toTensor());
    for (int64_t s = 0; s < B; s += cb) zb.push_back(encode_b(y.narrow(0, s, std::min(cb, B - s))).toTensor());
    loss_of(ref)({torch::cat(za), torch::cat(zb)}).backward();
  }
  const auto want = grads_of(*ref);
  const auto want_next = torch::rand({4}, torch::TensorOptions().dtype(torch::kDouble).device(device_));

  auto run = [&](bool replay) {
    auto m = std::make_shared<Towers>(3, device_);
    GradCache gc({GradCacheEncoder(tower(m, true), ca), GradCacheEncoder(tower(m, false), cb)}, loss_of(m),
                 GradCacheOptions().replay_rng(replay));
    torch::manual_seed(1234);
    auto loss = gc.step({x, y});
    EXPECT_EQ(loss.device(), device_);
    return grads_of(*m);
  };
  const auto got = run(true);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].device(), device_) << "parameter " << i;
    EXPECT_LE(rel_err(got[i].cpu(), want[i].cpu()), 1e-10) << "parameter " << i;
  }
  // The device's generator is where one pass would have left it.
  const auto next = torch::rand({4}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
  EXPECT_EQ(rel_err(next.cpu(), want_next.cpu()), 0.0);

  // Without the replay the second pass draws other masks: the check is sensitive.
  const auto off = run(false);
  double worst = 0;
  for (size_t i = 0; i + 1 < off.size(); ++i) worst = std::max(worst, rel_err(off[i].cpu(), want[i].cpu()));
  EXPECT_GT(worst, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Devices, GradCacheOnDevice, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return std::string(info.param); });

INSTANTIATE_TEST_SUITE_P(Devices, OnDevice,
                         ::testing::Combine(::testing::Values("cpu", "cuda"), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_W" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace

namespace {

// NCCL carries CUDA tensors only, and refuses two ranks on one GPU: two ranks,
// each on its own GPU. The losses' metadata (row counts, g), the trainer's
// stop flag and loss sums are CPU tensors that the communicator stages through
// the rank's GPU; verify's whole table (uneven batches, an empty rank) runs
// those paths, and the CPU collectives are checked directly as well.
TEST(Nccl, TwoRanksOnTwoGpusPassVerifyAndStageCpuTensors) {
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "NCCL at W = 2 needs two CUDA devices; this machine has " << torch::cuda::device_count();
  }
  std::vector<std::vector<VerifyResult>> results(2);
  const auto errors = contrax::testing::run_ranks_collect_errors(
      2,
      [&](const CommunicatorPtr& comm) {
        ASSERT_EQ(comm->backend(), "nccl");
        const int64_t r = comm->rank();
        auto ints = comm->all_gather_ints({r, 10 + r, 20 + r});
        EXPECT_EQ(ints, (std::vector<std::vector<int64_t>>{{0, 10, 20}, {1, 11, 21}}));
        auto flag = torch::full({1}, static_cast<double>(r + 1), torch::kDouble);
        comm->all_reduce_sum(flag);
        EXPECT_FALSE(flag.is_cuda());
        EXPECT_EQ(flag.item<double>(), 3.0);
        auto b = torch::full({2}, static_cast<double>(r + 5), torch::kDouble);
        comm->broadcast(b, 1);
        EXPECT_EQ(b[0].item<double>(), 6.0);
        results[r] = verify(comm, VerifyOptions().device(torch::Device(torch::kCUDA, r)));
      },
      std::chrono::seconds(120),
      [](int64_t r, CommunicatorOptions& o) { o.backend("nccl").device(torch::Device(torch::kCUDA, r)); });
  if (errors[0].find("has no NCCL") != std::string::npos) GTEST_SKIP() << errors[0];
  for (size_t r = 0; r < errors.size(); ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  ASSERT_EQ(results[0].size(), verify_cases().size());
  for (const auto& res : results[0]) EXPECT_TRUE(res.passed) << to_json(res);
}

TEST(VerifyDevice, ADeviceThisProcessCannotUseIsNamed) {
  // No machine has 100 GPUs; on a CPU-only one every CUDA device is refused.
  CONTRAX_EXPECT_ERROR(verify_case(verify_cases().front(), nullptr,
                                   VerifyOptions().device(torch::Device(torch::kCUDA, 99))),
                       "verify(): option 'device' must be the CPU or an available CUDA device, but got cuda:99 (this "
                       "process sees ");
}

}  // namespace
