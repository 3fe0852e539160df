// Tests of the encoder, heads, the SimCLR / MoCo v3 modules and the LR schedule.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdlib>

#include "contrax/losses/losses.h"
#include "contrax/train/common/schedule.h"
#include "contrax/train/image/models.h"
#include "support/errors.h"
#include "support/ranks.h"

namespace ct = contrax::train;
using contrax::testing::error_of;


TEST(Models, EncoderAndHeadShapes) {
  torch::manual_seed(0);
  ct::Encoder enc(ct::EncoderOptions{});
  EXPECT_EQ(enc->output_dim(), 128);
  auto h = enc(torch::randn({3, 1, 28, 28}));
  EXPECT_EQ(h.sizes(), (std::vector<int64_t>{3, 128}));
  ct::SimCLRModel model(ct::ContrastiveModelOptions().proj_dim(64));
  EXPECT_EQ(model(torch::randn({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 64}));
  ct::Encoder wide(ct::EncoderOptions().channels({32, 64, 256}).convs_per_stage(2).norm("none").strides({1, 2, 2}));
  EXPECT_EQ(wide(torch::randn({1, 1, 28, 28})).sizes(), (std::vector<int64_t>{1, 256}));
  ct::MLPHead head(ct::MLPHeadOptions(128).num_layers(3).layer_norm(true).out_dim(32));
  EXPECT_EQ(head(torch::randn({5, 128})).sizes(), (std::vector<int64_t>{5, 32}));
}

TEST(Models, PoolGridKeepsTheLayoutOfTheLastMap) {
  torch::manual_seed(3);
  // Strides 2-2-2: a 4x4 last map; a 2x2 grid averages its four 2x2 quadrants.
  const auto base = ct::EncoderOptions().channels({8, 16, 16}).strides({2, 2, 2}).groups(4);
  ct::Encoder global(base);
  ct::Encoder grid(ct::EncoderOptions(base).pool_grid(2));
  EXPECT_EQ(grid->output_dim(), 16 * 4);
  for (size_t i = 0; i < global->parameters().size(); ++i) {
    torch::NoGradGuard no_grad;
    grid->parameters()[i].copy_(global->parameters()[i]);
  }
  auto x = torch::randn({3, 1, 28, 28});
  auto g = grid(x).view({3, 16, 2, 2});  // [b, C, cell row, cell col]
  // The cells together are the global average (equal quadrants of the 4x4 map).
  EXPECT_TRUE(torch::allclose(g.mean({2, 3}), global(x), 1e-5, 1e-6));
  // A grid as fine as the map is the map itself, flattened channel-major.
  ct::Encoder whole(ct::EncoderOptions(base).pool_grid(4));
  for (size_t i = 0; i < global->parameters().size(); ++i) {
    torch::NoGradGuard no_grad;
    whole->parameters()[i].copy_(global->parameters()[i]);
  }
  auto m = whole(x).view({3, 16, 4, 4});
  EXPECT_TRUE(torch::allclose(m.mean({2, 3}), global(x), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(torch::adaptive_avg_pool2d(m, {2, 2}), g, 1e-5, 1e-6));
  // ... but each cell sees its own part of the image: without the norm (whose
  // statistics span the whole map) a change confined to the top-left corner
  // leaves the bottom-right cell as it was.
  ct::Encoder local(ct::EncoderOptions(base).norm("none").pool_grid(2));
  auto y = x.clone();
  y.narrow(2, 0, 4).narrow(3, 0, 4).add_(3.0);
  auto lx = local(x).view({3, 16, 2, 2}), ly = local(y).view({3, 16, 2, 2});
  EXPECT_TRUE(torch::allclose(ly.select(2, 1).select(2, 1), lx.select(2, 1).select(2, 1), 1e-6, 1e-7));
  EXPECT_FALSE(torch::allclose(ly.select(2, 0).select(2, 0), lx.select(2, 0).select(2, 0)));
  EXPECT_NE(error_of([] { ct::Encoder(ct::EncoderOptions().pool_grid(0)); })
                .find("Encoder(): option 'pool_grid' must be >= 1, but got 0"),
            std::string::npos);
  ct::Encoder too_fine(ct::EncoderOptions(base).pool_grid(5));
  EXPECT_NE(error_of([&] { too_fine(x); }).find("Encoder: option 'pool_grid' (5) exceeds the last feature map, 4x4"),
            std::string::npos);
}

TEST(Models, ExampleOutputIndependentOfItsBatch) {
  // No BatchNorm: a row's output must not depend on the other rows (what makes
  // a rank's forward equal to the single process's), exactly in fp64.
  torch::manual_seed(1);
  ct::SimCLRModel model(ct::ContrastiveModelOptions{});
  model->to(torch::kDouble);
  auto x = torch::randn({6, 1, 28, 28}, torch::kDouble);
  auto all = model(x);
  auto parts = torch::cat({model(x.narrow(0, 0, 2)), model(x.narrow(0, 2, 4))});
  EXPECT_TRUE(torch::allclose(all, parts, 1e-12, 1e-12));
}

TEST(Models, DropoutIsOffByDefaultAndCanBeEnabled) {
  torch::manual_seed(2);
  ct::Encoder enc(ct::EncoderOptions{});
  auto x = torch::randn({4, 1, 28, 28});
  EXPECT_TRUE(torch::equal(enc(x), enc(x)));
  ct::Encoder drop(ct::EncoderOptions().dropout(0.5));
  EXPECT_FALSE(torch::equal(drop(x), drop(x)));
  drop->eval();
  EXPECT_TRUE(torch::equal(drop(x), drop(x)));
}

TEST(Models, MocoV3MomentumBranch) {
  torch::manual_seed(3);
  ct::MocoV3Model model(ct::ContrastiveModelOptions{});
  auto x = torch::randn({4, 1, 28, 28});
  // Starts as a copy of the online branch.
  EXPECT_TRUE(torch::allclose(model->key(x), model->online(x)));
  EXPECT_FALSE(model->key(x).requires_grad());
  EXPECT_TRUE(model->query(x).requires_grad());
  // The optimizer gets only online + predictor parameters.
  const auto trainable = model->trainable_parameters();
  EXPECT_EQ(trainable.size(), model->online->parameters().size() + model->predictor->parameters().size());
  for (const auto& p : trainable) EXPECT_TRUE(p.requires_grad());
  for (const auto& p : model->momentum->parameters()) EXPECT_FALSE(p.requires_grad());
  // One SGD step then an EMA with m = 0.9 moves the momentum 10% of the way.
  auto before = model->momentum->encoder->parameters().front().clone();
  torch::optim::SGD sgd(trainable, torch::optim::SGDOptions(0.1));
  auto loss = contrax::moco_v3_loss(model->query(x), model->query(x.flip({3})), model->key(x),
                                    model->key(x.flip({3})), contrax::MocoV3LossOptions().temperature(0.2));
  loss.backward();
  sgd.step();
  model->update_momentum(0.9);
  auto online = model->online->encoder->parameters().front();
  auto expected = 0.9 * before + 0.1 * online;
  EXPECT_TRUE(torch::allclose(model->momentum->encoder->parameters().front(), expected, 1e-6, 1e-7));
  EXPECT_FALSE(torch::allclose(model->momentum->encoder->parameters().front(), online));
  EXPECT_NE(error_of([&] { model->update_momentum(1.5); })
                .find("MocoV3Model::update_momentum(): argument 'm' must be in [0, 1], but got 1.5"),
            std::string::npos);
}

TEST(Models, EncoderTrainingSpeedOnTwoThreads) {
  // Forward + backward of the encoder with projector on augmented-size
  // batches; printed so the report can quote it. A loose bound catches a
  // pathological slowdown (e.g. reference BLAS).
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  torch::manual_seed(4);
  ct::SimCLRModel model(ct::ContrastiveModelOptions{});
  auto x = torch::randn({256, 1, 28, 28});
  model(x).sum().backward();
  const auto t0 = std::chrono::steady_clock::now();
  const auto c0 = std::clock();
  const int iters = 4;
  for (int i = 0; i < iters; ++i) {
    model->zero_grad();
    model(x).pow(2).sum().backward();
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // CPU seconds / 2: what two otherwise idle cores would take (the machine
  // running the tests is often shared).
  const double cpu = double(std::clock() - c0) / CLOCKS_PER_SEC / 2;
  std::cout << "encoder+projector forward+backward on 2 threads: " << iters * 256 / wall << " images/s wall, "
            << iters * 256 / cpu << " images/s per 2 CPU-seconds (" << ct::count_parameters(model->parameters())
            << " parameters)\n";
  EXPECT_GT(iters * 256 / cpu, 200.0);
  at::set_num_threads(threads);
}

TEST(Models, ErrorsNameTheOption) {
  EXPECT_NE(error_of([] { ct::Encoder(ct::EncoderOptions().norm("batch")); })
                .find("Encoder(): option 'norm' must be \"group\" or \"none\", but got \"batch\""),
            std::string::npos);
  EXPECT_NE(error_of([] { ct::Encoder(ct::EncoderOptions().channels({}));
            }).find("Encoder(): option 'channels' must not be empty"),
            std::string::npos);
  EXPECT_NE(error_of([] { ct::Encoder(ct::EncoderOptions().channels({12}).strides({1})); })
                .find("Encoder(): option 'groups' (8) must divide every stage's channels, but stage 0 has 12"),
            std::string::npos);
  EXPECT_NE(error_of([] { ct::Encoder(ct::EncoderOptions().strides({2, 2})); })
                .find("Encoder(): option 'strides' must have one entry per stage (3), but got 2"),
            std::string::npos);
  EXPECT_NE(error_of([] { ct::Encoder(ct::EncoderOptions().dropout(1.0)); })
                .find("Encoder(): option 'dropout' must be in [0, 1), but got 1"),
            std::string::npos);
  EXPECT_NE(error_of([] { ct::MLPHead(ct::MLPHeadOptions(4).num_layers(0)); })
                .find("MLPHead(): option 'num_layers' must be >= 1, but got 0"),
            std::string::npos);
  ct::Encoder enc(ct::EncoderOptions{});
  EXPECT_NE(error_of([&] { enc(torch::randn({2, 28, 28})); })
                .find("Encoder: argument 'x' must have shape [b, 1, H, W], but got [2, 28, 28]"),
            std::string::npos);
  ct::MLPHead head(ct::MLPHeadOptions(8));
  EXPECT_NE(error_of([&] { head(torch::randn({2, 9})); })
                .find("MLPHead: argument 'x' must have shape [b, 8], but got [2, 9]"),
            std::string::npos);
}

TEST(Schedule, WarmupThenCosine) {
  auto o = ct::WarmupCosineOptions().base_lr(1.0).warmup_steps(10).total_steps(110).final_lr(0.1);
  EXPECT_DOUBLE_EQ(ct::warmup_cosine_lr(0, o), 0.1);
  EXPECT_DOUBLE_EQ(ct::warmup_cosine_lr(4, o), 0.5);
  EXPECT_DOUBLE_EQ(ct::warmup_cosine_lr(10, o), 1.0);
  EXPECT_NEAR(ct::warmup_cosine_lr(60, o), 0.55, 1e-12);
  EXPECT_NEAR(ct::warmup_cosine_lr(110, o), 0.1, 1e-12);
  EXPECT_NEAR(ct::warmup_cosine_lr(500, o), 0.1, 1e-12);
  for (int64_t s = 11; s < 110; ++s) EXPECT_LE(ct::warmup_cosine_lr(s, o), ct::warmup_cosine_lr(s - 1, o));
  EXPECT_DOUBLE_EQ(ct::warmup_cosine_lr(3, ct::WarmupCosineOptions().base_lr(2).total_steps(5).warmup_steps(5)), 1.6);
  auto p = torch::zeros({2}, torch::requires_grad());
  torch::optim::AdamW adamw({p}, torch::optim::AdamWOptions(1e-3));
  ct::set_learning_rate(adamw, 0.25);
  EXPECT_DOUBLE_EQ(adamw.param_groups()[0].options().get_lr(), 0.25);
  EXPECT_NE(error_of([&] { ct::warmup_cosine_lr(-1, o); })
                .find("warmup_cosine_lr(): argument 'step' must be >= 0, but got -1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::warmup_cosine_lr(0, o.total_steps(0)); })
                .find("warmup_cosine_lr(): option 'total_steps' must be >= 1, but got 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::warmup_cosine_lr(0, ct::WarmupCosineOptions().total_steps(5).warmup_steps(6)); })
                .find("option 'warmup_steps' must be in [0, total_steps=5], but got 6"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::set_learning_rate(adamw, -1); })
                .find("set_learning_rate(): argument 'lr' must be >= 0, but got -1"),
            std::string::npos);
}

namespace {
// relu(group_norm(x)) with torch's modules: the reference of group_norm_relu().
torch::Tensor reference_gn_relu(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, int64_t g) {
  return torch::relu(torch::group_norm(x, g, w, b, 1e-5));
}
}  // namespace

TEST(GroupNormReLU, MatchesTorchsPairInBothLayoutsAndWithABroadcastGradient) {
  torch::manual_seed(11);
  const auto f64 = torch::kDouble;
  for (const int64_t groups : {1, 2, 8}) {
    for (const bool channels_last : {false, true}) {
      auto x = torch::randn({3, 8, 5, 4}, f64);
      if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      auto w = torch::rand({8}, f64).add(0.5), b = torch::randn({8}, f64).mul(0.3);
      auto up = torch::randn({3, 8, 5, 4}, f64);
      std::vector<torch::Tensor> got, want;
      for (const bool fused : {true, false}) {
        auto xr = x.clone().requires_grad_(), wr = w.clone().requires_grad_(), br = b.clone().requires_grad_();
        auto y = fused ? ct::group_norm_relu(xr, wr, br, groups) : reference_gn_relu(xr, wr, br, groups);
        if (fused) EXPECT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast));
        // An elementwise upstream gradient, then one broadcast over H and W
        // (the backward of a sum over the map, the encoder's pooling).
        (y * up).sum().backward(torch::Tensor(), /*retain_graph=*/true);
        auto& out = fused ? got : want;
        out = {y.detach(), xr.grad().clone(), wr.grad().clone(), br.grad().clone()};
        xr.grad().zero_(), wr.grad().zero_(), br.grad().zero_();
        (y.sum({2, 3}) * up.select(3, 0).select(2, 0)).sum().backward();
        for (auto* t : {&xr, &wr, &br}) out.push_back(t->grad().clone());
      }
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_LT(contrax::testing::rel_err(got[i], want[i]), 1e-12) << "groups " << groups << " cl " << channels_last
                                                                       << " tensor " << i;
      }
    }
  }
  // fp32 against torch's fp32 pair, and an empty batch.
  auto x = torch::randn({4, 16, 7, 7}), w = torch::rand({16}), b = torch::randn({16});
  EXPECT_LT(contrax::testing::rel_err(ct::group_norm_relu(x, w, b, 4), reference_gn_relu(x, w, b, 4)), 1e-5);
  auto empty = torch::zeros({0, 16, 7, 7}, torch::requires_grad());
  auto wr = w.clone().requires_grad_();
  ct::group_norm_relu(empty, wr, b, 4).sum().backward();
  EXPECT_EQ(empty.grad().sizes(), empty.sizes());
  EXPECT_TRUE(torch::equal(wr.grad(), torch::zeros_like(w)));
}

TEST(GroupNormReLU, BackwardMatchesFiniteDifferences) {
  torch::manual_seed(12);
  const auto f64 = torch::kDouble;
  auto x = torch::randn({2, 4, 3, 3}, f64).requires_grad_();
  auto w = torch::rand({4}, f64).add(0.5).requires_grad_(), b = torch::randn({4}, f64).mul(0.3).requires_grad_();
  const auto f = [](const std::vector<torch::Tensor>& in) { return ct::group_norm_relu(in[0], in[1], in[2], 2); };
  EXPECT_LT(contrax::testing::finite_difference_error(f, {x, w, b}), 1e-7);
  // Through the pooling's broadcast gradient.
  const auto pooled = [](const std::vector<torch::Tensor>& in) {
    return ct::group_norm_relu(in[0], in[1], in[2], 4).sum({2, 3});
  };
  EXPECT_LT(contrax::testing::finite_difference_error(pooled, {x, w, b}), 1e-7);
}

TEST(GroupNormReLU, ErrorsNameTheArgument) {
  auto x = torch::randn({2, 4, 3, 3}), w = torch::ones({4}), b = torch::zeros({4});
  EXPECT_NE(error_of([&] { ct::group_norm_relu(x.flatten(2), w, b, 2); })
                .find("group_norm_relu(): argument 'x' must be 4-D [N, C, H, W], but got [2, 4, 9]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::group_norm_relu(x.to(torch::kHalf), w, b, 2); })
                .find("group_norm_relu(): argument 'x' must be float or double, but is Half"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::group_norm_relu(x, w, b, 3); })
                .find("group_norm_relu(): argument 'groups' must divide the 4 channels of 'x', but got 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::group_norm_relu(x, w, b, 2, 0.0); })
                .find("group_norm_relu(): argument 'eps' must be > 0, but got 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::group_norm_relu(x, torch::ones({3}), b, 2); })
                .find("group_norm_relu(): argument 'weight' must be [4] of Float on cpu, but got [3] of Float on cpu"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::group_norm_relu(x, w, b.to(torch::kDouble), 2); })
                .find("group_norm_relu(): argument 'bias' must be [4] of Float on cpu, but got [4] of Double on cpu"),
            std::string::npos);
  auto xr = x.clone().requires_grad_();
  auto y = ct::group_norm_relu(xr, w, b, 2).pow(2).sum();
  EXPECT_NE(error_of([&] { torch::autograd::grad({y}, {xr}, {}, /*retain_graph=*/true, /*create_graph=*/true); })
                .find("group_norm_relu(): double backward (create_graph=true) is not supported"),
            std::string::npos);
}

TEST(Models, FusedEncoderPathEqualsTorchsModules) {
  // The fused CPU path (channels-last convs + group_norm_relu + the pooling's
  // broadcast gradient) computes the same function and gradients as the
  // Sequential of torch modules: to rounding in fp64, for the default encoder,
  // two convs per stage and a pooling grid.
  for (const auto& base : {ct::EncoderOptions(), ct::EncoderOptions().channels({8, 16}).strides({1, 2}).groups(4)
                                                      .convs_per_stage(2).pool_grid(2)}) {
    torch::manual_seed(13);
    ct::Encoder fused(base);
    ct::Encoder plain(ct::EncoderOptions(base).fused_cpu(false));
    ASSERT_TRUE(fused->fused_on_cpu());
    ASSERT_FALSE(plain->fused_on_cpu());
    fused->to(torch::kDouble);
    plain->to(torch::kDouble);
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < fused->parameters().size(); ++i) plain->parameters()[i].copy_(fused->parameters()[i]);
    }
    auto x = torch::randn({5, 1, 28, 28}, torch::kDouble);
    auto up = torch::randn({5, fused->output_dim()}, torch::kDouble);
    auto hf = fused(x), hp = plain(x);
    EXPECT_LT(contrax::testing::rel_err(hf, hp), 1e-12);
    (hf * up).sum().backward();
    (hp * up).sum().backward();
    for (size_t i = 0; i < fused->parameters().size(); ++i) {
      const auto p = fused->parameters()[i];
      EXPECT_LT(contrax::testing::rel_err(p.grad(), plain->parameters()[i].grad()), 1e-10) << "parameter " << i;
      // Every gradient has its parameter's strides (c10d's Reducer checks
      // them), also the first conv's [C, 1, 3, 3] (see the Encoder's hook).
      EXPECT_EQ(p.grad().strides(), p.strides()) << "parameter " << i;
    }
  }
  // fp32, the training dtype: equal to float rounding.
  torch::manual_seed(14);
  ct::Encoder fused(ct::EncoderOptions{});
  ct::Encoder plain(ct::EncoderOptions().fused_cpu(false));
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < fused->parameters().size(); ++i) plain->parameters()[i].copy_(fused->parameters()[i]);
  }
  auto x = torch::randn({8, 1, 28, 28});
  auto hf = fused(x);
  EXPECT_LT(contrax::testing::rel_err(hf, plain(x)), 1e-5);
  // oneDNN's channels-last backward (fp32 only) returns each weight's
  // gradient channels-last; accumulated, every gradient has its parameter's
  // strides (c10d's Reducer checks them), also the first conv's [32, 1, 3, 3]
  // (see the Encoder's hook).
  hf.sum().backward();
  for (const auto& p : fused->parameters()) EXPECT_EQ(p.grad().strides(), p.strides()) << p.sizes();
  // CONTRAX_FUSED_ENCODER=0 turns the path off for encoders built after it.
  setenv("CONTRAX_FUSED_ENCODER", "0", 1);
  EXPECT_FALSE(ct::Encoder(ct::EncoderOptions{})->fused_on_cpu());
  unsetenv("CONTRAX_FUSED_ENCODER");
  EXPECT_TRUE(ct::Encoder(ct::EncoderOptions{})->fused_on_cpu());
  EXPECT_FALSE(ct::Encoder(ct::EncoderOptions().norm("none"))->fused_on_cpu());
}
