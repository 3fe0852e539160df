// SigLIP against a textbook single-device computation on the concatenated
// batch: fp64 values and gradients to 1e-10 for W = 1..4 with uneven (even
// empty) ranks and chunks that do not divide the batch; finite differences of
// the autograd function; extreme logits; every argument error.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "contrax/losses/siglip.h"
#include "contrax/engine/workspace.h"
#include "engine/lse_kernels.h"
#include "engine/panels.h"
#include "support/emulated_panels.h"
#include "support/errors.h"
#include "support/ranks.h"

namespace {

using contrax::CommunicatorPtr;
using namespace contrax::testing;

constexpr double kTol = 1e-10;

torch::Tensor randn(std::vector<int64_t> shape) { return torch::randn(shape, torch::kFloat64); }

// -(1/B) sum_ij log sigmoid(z_ij (s a_i.b_j + bias)), [B x B] logits.
torch::Tensor reference_siglip(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                               const torch::Tensor& bias) {
  const int64_t B = a.size(0);
  auto logits = torch::mm(a, b.t()) * logit_scale.exp() + bias;
  auto z = 2 * torch::eye(B, torch::kFloat64) - 1;
  return -torch::log_sigmoid(z * logits).sum() / static_cast<double>(B);
}

struct Grads {
  double loss = 0;
  torch::Tensor da, db, ds, dbias;
};

Grads reference_grads(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& ls, const torch::Tensor& bias) {
  auto x = a.clone().requires_grad_(true), y = b.clone().requires_grad_(true);
  auto s = ls.clone().requires_grad_(true), c = bias.clone().requires_grad_(true);
  auto l = reference_siglip(x, y, s, c);
  l.backward();
  return {l.item<double>(), x.grad(), y.grad(), s.grad(), c.grad()};
}

// Runs siglip_loss on W ranks and returns the data-parallel result: averaged
// loss and scalar gradients, feature gradients divided by W and concatenated.
Grads distributed_grads(int64_t W, const std::vector<int64_t>& counts, const torch::Tensor& a, const torch::Tensor& b,
                        const torch::Tensor& ls, const torch::Tensor& bias, int64_t chunk,
                        contrax::RingTransport transport = contrax::RingTransport::kAuto,
                        contrax::MemoryPath path = contrax::MemoryPath::kTiled, bool ring = true) {
  std::mutex m;
  std::vector<Grads> per(W);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    auto x = shard(a, counts, r).clone().requires_grad_(true);
    auto y = shard(b, counts, r).clone().requires_grad_(true);
    auto s = ls.clone().requires_grad_(true), c = bias.clone().requires_grad_(true);
    auto l = contrax::siglip_loss(x, y, s, c,
                                  contrax::SigLipLossOptions().comm(comm).path(path).tile_size(chunk).ring(ring));
    l.backward();
    std::lock_guard<std::mutex> lock(m);
    per[r] = {l.item<double>(), x.grad(), y.grad(), s.grad(), c.grad()};
  }, std::chrono::seconds(30), [&](int64_t, contrax::CommunicatorOptions& o) { o.ring_transport(transport); });
  Grads g;
  std::vector<torch::Tensor> da, db;
  g.ds = torch::zeros({}, torch::kFloat64);
  g.dbias = torch::zeros({}, torch::kFloat64);
  for (auto& p : per) {
    g.loss += p.loss / static_cast<double>(W);
    da.push_back(p.da / static_cast<double>(W));
    db.push_back(p.db / static_cast<double>(W));
    g.ds = g.ds + p.ds / static_cast<double>(W);
    g.dbias = g.dbias + p.dbias / static_cast<double>(W);
  }
  g.da = torch::cat(da, 0);
  g.db = torch::cat(db, 0);
  return g;
}

void expect_same(const Grads& x, const Grads& ref, double tol = kTol) {
  EXPECT_LE(std::abs(x.loss - ref.loss), tol * std::abs(ref.loss));
  EXPECT_LE(rel_err(x.da, ref.da), tol);
  EXPECT_LE(rel_err(x.db, ref.db), tol);
  EXPECT_LE(rel_err(x.ds, ref.ds), tol);
  EXPECT_LE(rel_err(x.dbias, ref.dbias), tol);
}

