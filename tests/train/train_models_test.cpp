// Tests of the encoder, heads, the SimCLR / MoCo v3 modules and the LR schedule.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <ctime>
#include <cmath>

#include "contrax/losses.h"
#include "contrax/train/models.h"
#include "contrax/train/schedule.h"

namespace ct = contrax::train;

namespace {
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

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
