// Tests that a run directory follows no link it did not make: a symbolic
// link planted where a run's file (or its lock, or a checkpoint's
// temporary) should be is refused by name and left unchanged, as is the file
// it points at; another user's directory, file or link is refused; the lock
// is never truncated. Ownership cases need root (chown) and skip otherwise.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "contrax/train/common/checkpoint.h"
#include "contrax/train/common/metrics.h"
#include "contrax/train/common/run_dir.h"
#include "support/cli.h"
#include "support/errors.h"
#include "support/processes.h"

namespace ct = contrax::train;
using contrax::testing::error_of;
using contrax::testing::read_file;
using contrax::testing::TempDir;

namespace {

constexpr uid_t kNobody = 65534;

// A file outside the run directory that a planted link points at, and
// what it held.
struct Victim {
  std::string path, text = "secret of another user\n";
  explicit Victim(const std::string& dir) : path(dir + "/victim") {
    std::ofstream(path) << text;
    ::chmod(path.c_str(), 0600);
  }
  bool unchanged() const { return read_file(path) == text; }
};

bool is_link(const std::string& p) { return std::filesystem::is_symlink(std::filesystem::symlink_status(p)); }

// claim()'s refusal, or "" when it claimed.
std::string claim_error(const ct::RunDir& dir, ct::ResumeMode mode = ct::ResumeMode::kAuto, bool overwrite = false) {
  try {
    dir.claim(mode, overwrite);
  } catch (const ct::RunDirRefused& e) {
    EXPECT_EQ(e.kind(), ct::TrainErrorKind::kRunDirUnsafe) << e.what();
    return e.what();
  }
  return "";
}

}  // namespace

TEST(RunDirLinks, ALinkWhereARunFileShouldBeIsRefusedAndLeftUnchanged) {
  for (const std::string name : {".lock", "checkpoint.pt", "metrics.jsonl", "config.json", "train.log", "results.json",
                                 "curves.png"}) {
    TempDir tmp;
    Victim victim(tmp.path);
    const std::string run = tmp.path + "/run";
    std::filesystem::create_directory(run);
    std::filesystem::create_symlink(victim.path, run + "/" + name);
    // Overwriting removes a run's files: a link is not removed through, nor
    // is it left to be written through later.
    const std::string msg = claim_error(ct::RunDir(run), ct::ResumeMode::kNever, /*overwrite=*/true);
    EXPECT_NE(msg.find("'" + run + "/" + name + "' is a symbolic link; Contrax follows no link where its own file "
                       "should be"),
              std::string::npos)
        << name << ": " << msg;
    EXPECT_TRUE(victim.unchanged()) << name;
    EXPECT_TRUE(is_link(run + "/" + name)) << name << ": the link itself is left for its owner to see";
  }
}

TEST(RunDirLinks, FilesOpenedLaterFollowNoLinkEither) {
  TempDir tmp;
  Victim victim(tmp.path);
  const std::string run = tmp.path + "/run";
  ct::RunDir dir(run);
  auto claim = dir.claim(ct::ResumeMode::kNever, false);
  // Planted after the claim (a race): the log, the metrics, an atomic write.
  std::filesystem::create_symlink(victim.path, run + "/train.log");
  auto msg = error_of([&] { ::close(dir.open_append(ct::RunDir::kLog, /*truncate=*/false)); });
  EXPECT_NE(msg.find("'" + run + "/train.log' is a symbolic link"), std::string::npos) << msg;
  msg = error_of([&] { ::close(dir.open_append(ct::RunDir::kLog, /*truncate=*/true)); });
  EXPECT_NE(msg.find("is a symbolic link"), std::string::npos) << msg;
  std::filesystem::create_symlink(victim.path, run + "/metrics.jsonl");
  msg = error_of([&] { ct::read_metrics(run + "/metrics.jsonl"); });
  EXPECT_NE(msg.find("'" + run + "/metrics.jsonl' is a symbolic link"), std::string::npos) << msg;
  // An atomic write replaces a link at its name (rename) and never writes
  // through it; its temporary cannot be planted in advance (a random name,
  // created exclusively): links at every predictable name stay untouched.
  for (const std::string t : {"config.json.tmp." + std::to_string(::getpid()), std::string("config.json.tmp")}) {
    std::filesystem::create_symlink(victim.path, run + "/" + t);
  }
  std::filesystem::create_symlink(victim.path, run + "/config.json");
  dir.write(ct::RunDir::kConfig, "{}\n");
  EXPECT_FALSE(is_link(run + "/config.json"));
  EXPECT_EQ(read_file(run + "/config.json"), "{}\n");
  torch::nn::Linear lin(2, 2);
  ct::Checkpoint c;
  c.module("m", *lin);
  std::filesystem::create_symlink(victim.path, run + "/checkpoint.pt.tmp." + std::to_string(::getpid()));
  c.save(dir.checkpoint());
  EXPECT_TRUE(ct::is_valid_checkpoint(dir.checkpoint()));
  EXPECT_TRUE(victim.unchanged());
  // A checkpoint that is a link is not read either.
  std::filesystem::remove(dir.checkpoint());
  std::filesystem::create_symlink(victim.path, dir.checkpoint());
  msg = error_of([&] { c.load(dir.checkpoint()); });
  EXPECT_NE(msg.find("'" + dir.checkpoint() + "' is a symbolic link"), std::string::npos) << msg;
  EXPECT_TRUE(victim.unchanged());
}

