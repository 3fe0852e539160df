// Errors a user's data or flags cause, said in the user's terms (issue 41,
// items 4 and 5), against the real tool: a data set with no training example,
// images too small for the encoder, an empty test split; a checkpoint that is
// garbage or a directory; a first write that fails; a divergence's NaN loss; a
// finished run resumed; `verify --tol -1` and `train --run-dir ""`. Each case
// checks the exit status and that the message names the flag or file, not an
// internal function or library text.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/cli.h"
#include "support/processes.h"

namespace fs = std::filesystem;
using contrax::testing::kTinyTrain;
using contrax::testing::run_cli;

namespace {

void put_u32(std::string& s, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((v >> shift) & 0xff));
}

// An uncompressed IDX split: n images of rows x cols and n labels.
void write_split(const std::string& dir, const std::string& prefix, uint32_t n, uint32_t rows, uint32_t cols) {
  std::string images, labels;
  put_u32(images, 0x803);
  put_u32(images, n);
  put_u32(images, rows);
  put_u32(images, cols);
  images.append(static_cast<size_t>(n) * rows * cols, '\x40');
  put_u32(labels, 0x801);
  put_u32(labels, n);
  for (uint32_t i = 0; i < n; ++i) labels.push_back(static_cast<char>(i % 10));
  std::ofstream(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary) << images;
  std::ofstream(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary) << labels;
}

// A data directory with `train` and `test` examples of rows x cols pixels.
std::string data_dir(const std::string& name, uint32_t train, uint32_t test, uint32_t rows = 28, uint32_t cols = 28) {
  const std::string dir = contrax::testing::scratch_dir(name);
  write_split(dir, "train", train, rows, cols);
  write_split(dir, "t10k", test, rows, cols);
  return dir;
}

std::string run_dir(const std::string& name) { return contrax::testing::scratch_path(name); }

void expect_no_internal_words(const std::string& out) {
  for (const char* internal : {"estimate_step_memory()", "Encoder:", "embed()", "argument '", "option '"}) {
    EXPECT_EQ(out.find(internal), std::string::npos) << "'" << internal << "' in: " << out;
  }
}

}  // namespace

// Before: "estimate_step_memory(): arguments 'global_rows' and 'world' must be
// >= 1, but got 0 and 1".
TEST(UserErrors, ADataSetWithNoTrainingExampleSaysTheTrainingSetIsEmpty) {
  const std::string d = data_dir("empty_train", 0, 10);
  const auto r = run_cli("train --nproc 1 --threads 1 --max-steps 2 --batch-size 16 --no-eval --no-verify --no-plot "
                         "--data " + d + " --run-dir " + run_dir("empty_train_run"));
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("the training set is empty: --data " + d + " holds 0 examples in '" + d +
                       "/train-images-idx3-ubyte'; a run needs at least one"),
            std::string::npos)
      << r.out;
  expect_no_internal_words(r.out);
}

// Before: "Encoder: option 'pool_grid' (4) exceeds the last feature map, 1x1",
// from the first step's forward.
TEST(UserErrors, ImagesTooSmallForTheEncoderNameTheFlags) {
  const std::string d = data_dir("one_pixel", 64, 10, 1, 1);
  const auto r = run_cli("train --nproc 1 --threads 1 --max-steps 2 --batch-size 16 --no-eval --no-verify --no-plot "
                         "--data " + d + " --run-dir " + run_dir("one_pixel_run"));
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("the images of --data " + d + " are 1x1 pixels: the encoder's strides (--encoder-strides "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("leave a 1x1 feature map, smaller than --encoder-pool-grid 4"), std::string::npos) << r.out;
  expect_no_internal_words(r.out);
  // --encoder-pool-grid 1 makes the same data usable.
  const auto ok = run_cli("train --nproc 1 --threads 1 --max-steps 2 --batch-size 16 --no-eval --no-verify --no-plot "
                          "--encoder-pool-grid 1 --data " + d + " --run-dir " + run_dir("one_pixel_ok"));
  EXPECT_EQ(ok.status, 0) << ok.out;
}

// Before: the run trained, then evaluation failed with "embed(): argument
// 'images' must hold at least one image". Now before training.
TEST(UserErrors, AnEmptyTestSplitIsFoundBeforeTraining) {
  const std::string d = data_dir("empty_test", 64, 0);
  const std::string run = run_dir("empty_test_run");
  const auto r = run_cli("train --nproc 1 --threads 1 --max-steps 2 --batch-size 16 --no-verify --no-plot --data " + d +
                         " --run-dir " + run);
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("the test split is empty: --data " + d + " holds 0 examples in '" + d +
                       "/t10k-images-idx3-ubyte'; the evaluation needs at least one (or skip it with --no-eval)"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(run + "/checkpoint.pt")) << "it trained first";
  expect_no_internal_words(r.out);
}

