// How `contrax train` words the trainer library's typed errors
// (apps/train_errors.cpp, compiled into this test): each kind in the texts
// the tool printed when the library still named its flags, and the exit
// status each maps to. The library's errors are made by the library where
// that is cheap (the run directory's refusals, a missing data file), else
// built with the numbers a run gives; the data hints also end to end. The
// other end-to-end runs (a divergence, a refused directory, a step that
// cannot fit) are in cli_train_test.cpp, train_memory_estimate_test.cpp and
// user_errors_test.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "cli.h"
#include "support/cli.h"
#include "contrax/train/common/run_dir.h"
#include "contrax/train/image/idx.h"
#include "support/processes.h"
#include "train_errors.h"

namespace {

namespace ct = contrax::train;
namespace cli = contrax::cli;
constexpr int64_t kGiB = int64_t{1} << 30;

// The tool's message and exit status (2: UsageError, 1: any other error) for
// what `fn` throws.
struct Reported {
  std::string message;
  int status = 0;
};

Reported reported(const std::function<void()>& fn, const std::string& data_hint = "") {
  try {
    fn();
  } catch (const ct::TrainError& e) {
    const std::string message = cli::train_error_message(e, data_hint);
    try {
      cli::throw_train_error(e, message);
    } catch (const cli::UsageError& u) {
      EXPECT_EQ(u.what(), message);
      return {message, 2};
    } catch (const std::runtime_error& r) {
      EXPECT_EQ(r.what(), message);
      return {message, 1};
    }
  }
  ADD_FAILURE() << "no TrainError";
  return {};
}

TEST(TrainErrors, RunDirRefusalsNameTheFlagsAndAreUsageErrors) {
  const std::string d = contrax::testing::scratch_dir("train_errors_run_dir");
  const ct::RunDir dir(d);
  auto r = reported([&] { dir.claim(ct::ResumeMode::kAuto, /*overwrite=*/true); });
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.message, "flags '--overwrite' and '--resume' exclude each other (--overwrite starts the run again)");
  r = reported([&] { dir.claim(ct::ResumeMode::kAlways, false); });
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.message, "flag '--resume': no checkpoint " + d + "/checkpoint.pt to resume from (--resume auto starts "
                       "fresh when there is none)");
  std::ofstream(d + "/checkpoint.pt") << "x";
  std::ofstream(d + "/metrics.jsonl") << "{}\n";
  r = reported([&] { dir.claim(ct::ResumeMode::kNever, false); });
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.message, "run directory '" + d + "' already holds a run (checkpoint.pt, metrics.jsonl); continue it "
                       "with --resume (or --resume auto), or replace it with --overwrite");
  const auto held = dir.claim(ct::ResumeMode::kAlways, false);
  r = reported([&] { dir.claim(ct::ResumeMode::kAlways, false); });
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.message, "run directory '" + d + "' is in use by another run (pid " + std::to_string(::getpid()) +
                       "); wait for it to finish or choose another --run-dir");
}

// The library's own words name no flag; the tool's hint names the recipe's.
TEST(TrainErrors, UnreadableDataEndsWithTheRecipesHint) {
  const auto r = reported([] { ct::load_dataset("/nonexistent", "train"); }, " (or pass --data DIR)");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.message, "load_dataset(): file '/nonexistent/train-images-idx3-ubyte.gz' does not exist (nor without "
                       ".gz); the directory '/nonexistent' does not exist either (or pass --data DIR)");
}

// End to end: each recipe names its own flag for another data directory.
TEST(TrainErrors, TheToolNamesEachRecipesDataFlag) {
  const std::string d = contrax::testing::scratch_dir("train_errors_data");
  const std::pair<std::string, std::string> cases[] = {
      {"train --data /nonexistent --run-dir " + d + "/image",
       "check_dataset_files(): file '/nonexistent/train-images-idx3-ubyte.gz' does not exist (nor without .gz); the "
       "directory '/nonexistent' does not exist either (install Fashion-MNIST with `apt-get install "
       "dataset-fashion-mnist`, or pass --data DIR with a directory holding MNIST-format IDX files)"},
      {"train retrieval --wordnet /nonexistent --run-dir " + d + "/text",
       "cannot read WordNet file /nonexistent/data.noun (install Debian's 'wordnet-base' package: apt-get install "
       "wordnet-base; or pass --wordnet DIR)"},
  };
  for (const auto& [args, message] : cases) {
    const auto r = contrax::testing::run_cli(args + " --nproc 1 --no-plot");
    EXPECT_EQ(r.status, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("contrax train: error: " + message + "\n"), std::string::npos) << args << "\n" << r.out;
  }
}