TEST(RunDirLinks, TheLockIsNeverTruncated) {
  TempDir tmp;
  const std::string run = tmp.path + "/run";
  std::filesystem::create_directory(run);
  const std::string old(100, 'x');
  std::ofstream(run + "/.lock") << old;
  {
    auto claim = ct::RunDir(run).claim(ct::ResumeMode::kAuto, false);
    const std::string now = read_file(run + "/.lock");
    EXPECT_EQ(now.size(), old.size()) << "the lock keeps its length: written over, never truncated";
    EXPECT_EQ(std::stol(now.substr(0, 20)), static_cast<long>(::getpid()));
    // A second claim names the holder's pid.
    std::string msg;
    try {
      ct::RunDir(run).claim(ct::ResumeMode::kAuto, false);
    } catch (const ct::RunDirRefused& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("is in use by another run (pid " + std::to_string(::getpid()) + ")"), std::string::npos) << msg;
  }
}

TEST(RunDirOwners, AnotherUsersDirectoryFileOrLinkIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user (chown)";
  TempDir tmp;
  Victim victim(tmp.path);
  // The directory itself.
  const std::string theirs = tmp.path + "/theirs";
  std::filesystem::create_directory(theirs);
  ASSERT_EQ(::chown(theirs.c_str(), kNobody, kNobody), 0);
  std::string msg = claim_error(ct::RunDir(theirs));
  EXPECT_NE(msg.find("directory '" + theirs + "' belongs to uid 65534"), std::string::npos) << msg;
  EXPECT_FALSE(std::filesystem::exists(theirs + "/.lock")) << "nothing is created in it";
  // A file of theirs in a directory of ours.
  const std::string run = tmp.path + "/run";
  std::filesystem::create_directory(run);
  std::ofstream(run + "/train.log") << "theirs\n";
  ASSERT_EQ(::chown((run + "/train.log").c_str(), kNobody, kNobody), 0);
  msg = claim_error(ct::RunDir(run), ct::ResumeMode::kNever, /*overwrite=*/true);
  EXPECT_NE(msg.find("'" + run + "/train.log' belongs to uid 65534"), std::string::npos) << msg;
  EXPECT_EQ(read_file(run + "/train.log"), "theirs\n");
  // A run directory that is a link another user made (to a directory of
  // ours); a link of our own is followed.
  const std::string ours = tmp.path + "/ours";
  std::filesystem::create_directory(ours);
  std::filesystem::create_directory_symlink(ours, tmp.path + "/planted");
  ASSERT_EQ(::lchown((tmp.path + "/planted").c_str(), kNobody, kNobody), 0);
  msg = claim_error(ct::RunDir(tmp.path + "/planted"));
  EXPECT_NE(msg.find("is a symbolic link made by another user (uid 65534)"), std::string::npos) << msg;
  EXPECT_FALSE(std::filesystem::exists(ours + "/.lock"));
  std::filesystem::create_directory_symlink(ours, tmp.path + "/mine");
  EXPECT_EQ(claim_error(ct::RunDir(tmp.path + "/mine")), "");
  EXPECT_TRUE(victim.unchanged());
}

TEST(RunDirLinks, TheToolRefusesAPlantedLockWithExitTwo) {
  CONTRAX_REQUIRE_FASHION_MNIST();
  TempDir tmp;
  Victim victim(tmp.path);
  const std::string run = tmp.path + "/run";
  std::filesystem::create_directory(run);
  std::filesystem::create_symlink(victim.path, run + "/.lock");
  const auto r = contrax::testing::run_cli(contrax::testing::kTinyTrain + " --run-dir " + run);
  contrax::testing::expect_exit(r, 2, "'" + run + "/.lock' is a symbolic link; Contrax follows no link where its own "
                                      "file should be");
  EXPECT_NE(r.out.find("(choose a --run-dir of your own)"), std::string::npos) << r.out;
  EXPECT_TRUE(victim.unchanged());
}