// The fused SigLIP kernel (CONTRAX_FUSED_KERNELS=1) on the CUDA walk, run on
// the CPU under the SIMT emulator: 600 rows in panels of 256 (two full and a
// short one), W = 1 and W = 3 with an empty rank, gathered keys (tiled and
// materialised) and the ring, exact against the reference in fp64. With the
// keys gathered the forward runs the gradient's GEMMs, so its backward sends
// no panel to a kernel; the ring's backward recomputes each panel with it.
TEST(SigLip, FusedKernelOnTheEmulatedCudaWalk) {
  torch::manual_seed(12);
  const int64_t B = 600, d = 8;
  auto a = randn({B, d}), b = randn({B, d});
  auto ls = torch::tensor(std::log(10.0), torch::kFloat64), bias = torch::tensor(-2.0, torch::kFloat64);
  const auto ref = reference_grads(a, b, ls, bias);
  contrax::testing::EmulatedCudaWalk walk(4);
  contrax::set_loss_panel_bytes(contrax::detail::panel_workspace_bytes(c10::kCPU, torch::kFloat64, {256, B}, d));
  for (auto path : {contrax::MemoryPath::kTiled, contrax::MemoryPath::kMaterialised}) {
    auto x = a.clone().requires_grad_(true), y = b.clone().requires_grad_(true);
    auto s = ls.clone().requires_grad_(true), c = bias.clone().requires_grad_(true);
    const int64_t before = contrax::detail::cuda_panel_calls();
    auto l = contrax::siglip_loss(x, y, s, c, contrax::SigLipLossOptions().path(path));
    const int64_t forward = contrax::detail::cuda_panel_calls() - before;
    l.backward();
    EXPECT_EQ(forward, path == contrax::MemoryPath::kTiled ? 3 : 1) << "a kernel per panel (materialised: one)";
    EXPECT_EQ(contrax::detail::cuda_panel_calls() - before, forward) << "the backward reads no logits";
    expect_same({l.item<double>(), x.grad(), y.grad(), s.grad(), c.grad()}, ref);
  }
  for (bool ring : {false, true}) {
    const int64_t before = contrax::detail::cuda_panel_calls();
    expect_same(distributed_grads(3, {350, 0, 250}, a, b, ls, bias, 0, contrax::RingTransport::kAuto,
                                  contrax::MemoryPath::kTiled, ring),
                ref);
    EXPECT_GT(contrax::detail::cuda_panel_calls(), before) << (ring ? "ring" : "gathered");
  }
}

// SigLIP on the ring with both of its transports, send/receive pairs (Gloo's
// default) and one all-to-all per step (NCCL's, run here over Gloo); then
// with gathered keys, tiled and materialised.
class SigLipDistributed : public ::testing::TestWithParam<std::tuple<int64_t, contrax::RingTransport>> {};

TEST_P(SigLipDistributed, MatchesSingleDevice) {
  const auto [W, transport] = GetParam();
  const std::vector<std::vector<int64_t>> all_counts = {{7}, {5, 3}, {4, 0, 3}, {3, 1, 4, 2}};
  const std::vector<int64_t> chunks = {3, 1, 2, 0};
  const auto& counts = all_counts[W - 1];
  int64_t B = 0;
  for (auto c : counts) B += c;
  torch::manual_seed(50 + W);
  auto a = randn({B, 6}), b = randn({B, 6});
  auto ls = torch::tensor(std::log(2.0), torch::kFloat64), bias = torch::tensor(-1.5, torch::kFloat64);
  const auto ref = reference_grads(a, b, ls, bias);
  expect_same(distributed_grads(W, counts, a, b, ls, bias, chunks[W - 1], transport), ref);
  if (transport != contrax::RingTransport::kSendRecv) return;  // the transport is the ring's only
  using contrax::MemoryPath;
  expect_same(distributed_grads(W, counts, a, b, ls, bias, chunks[W - 1], transport, MemoryPath::kTiled, false), ref);
  expect_same(distributed_grads(W, counts, a, b, ls, bias, 0, transport, MemoryPath::kMaterialised, false), ref);
  expect_same(distributed_grads(W, counts, a, b, ls, bias, 0, transport, MemoryPath::kAuto, false), ref);
}

