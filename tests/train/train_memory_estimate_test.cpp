// A training step's memory: the image recipes' estimate against what the
// allocator counts (MemoryTracker), the refusal of a run that cannot fit
// (library and `contrax train`), and an allocation that fails during a step
// turned into an error naming the step and the flags.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "contrax/train/common/loop.h"
#include "contrax/train/common/step_memory.h"
#include "contrax/train/image/memory_estimate.h"
#include "contrax/train/image/trainer.h"
#include "contrax/util/memory.h"
#include "support/cli.h"
#include "support/processes.h"

namespace ct = contrax::train;

namespace {

ct::Dataset random_images(int64_t n) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  ct::Dataset d;
  d.images = torch::randint(0, 256, {n, 1, 28, 28}, g, torch::kUInt8);
  d.labels = torch::randint(0, 10, {n}, g, torch::kLong);
  return d;
}

constexpr int64_t kGiB = int64_t{1} << 30;

}  // namespace

// Two steps of each kind (from the second on, AdamW's moments exist too),
// measured by the allocator's count from before the model is built: the estimate is within a factor of
// two, and it moves the way the run does (half the rows per rank at W = 2,
// one chunk's activations with a gradient cache).
TEST(MemoryEstimate, WithinHalfOfTheAllocatorsCount) {
  struct Case {
    std::string name;
    ct::TrainOptions options;
    int64_t rows;
  };
  auto with = [](ct::TrainOptions o, int64_t rows) {
    o.run().batch_size(rows).max_steps(2).warmup_steps(0).log_every(0);
    return o;
  };
  ct::TrainOptions moco, chunked, fp64;
  moco.recipe("moco-v3");
  chunked.chunk_size(32);
  fp64.run().dtype(torch::kDouble);
  const std::vector<Case> cases{{"simclr, 64 rows", with({}, 64), 64},
                                {"simclr, 256 rows", with({}, 256), 256},
                                {"moco-v3, 128 rows", with(moco, 128), 128},
                                {"simclr, gradient cache of 32, 256 rows", with(chunked, 256), 256},
                                {"simclr, fp64, 96 rows", with(fp64, 96), 96},
                                {"peer recipe, 128 rows", with(ct::peer_recipe(), 128), 128}};
  for (const auto& c : cases) {
    const auto data = random_images(2 * c.rows);  // two full steps: the second has AdamW's state
    const auto estimate = ct::estimate_step_memory(c.options, 1, 28, 28, c.rows, 1);
    contrax::PeakScope scope;
    ct::train_contrastive(nullptr, data, c.options);
    const double measured = static_cast<double>(scope.peak_above_start());
    const double ratio = static_cast<double>(estimate.total()) / measured;
    std::cout << c.name << ": estimate " << contrax::format_bytes(static_cast<double>(estimate.total())) << " ("
              << ct::to_string(estimate) << "), measured " << contrax::format_bytes(measured) << ", ratio " << ratio
              << "\n";
    EXPECT_GT(ratio, 2.0 / 3.0) << c.name << ": estimate " << ct::to_string(estimate) << ", measured " << measured;
    EXPECT_LT(ratio, 1.5) << c.name << ": estimate " << ct::to_string(estimate) << ", measured " << measured;
  }
  const ct::TrainOptions o;
  const auto one = ct::estimate_step_memory(o, 1, 28, 28, 256, 1), two = ct::estimate_step_memory(o, 1, 28, 28, 256, 2);
  EXPECT_NEAR(static_cast<double>(two.activations), one.activations / 2.0, 1.0);
  EXPECT_EQ(two.model, one.model);
  const auto cached = ct::estimate_step_memory(ct::TrainOptions(o).chunk_size(16), 1, 28, 28, 256, 1);
  EXPECT_NEAR(static_cast<double>(cached.activations), one.activations / 32.0, 1.0);  // 16 rows, not 2 x 256
  EXPECT_THROW(ct::estimate_step_memory(o, 1, 0, 28, 256, 1), c10::Error);
  EXPECT_THROW(ct::estimate_step_memory(o, 1, 28, 28, 0, 1), c10::Error);
}

// The library says whether a step fits and what to shrink (a status value);
// the tool's words for it, naming its flags, are tested in
// cli_train_errors_test.cpp.
TEST(MemoryEstimate, RefusalSaysWhatShrinksTheLargestPart) {
  using S = ct::StepMemoryShrink;
  ct::StepMemory need;
  need.activations = 10 * kGiB;
  need.loss = kGiB;
  need.model = kGiB / 2;
  need.batch = kGiB / 4;
  EXPECT_TRUE(ct::step_memory_fit(need, 4096, 2, 2, 40 * kGiB).fits);  // 2 x 11.75 GiB fit
  EXPECT_TRUE(ct::step_memory_fit(need, 4096, 2, 2, 0).fits);           // unknown: no refusal
  EXPECT_TRUE(ct::step_memory_fit(ct::StepMemory(), 4096, 2, 2, kGiB).fits);  // not estimated
  const auto fit = ct::step_memory_fit(need, 4096, 2, 2, 20 * kGiB);
  EXPECT_FALSE(fit.fits);
  EXPECT_EQ(fit.shrink, S::kActivations);
  EXPECT_EQ(fit.rows_per_process, 2048);
  EXPECT_EQ(fit.shortfall(), "needs about 12 GiB per process for a training step (activations 10 GiB, loss 1.0 GiB, "
                             "model 512 MiB, input 256 MiB), but this machine (or its memory limit) allows 20 GiB for "
                             "its 2 processes");
  const std::string gpu = ct::step_memory_fit(need, 4096, 2, 1, 8 * kGiB, "GPU cuda:1").shortfall();
  EXPECT_EQ(gpu.size() - gpu.rfind("), but GPU cuda:1 allows 8.0 GiB"), 32u) << gpu;  // and nothing after
  need.loss = 30 * kGiB;
  EXPECT_EQ(ct::step_memory_fit(need, 4096, 1, 1, 20 * kGiB).shrink, S::kBatch);
  need.model = 40 * kGiB;
  EXPECT_EQ(ct::step_memory_fit(need, 4096, 1, 1, 20 * kGiB).shrink, S::kModel);
}

