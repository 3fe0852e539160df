// The `contrax` tool end to end: verify over real processes (through the
// launcher) with --json, and the command-line errors a user can cause.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>

namespace {

struct Run {
  int status;
  std::string out;
};

Run run(const std::string& args) {
  std::string cmd = std::string(CONTRAX_CLI_PATH) + " " + args + " 2>&1";
  Run r{-1, ""};
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

}  // namespace

TEST(Cli, VerifyOverThreeProcessesPrintsJsonPerLoss) {
  auto r = run("verify --nproc 3 --json --rows 4,0,2");
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* loss : {"clip", "clip_bias", "clip_clamped", "infonce", "nt_xent", "moco_v3"}) {
    EXPECT_NE(r.out.find(std::string("{\"loss\": \"") + loss + "\", \"world_size\": 3, \"rows\": [4, 0, 2]"),
              std::string::npos)
        << loss << "\n" << r.out;
  }
  EXPECT_EQ(r.out.find("\"passed\": false"), std::string::npos) << r.out;
}

TEST(Cli, VerifyFailsWhenToleranceIsImpossible) {
  // A negative tolerance cannot be met: the exit status must say so.
  auto r = run("verify --nproc 1 --tol -1 --case clip");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("MISMATCH"), std::string::npos) << r.out;
}

TEST(Cli, FlagErrorsNameTheFlag) {
  auto r = run("verify --nproc two");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("contrax verify: error: flag '--nproc' must be an integer, but got 'two'"), std::string::npos)
      << r.out;
  r = run("verify --tol abc");
  EXPECT_NE(r.out.find("flag '--tol' must be a number, but got 'abc'"), std::string::npos) << r.out;
  r = run("verify --case");
  EXPECT_NE(r.out.find("flag '--case' needs a value"), std::string::npos) << r.out;
  r = run("verify --nproc 1 --case nope");
  EXPECT_NE(r.out.find("verify(): unknown case 'nope'; known cases: clip"), std::string::npos) << r.out;
  r = run("verify --nproc 1 --rows 1,2");
  EXPECT_NE(r.out.find("flag '--rows' must have one entry per rank (1), but got 2"), std::string::npos) << r.out;
  r = run("verify --nproc 0");
  EXPECT_NE(r.out.find("flag '--nproc' must be >= 1, but got 0"), std::string::npos) << r.out;
  r = run("frobnicate");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("contrax: unknown command 'frobnicate'"), std::string::npos) << r.out;
}