TEST(TrainErrors, DivergenceNamesLrAndSkipNonfinite) {
  const ct::Diverged stopped(3, 8, std::nan(""), 0.5, /*loss_finite=*/false, 0, "");
  EXPECT_EQ(reported([&] { throw stopped; }).message,
            "training diverged at step 3/8: the loss is not finite (loss nan, lr 0.5); nothing was saved; lower --lr "
            "or allow skipping with --skip-nonfinite N");
  const ct::Diverged skipped(9, 10, 2.5, 1e30, /*loss_finite=*/true, 2, "runs/a/checkpoint.pt");
  const auto r = reported([&] { throw skipped; });
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.message, "training diverged at step 9/10: the gradient is not finite (loss 2.5, lr 1e+30); more than "
                       "the allowed 2 non-finite steps (--skip-nonfinite); the last good checkpoint "
                       "runs/a/checkpoint.pt is kept (if one was written); lower --lr or allow skipping with "
                       "--skip-nonfinite N");
  // The library's own message says the same in its options' names.
  EXPECT_EQ(std::string(skipped.what_without_backtrace()),
            "training diverged at step 9/10: the gradient is not finite (loss 2.5, lr 1e+30); more than the allowed 2 "
            "non-finite steps; the last good checkpoint runs/a/checkpoint.pt is kept (if one was written); lower the "
            "learning rate (lr) or allow skipping such steps (skip_nonfinite)");
}

TEST(TrainErrors, OutOfMemoryNamesBatchSizeAndChunkSize) {
  const ct::OutOfMemory e(2, 4, 0, 10, 10, "DefaultCPUAllocator: can't allocate memory", "");
  const auto r = reported([&] { throw e; });
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.message, "step 2/4 ran out of memory on rank 0 (10 rows in the global batch, up to 10 per rank): "
                       "DefaultCPUAllocator: can't allocate memory; use a smaller --batch-size, or a gradient cache "
                       "(--chunk-size N keeps the activations of N rows at a time); nothing was saved");
}

TEST(TrainErrors, ACheckpointOfAnotherDtypeNamesDtypeAndALostRecordResume) {
  const ct::CheckpointMismatch dtype("runs/a/checkpoint.pt", "dtype", "float", "double");
  EXPECT_EQ(reported([&] { throw dtype; }).message,
            "checkpoint runs/a/checkpoint.pt was written with --dtype float; this run has --dtype double (resume with "
            "the same flags)");
  EXPECT_EQ(std::string(dtype.what_without_backtrace()),
            "checkpoint runs/a/checkpoint.pt was written with dtype float; this run has dtype double (resume with the "
            "same settings)");
  // Other run settings: the same fact, the tool's advice.
  const ct::TrainError settings(ct::TrainErrorKind::kCheckpointMismatch,
                                "checkpoint c was written by a run with batch size 8; this run has 12",
                                " (resume with the same settings)");
  EXPECT_EQ(reported([&] { throw settings; }).message,
            "checkpoint c was written by a run with batch size 8; this run has 12 (resume with the same flags)");
  const ct::TrainError lost(ct::TrainErrorKind::kRecordLost,
                            "cannot write x: No space left on device; the run stopped at step 3/8 with checkpoint c",
                            " (free space, then resume the run)");
  const auto r = reported([&] { throw lost; });
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.message, "cannot write x: No space left on device; the run stopped at step 3/8 with checkpoint c (free "
                       "space, then --resume)");
}

// What the memory check refuses, in the tool's flags, for each part that
// holds the most.
TEST(TrainErrors, AStepThatCannotFitNamesTheFlagThatShrinksTheLargestPart) {
  ct::StepMemory need;
  need.activations = 10 * kGiB;
  need.loss = kGiB;
  need.model = kGiB / 2;
  need.batch = kGiB / 4;
  EXPECT_EQ(cli::step_memory_message(ct::step_memory_fit(need, 4096, 2, 2, 20 * kGiB)),
            "flag '--batch-size' (4096 rows, up to 2048 per process) needs about 12 GiB per process for a "
            "training step (activations 10 GiB, loss 1.0 GiB, model 512 MiB, input 256 MiB), but this machine "
            "(or its memory limit) allows 20 GiB for its 2 processes; try --chunk-size N (a gradient cache: the "
            "activations of N rows at a time) or a smaller --batch-size");
  EXPECT_NE(cli::step_memory_message(ct::step_memory_fit(need, 4096, 2, 1, 8 * kGiB, "GPU cuda:1"))
                .find("), but GPU cuda:1 allows 8.0 GiB; try --chunk-size N"),
            std::string::npos);
  need.loss = 30 * kGiB;
  EXPECT_NE(cli::step_memory_message(ct::step_memory_fit(need, 4096, 1, 1, 20 * kGiB))
                .find("allows 20 GiB; try a smaller --batch-size"),
            std::string::npos);
  need.model = 40 * kGiB;
  EXPECT_NE(cli::step_memory_message(ct::step_memory_fit(need, 4096, 1, 1, 20 * kGiB))
                .find("try a smaller model (--encoder-channels)"),
            std::string::npos);
}

}  // namespace