// Free memory where a device allocates: the host's for the CPU; a GPU's from
// the CUDA runtime where one is, else unknown (0), so nothing is refused.
TEST(MemoryEstimate, FreeMemoryOfADevice) {
  EXPECT_GT(contrax::available_device_memory_bytes(torch::kCPU), 0);
  EXPECT_EQ(contrax::available_device_memory_bytes(torch::Device(torch::kMeta)), 0);
  const auto gpu = contrax::available_device_memory_bytes(torch::Device(torch::kCUDA, 0));
  if (torch::cuda::is_available()) {
    EXPECT_GT(gpu, 0);
  } else {
    EXPECT_EQ(gpu, 0);
  }
}

// An allocation that fails inside a step (here 1 PiB, beyond any address
// space) ends the run with the step, the batch and the flags, not the
// allocator's bare message.
TEST(TrainLoop, AnAllocationFailureNamesTheStepAndTheBatch) {
  torch::nn::Linear model(3, 1);
  ct::TrainLoop loop(nullptr, ct::RunOptions().batch_size(10).max_steps(4).log_every(0),
                     {"oversized", 40, {{"model", model.get()}}, model->parameters()});
  ct::Step step;
  step.loss = [&](const ct::StepBatch& b) {
    if (b.step == 1) torch::empty({int64_t{1} << 50}, torch::kByte);
    auto loss = model->forward(torch::ones({b.indices.size(0), 3})).sum();
    loss.backward();
    return loss;
  };
  try {
    loop.run(step);
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const ct::OutOfMemory& e) {
    // Typed (the tool words it with its flags: cli_train_errors_test.cpp).
    EXPECT_EQ(e.kind(), ct::TrainErrorKind::kOutOfMemory);
    EXPECT_EQ(e.step, 2);
    EXPECT_EQ(e.total_steps, 4);
    EXPECT_EQ(e.rows, 10);
    EXPECT_EQ(e.rows_per_rank, 10);
    EXPECT_EQ(e.checkpoint, "");
    const std::string m = e.what_without_backtrace();
    EXPECT_EQ(m.rfind("step 2/4 ran out of memory on rank 0 (10 rows in the global batch, up to 10 per rank): ", 0), 0u)
        << m;
    EXPECT_NE(e.cause.find("1125899906842624 bytes"), std::string::npos) << m;  // the allocator's own words follow
    EXPECT_EQ(e.fact().find("1125899906842624 bytes"), m.find("1125899906842624 bytes")) << m;
    EXPECT_NE(m.find("; use a smaller batch size (batch_size), or a gradient cache (a recipe's chunk size keeps the "
                     "activations of that many rows at a time); nothing was saved"),
              std::string::npos)
        << m;
  }
}

// `contrax train` refuses a run whose step cannot fit before it builds the
// model: 60000 rows through two 4096-channel full-resolution layers need
// about 6 TB, on one process and on two (whose launcher reports the ranks'
// usage error as its own status).
TEST(TrainCli, AStepThatCannotFitIsRefusedBeforeItStarts) {
  const auto need = ct::estimate_step_memory(ct::TrainOptions().model(ct::ContrastiveModelOptions().encoder(
                                                 ct::EncoderOptions().channels({4096, 4096}).strides({1, 1}))),
                                             1, 28, 28, 60000, 1);
  if (need.total() <= contrax::available_memory_bytes()) GTEST_SKIP() << "this machine has room for the step";
  const std::string run_dir = contrax::testing::scratch_path("memory_refused");
  for (const std::string nproc : {"1", "2"}) {
    const auto r = contrax::testing::run_cli("train --nproc " + nproc + " --run-dir " + run_dir + "_" + nproc +
                                             " --encoder-channels 4096,4096 --encoder-strides 1,1 --batch-size 60000 "
                                             "--no-eval --no-verify --no-plot --threads 1");
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("flag '--batch-size' (60000 rows, up to " + std::string(nproc == "1" ? "60000" : "30000") +
                         " per process) needs about "),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("try --chunk-size N (a gradient cache: the activations of N rows at a time) or a smaller "
                         "--batch-size"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find(nproc == "1" ? "allows" : "for its 2 processes"), std::string::npos) << r.out;
    EXPECT_LT(r.seconds, 60) << "refused before the model was built";
  }
}