INSTANTIATE_TEST_SUITE_P(Worlds, SigLipDistributed,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(contrax::RingTransport::kSendRecv,
                                                              contrax::RingTransport::kAllToAll)),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == contrax::RingTransport::kAllToAll ? "_all_to_all"
                                                                                               : "_send_recv");
                         });

TEST(SigLip, EveryChunkSizeSingleDevice) {
  torch::manual_seed(3);
  auto a = randn({9, 4}), b = randn({9, 4});
  auto ls = torch::tensor(1.0, torch::kFloat64), bias = torch::tensor(-2.0, torch::kFloat64);
  auto ref = reference_grads(a, b, ls, bias);
  for (int64_t chunk : {1, 2, 4, 5, 9, 100, 0}) expect_same(distributed_grads(1, {9}, a, b, ls, bias, chunk), ref);
}

// SigLIP's own regime: scale 10 .. 100, bias -10, large positive and negative
// logits; log sigmoid must stay exact in both tails.
TEST(SigLip, ExtremeLogits) {
  torch::manual_seed(4);
  auto base = randn({1, 8});
  auto a = base + 1e-3 * randn({6, 8}), b = base + 1e-3 * randn({6, 8});
  auto ls = torch::tensor(std::log(100.0), torch::kFloat64), bias = torch::tensor(-10.0, torch::kFloat64);
  auto ref = reference_grads(a, b, ls, bias);
  auto got = distributed_grads(2, {4, 2}, a, b, ls, bias, 2);
  EXPECT_TRUE(std::isfinite(got.loss));
  expect_same(got, ref);
  // Far-apart features: positives at -40 and negatives at +40 before the bias.
  auto u = randn({5, 3}) * 3;
  auto ref2 = reference_grads(u, -u, ls.clone().fill_(std::log(2.0)), bias.clone().fill_(0.0));
  expect_same(distributed_grads(1, {5}, u, -u, ls.clone().fill_(std::log(2.0)), bias.clone().fill_(0.0), 2), ref2);
}

TEST(SigLip, FiniteDifferences) {
  torch::manual_seed(5);
  std::vector<torch::Tensor> in = {randn({5, 3}).requires_grad_(true), randn({5, 3}).requires_grad_(true),
                                   torch::tensor(0.6, torch::kFloat64).requires_grad_(true),
                                   torch::tensor(-0.8, torch::kFloat64).requires_grad_(true)};
  auto f = [](const std::vector<torch::Tensor>& x) {
    return contrax::siglip_loss(x[0], x[1], x[2], x[3], contrax::SigLipLossOptions().tile_size(2));
  };
  EXPECT_LE(contrax::testing::finite_difference_error(f, in), 1e-6);
}

TEST(SigLip, NoBiasAndNormaliseAndModule) {
  torch::manual_seed(6);
  auto a = randn({4, 3}), b = randn({4, 3});
  auto ls = torch::tensor(0.5, torch::kFloat64);
  auto x = a.clone().requires_grad_(true);
  auto l = contrax::siglip_loss(x, b, ls, c10::nullopt, contrax::SigLipLossOptions().normalize(true));
  namespace F = torch::nn::functional;
  auto an = F::normalize(a, F::NormalizeFuncOptions().dim(1)), bn = F::normalize(b, F::NormalizeFuncOptions().dim(1));
  EXPECT_LE(rel_err(l, reference_siglip(an, bn, ls, torch::tensor(0.0, torch::kFloat64))), kTol);
  l.backward();
  EXPECT_TRUE(x.grad().defined());

  contrax::SigLipLoss module;
  EXPECT_NEAR(module->logit_scale.item<double>(), std::log(10.0), 1e-7);
  EXPECT_NEAR(module->logit_bias.item<double>(), -10.0, 1e-7);
  auto lm = module(a, b);
  lm.backward();
  EXPECT_TRUE(module->logit_scale.grad().defined());
  EXPECT_TRUE(module->logit_bias.grad().defined());
}

