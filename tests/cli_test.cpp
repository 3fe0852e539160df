// The `contrax` tool end to end: verify over real processes (through the
// launcher) with --json and as a table, the gradient-cache cases among the
// losses, and the command-line errors a user can cause.
#include <gtest/gtest.h>

#include <string>

#include "support/cli.h"

using contrax::testing::run_cli;

TEST(Cli, VerifyOverThreeProcessesPrintsJsonPerLoss) {
  auto r = run_cli("verify --nproc 3 --json --rows 4,0,2");
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* loss : {"clip", "clip_bias", "clip_clamped", "infonce", "nt_xent", "moco_v3", "grad_cache_clip",
                           "grad_cache_tiled_ring"}) {
    EXPECT_NE(r.out.find(std::string("{\"loss\": \"") + loss + "\", \"world_size\": 3, \"rows\": [4, 0, 2]"),
              std::string::npos)
        << loss << "\n" << r.out;
  }
  EXPECT_EQ(r.out.find("\"passed\": false"), std::string::npos) << r.out;
}

TEST(Cli, VerifySelectsTheGradientCacheCasesAndPrintsThemInTheTable) {
  auto r = run_cli("verify --nproc 4 --case grad_cache_clip,grad_cache_tiled_ring");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("W=4, rows per rank [6,3,0,5]"), std::string::npos) << r.out;
  for (const char* name : {"grad_cache_clip ", "grad_cache_tiled_ring "}) {
    const auto row = r.out.find(std::string("\n") + name);
    ASSERT_NE(row, std::string::npos) << name << "\n" << r.out;
    const auto end = r.out.find('\n', row + 1);
    EXPECT_NE(r.out.substr(row, end - row).find(" ok"), std::string::npos) << r.out;
  }
  EXPECT_EQ(r.out.find("\nclip "), std::string::npos) << "only the selected cases run\n" << r.out;
}

TEST(Cli, VerifyFailsWhenToleranceIsImpossible) {
  // A negative tolerance cannot be met: the exit status must say so.
  auto r = run_cli("verify --nproc 1 --tol -1 --case clip");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("MISMATCH"), std::string::npos) << r.out;
}

TEST(Cli, FlagErrorsNameTheFlag) {
  auto r = run_cli("verify --nproc two");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("contrax verify: error: flag '--nproc' must be an integer, but got 'two'"), std::string::npos)
      << r.out;
  r = run_cli("verify --tol abc");
  EXPECT_NE(r.out.find("flag '--tol' must be a number, but got 'abc'"), std::string::npos) << r.out;
  r = run_cli("verify --case");
  EXPECT_NE(r.out.find("flag '--case' needs a value"), std::string::npos) << r.out;
  r = run_cli("verify --nproc 1 --case nope");
  EXPECT_NE(r.out.find("verify(): unknown case 'nope'; known cases: clip"), std::string::npos) << r.out;
  r = run_cli("verify --nproc 1 --rows 1,2");
  EXPECT_NE(r.out.find("flag '--rows' must have one entry per rank (1), but got 2"), std::string::npos) << r.out;
  r = run_cli("verify --nproc 0");
  EXPECT_NE(r.out.find("flag '--nproc' must be >= 1, but got 0"), std::string::npos) << r.out;
  r = run_cli("frobnicate");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("contrax: unknown command 'frobnicate'"), std::string::npos) << r.out;
}