// Before: "... not a readable checkpoint (truncated or corrupt; 8 bytes):
// PytorchStreamReader failed reading zip archive: not a ZIP archive. This is an
// internal miniz error. If you are seeing this error, there is a high
// likelihood ..."; a directory named checkpoint.pt: "truncated or corrupt;
// 4096 bytes".
TEST(UserErrors, ACorruptCheckpointOrADirectoryInItsPlaceIsSaidPlainly) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  const std::string d = run_dir("bad_checkpoint");
  ASSERT_EQ(run_cli(kTinyTrain + " --run-dir " + d).status, 0);
  std::ofstream(d + "/checkpoint.pt", std::ios::trunc) << "garbage\n";
  auto r = run_cli(kTinyTrain + " --resume --run-dir " + d);
  EXPECT_EQ(r.status, 1) << r.out;
  // The safetensors reader (since round five) says what is wrong with the
  // header, once, without repeating the path.
  EXPECT_NE(r.out.find("checkpoint.pt' is not a readable checkpoint (truncated or corrupt; 8 bytes): not a "
                       "safetensors file: its header claims 749118580988207463 bytes, but the file has 0 after the "
                       "size"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("miniz"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("If you are seeing this error"), std::string::npos) << r.out;
  fs::remove(d + "/checkpoint.pt");
  fs::create_directory(d + "/checkpoint.pt");
  r = run_cli(kTinyTrain + " --resume --run-dir " + d);
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("Checkpoint::load(): '" + d + "/checkpoint.pt' is a directory, not a checkpoint file"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("4096 bytes"), std::string::npos) << r.out;
}

// Before: "... the previous '.../checkpoint.pt' is unchanged" when the run
// had written none. The first checkpoint (4 MB) cannot be written under a
// 1 MiB RLIMIT_FSIZE (SIGXFSZ ignored: the write fails with EFBIG), while the
// small files before it can.
TEST(UserErrors, AFailedFirstCheckpointDoesNotClaimAPreviousOne) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  const std::string d = run_dir("first_write");
  std::string cmd = "trap '' XFSZ; ulimit -f 1024; exec ";
  cmd += CONTRAX_CLI_PATH;
  cmd += " " + kTinyTrain + " --run-dir " + d + " 2>&1";
  const auto r = contrax::testing::run_shell(cmd);
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("File too large"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("; '" + d + "/checkpoint.pt' was not written (there was none before)"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("the previous"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(d + "/checkpoint.pt"));
}

// Before: "training diverged at step 2/6: the loss is not finite (loss -nan, ...".
TEST(UserErrors, ADivergedLossIsNanNotMinusNan) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  const auto r = run_cli(kTinyTrain + " --max-steps 6 --lr 1e30 --temperature 0.001 --run-dir " + run_dir("nan"));
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("training diverged at step "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("-nan"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("is not finite (loss "), std::string::npos) << r.out;
}

// Before: "trained 0 steps (steps 4-3 of 3)".
TEST(UserErrors, ResumingAFinishedRunSaysItIsFinished) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  const std::string d = run_dir("finished");
  ASSERT_EQ(run_cli(kTinyTrain + " --run-dir " + d).status, 0);
  const auto r = run_cli(kTinyTrain + " --resume auto --run-dir " + d);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("nothing to train: the run in " + d + " had already finished (3 of 3 steps)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("trained 0 steps"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("4-3"), std::string::npos) << r.out;
}

// Before: both accepted (--tol -1 ran and reported a MISMATCH; --run-dir ""
// trained into runs/simclr).
TEST(UserErrors, NegativeToleranceAndEmptyRunDirAreRefusedByName) {
  auto r = run_cli("verify --nproc 1 --tol -1 --case clip");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("flag '--tol' must be >= 0, but got -1"), std::string::npos) << r.out;
  const std::string cwd = contrax::testing::scratch_dir("empty_run_dir");
  r = contrax::testing::run_cli_in(cwd, kTinyTrain + " --run-dir ''");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("flag '--run-dir' must name a directory, but got an empty string"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(cwd + "/runs")) << "it trained into runs/RECIPE";
}