// fp32 features of 1e20, whose squares overflow fp32: F::normalize gave zeros
// (a loss of the bias alone); siglip_loss now normalises as every loss does
// (engine/prologue.h, prepare), so the loss is that of the unscaled features.
TEST(SigLip, NormalizeDoesNotOverflow) {
  torch::manual_seed(7);
  auto a = randn({5, 4}), b = randn({5, 4});
  auto ls = torch::tensor(std::log(10.0), torch::kFloat64), bias = torch::tensor(-1.0, torch::kFloat64);
  const auto o = contrax::SigLipLossOptions().normalize(true);
  auto ref = contrax::siglip_loss(a, b, ls, bias, o);
  auto x = (a * 1e20).to(torch::kFloat).requires_grad_(true);
  auto l = contrax::siglip_loss(x, (b * 1e20).to(torch::kFloat), ls.to(torch::kFloat), bias.to(torch::kFloat), o);
  EXPECT_NEAR(l.item<double>(), ref.item<double>(), 1e-5 * std::abs(ref.item<double>()));
  l.backward();
  EXPECT_TRUE(x.grad().isfinite().all().item<bool>());
}

TEST(SigLip, DoubleBackwardIsAnError) {
  auto a = randn({3, 2}).requires_grad_(true), b = randn({3, 2});
  auto l = contrax::siglip_loss(a, b, torch::tensor(0.0, torch::kFloat64), torch::tensor(0.0, torch::kFloat64));
  CONTRAX_EXPECT_ERROR(torch::autograd::grad({l}, {a}, {}, true, true), "siglip_loss(): double backward");
}

TEST(SigLip, ArgumentErrors) {
  auto a = randn({3, 2}), b = randn({3, 2}), ls = torch::tensor(0.0, torch::kFloat64);
  using O = contrax::SigLipLossOptions;
  // Each call throws siglip_loss()'s message `what`.
  auto bad = [](const std::function<void()>& call, const std::string& what) {
    expect_error(call, "siglip_loss(): " + what);
  };
  bad([&] { contrax::siglip_loss(a, b, torch::ones({2}, torch::kFloat64)); },
      "argument 'logit_scale' must be a 0-dim tensor, but got shape [2]");
  bad([&] { contrax::siglip_loss(a, b, ls, torch::ones({1}, torch::kFloat64)); },
      "argument 'logit_bias' must be a 0-dim tensor");
  bad([&] { contrax::siglip_loss(a, randn({2, 2}), ls); }, "arguments 'a' and 'b' must have the same number of rows");
  bad([&] { contrax::siglip_loss(a, randn({3, 4}), ls); }, "arguments 'a' and 'b' must have the same width");
  bad([&] { contrax::siglip_loss(a, b.to(torch::kFloat32), ls); }, "arguments 'a' and 'b' must have the same dtype");
  bad([&] { contrax::siglip_loss(randn({3}), b, ls); }, "argument 'a' must be a 2-D");
  bad([&] { contrax::siglip_loss(a, b, ls, {}, O().tile_size(-1)); }, "argument 'tile_size' must be >= 0");
  bad([&] { contrax::siglip_loss(a, b, ls, {}, O().tile_bytes(0)); }, "argument 'tile_bytes' must be positive");
  bad([&] { contrax::siglip_loss(a, b, ls, {}, O().path(contrax::MemoryPath::kMaterialised).ring(true)); },
      "'ring' needs the tiled path, but the path is materialised");
  bad([&] { contrax::siglip_loss(a, b, ls, {}, O().max_logit_scale(-1)); },
      "argument 'max_logit_scale' must be positive");
  bad([&] { contrax::siglip_loss(torch::zeros({0, 2}, torch::kFloat64), torch::zeros({0, 2}, torch::kFloat64), ls); },
      "the global batch is empty");
  expect_error([] { contrax::SigLipLoss(contrax::SigLipLossOptions(), -1.0); },
               "SigLipLoss(): argument 'init_scale' must be positive");
}

// A bad argument on one rank is an error on every rank, not a hang.
TEST(SigLip, OneRankBadArgumentFailsEveryRank) {
  auto errors = contrax::testing::run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto a = randn({3, 2});
    auto b = comm->rank() == 1 ? randn({2, 2}) : randn({3, 2});
    contrax::siglip_loss(a, b, torch::tensor(0.0, torch::kFloat64), {}, contrax::SigLipLossOptions().comm(comm));
  });
  EXPECT_NE(errors[1].find("must have the same number of rows"), std::string::npos) << errors[1];
  EXPECT_FALSE(errors[0].empty());
}

}  // namespace
