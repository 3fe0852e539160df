// The benchmark commands' flag errors: each is reported, naming the flag, before
// any benchmark work starts (so these runs take milliseconds).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "support/cli.h"

namespace {

using contrax::testing::run_cli;

void expect_flag_error(const std::string& args, const std::string& message) {
  auto r = run_cli(args);
  EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
  EXPECT_NE(r.out.find(message), std::string::npos) << args << "\n" << r.out;
}

}  // namespace

// The flags bench-tiled and bench-losses share, refused alike by both (each
// command with the sizes a run on the GPU would take).
TEST(BenchCli, SharedFlagErrors) {
  for (const std::string cmd : {"bench-tiled --batches 64", "bench-losses --nproc 2 --batch 8"}) {
    expect_flag_error(cmd + " --width 0", "flag '--width' must be >= 1, but got 0");
    expect_flag_error(cmd + " --iters 0", "flag '--iters' must be >= 1, but got 0");
    expect_flag_error(cmd + " --device tpu", "flag '--device' must be cpu or cuda, but got 'tpu'");
    // Refused before any process starts; where a GPU is, the tests below run on it.
    if (!torch::cuda::is_available()) expect_flag_error(cmd + " --device cuda", "flag '--device' is 'cuda', but ");
  }
}

TEST(BenchCli, TiledFlagErrors) {
  expect_flag_error("bench-tiled --tile -1", "flag '--tile' must be >= 0, but got -1");
  expect_flag_error("bench-tiled --threads -2", "flag '--threads' must be >= 0, but got -2");
  expect_flag_error("bench-tiled --batches 64,0", "flag '--batches': every entry must be in [1, 1073741824], but got 0");
  expect_flag_error("bench-tiled --batches ,", "flag '--batches' needs at least one batch size");
  // Where a GPU is (tools/gpu_check.sh runs the suite there): a small run on it.
  if (!torch::cuda::is_available()) return;
  auto r = run_cli("bench-tiled --device cuda --batches 256 --max-materialised 256");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("fp32 on cuda"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| 256 |"), std::string::npos) << r.out;
}

TEST(BenchCli, LossesFlagErrors) {
  expect_flag_error("bench-losses --nproc , --batch 8", "flags '--nproc' and '--batch' must not be empty");
  expect_flag_error("bench-losses --nproc 100000", "flag '--nproc': every entry must be in [1, ");
  expect_flag_error("bench-losses stray", "not expected: stray");
  if (!torch::cuda::is_available()) return;
  const auto gpus = static_cast<int64_t>(torch::cuda::device_count());
  expect_flag_error("bench-losses --device cuda --batch 8 --nproc " + std::to_string(gpus + 1),
                    "flag '--device' is 'cuda' (each rank on its own GPU, NCCL between them), which needs one GPU "
                    "per rank, but --nproc is " + std::to_string(gpus + 1));
}

TEST(BenchCli, GradCacheFlagErrors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--chunk 0", "flag '--chunk' must be >= 1, but got 0"},
      {"--hidden 0", "flag '--hidden' must be >= 1, but got 0"},
      {"--steps 0", "flag '--steps' must be >= 1, but got 0"},
      {"--threads -1", "flag '--threads' must be >= 0, but got -1"},
      {"--batches 8,-4", "flag '--batches': every entry must be in [1, 1073741824], but got -4"},
      {"--gc-batches 0", "flag '--gc-batches': every entry must be in [1, 1073741824], but got 0"},
  };
  for (const auto& [flags, message] : cases) expect_flag_error("bench-grad-cache " + flags, message);
  expect_flag_error("bench-grad-cache --loss fancy",
                    "flag '--loss' must be tiled or materialised, but got 'fancy'");
}

TEST(BenchCli, PlanFlagErrorsAndGrouped) {
  expect_flag_error("plan --loss clip --group 4",
                    "flag '--group' applies to --loss grouped and maxsim only, but --loss is 'clip'");
  expect_flag_error("plan --loss grouped --group 0", "flag '--group' must be >= 1, but got 0");
  expect_flag_error("plan --loss triplet",
                    "flag '--loss' must be clip, infonce, grouped, nt_xent, moco_v3, siglip or maxsim, but got "
                    "'triplet'");
  auto r = run_cli("plan --loss grouped --group 8 --batch 4096 --world 4");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("plan: grouped (g = 8), B = 4096 (1024 rows on the largest rank)"), std::string::npos) << r.out;
  // [1024 x 4096 g] fp32 logits: 128 MiB, under the 256 MiB threshold.
  EXPECT_NE(r.out.find("| materialised (chosen) |"), std::string::npos) << r.out;
}

// Matryoshka prefixes: one logits buffer per prefix, so 64 MiB of CLIP logits
// at B = 4096 become 256 MiB over four prefixes (still materialised at the
// 256 MiB threshold; five would tile); the flag's errors are usage errors.
TEST(BenchCli, PlanMatryoshka) {
  expect_flag_error("plan --width 768 --matryoshka 64,1024",
                    "flag '--matryoshka': every entry must be in [1, 768], but got 1024");
  expect_flag_error("plan --matryoshka 64,64", "flag '--matryoshka' must not repeat a width, but 64 appears more "
                                               "than once");
  auto four = run_cli("plan --batch 4096 --width 768 --matryoshka 256,64,128");
  EXPECT_EQ(four.status, 0) << four.out;
  EXPECT_NE(four.out.find("scorer: Matryoshka prefixes 64, 128, 256, 768"), std::string::npos) << four.out;
  // CLIP's shared pass on the CPU: one 64 MiB buffer, a 4 MiB logits panel
  // and a 4 MiB panel of each of the three recomputed prefixes; 3 + 1/3
  // products of work (the second widest prefix, 256 of 768, recomputed).
  EXPECT_NE(four.out.find("one shared pass over the width"), std::string::npos) << four.out;
  EXPECT_NE(four.out.find("| materialised (chosen) | 80.0 MiB | 24.0 MiB | 3 | 85.9 |"), std::string::npos)
      << four.out;
  // SigLIP's prefixes one after another: a buffer each, five over the 256 MiB
  // the automatic path allows.
  auto four_loop = run_cli("plan --loss siglip --batch 4096 --width 768 --matryoshka 256,64,128");
  EXPECT_NE(four_loop.out.find("| materialised (chosen) | 256.0 MiB |"), std::string::npos) << four_loop.out;
  auto five = run_cli("plan --loss siglip --batch 4096 --width 768 --matryoshka 32,64,128,256");
  EXPECT_NE(five.out.find("| tiled (chosen) |"), std::string::npos) << five.out;
  auto dot = run_cli("plan --batch 4096 --width 768");
  EXPECT_NE(dot.out.find("scorer: one dot product of the whole width"), std::string::npos) << dot.out;
}
