// Tests of contrax::launch and `contrax launch` with real processes: the
// torchrun environment each rank sees, rank-prefixed output, the first failure
// named and every other worker stopped (checked by pid, not by timing), signal
// forwarding, and every error message. Workers are tests/programs/launcher_probe
// and /bin/sh; grace periods are short so the whole file runs in seconds.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "contrax/launch/launcher.h"
#include "support/cli.h"
#include "support/errors.h"
#include "support/processes.h"

namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using contrax::testing::read_file;

const std::string kProbe = std::string(CONTRAX_TEST_PROGRAM_DIR) + "/launcher_probe";
const std::string kCli = CONTRAX_CLI_PATH;

/// tests/support's temporary directory, as a path.
struct TempDir {
  contrax::testing::TempDir dir{"contrax_launcher"};
  fs::path path{dir.path};
};

/// Sends this process's stdout and stderr to files for its lifetime (or until
/// stop()), since launch() forwards worker output to fds 1 and 2 directly.
class CaptureOutput {
 public:
  CaptureOutput() {
    std::fflush(nullptr);
    for (int i = 0; i < 2; ++i) {
      saved_[i] = ::dup(i + 1);
      int fd = ::open((dir_.path / std::to_string(i)).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(fd, i + 1);
      ::close(fd);
    }
  }
  ~CaptureOutput() { stop(); }
  void stop() {
    if (saved_[0] < 0) return;
    std::fflush(nullptr);
    for (int i = 0; i < 2; ++i) {
      ::dup2(saved_[i], i + 1);
      ::close(saved_[i]);
      saved_[i] = -1;
    }
    out = read_file(dir_.path / "0");
    err = read_file(dir_.path / "1");
  }
  std::string out, err;

 private:
  TempDir dir_;
  int saved_[2] = {-1, -1};
};

// What a launch returned, and what it wrote to stdout and stderr.
struct Launched {
  contrax::LaunchResult r;
  std::string out, err;
};
Launched launch_captured(const std::vector<std::string>& argv, const contrax::LaunchOptions& o) {
  CaptureOutput cap;
  auto r = contrax::launch(argv, o);
  cap.stop();
  return {r, cap.out, cap.err};
}

/// Sets an environment variable for the scope, then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

/// Waits until `dir` holds <rank>.pid for each rank in `ranks`; returns the pids.
std::vector<pid_t> wait_for_pids(const fs::path& dir, const std::vector<int>& ranks) {
  std::vector<pid_t> pids;
  for (int tries = 0; tries < 3000 && pids.size() < ranks.size(); ++tries) {  // 30 s
    pids.clear();
    for (int r : ranks) {
      std::ifstream f(dir / (std::to_string(r) + ".pid"));
      pid_t pid = 0;
      if (f >> pid) pids.push_back(pid);
    }
    if (pids.size() < ranks.size()) std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(pids.size(), ranks.size()) << "workers did not write their pid files";
  return pids;
}

/// The launcher reaps its workers, so a stopped worker is not even a zombie.
bool gone(pid_t pid) { return ::kill(pid, 0) == -1 && errno == ESRCH; }

/// Starts the contrax CLI with stdout/stderr to files in `dir`.
pid_t spawn_cli(const std::vector<std::string>& args, const fs::path& dir) {
  std::vector<std::string> all = {kCli};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string out = (dir / "cli.out").string(), err = (dir / "cli.err").string();
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(o, 1);
    ::dup2(e, 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

/// waitpid with a deadline; a CLI still running then is killed (and the test fails).
int wait_cli(pid_t pid, milliseconds timeout = milliseconds(60000)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "contrax launch did not finish in time";
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
}

struct CliRun {
  int status = -1;
  std::string out, err;
};

CliRun run_cli(const std::vector<std::string>& args) {
  TempDir dir;
  CliRun r;
  r.status = wait_cli(spawn_cli(args, dir.path));
  r.out = read_file(dir.path / "cli.out");
  r.err = read_file(dir.path / "cli.err");
  return r;
}

contrax::LaunchOptions options(int64_t nproc, milliseconds grace = milliseconds(2000)) {
  contrax::LaunchOptions o;
  o.nproc = nproc;
  o.grace = grace;
  return o;
}

// ---- environment and output -------------------------------------------------

TEST(Launcher, EveryRankSeesItsEnvironmentUnderItsPrefix) {
  // Inherited launcher variables must be replaced, not duplicated.
  ScopedEnv rank("RANK", "99"), world("WORLD_SIZE", "77");
  auto [r, out, err] = launch_captured({kProbe, "ok"}, options(4));
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_EQ(r.failed_rank, -1);
  EXPECT_EQ(r.message, "");

  std::set<std::string> ports;
  for (int k = 0; k < 4; ++k) {
    const std::regex line("\\[rank " + std::to_string(k) + "\\] env RANK=" + std::to_string(k) + " LOCAL_RANK=" +
                          std::to_string(k) +
                          " WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 GROUP_RANK=0 MASTER_ADDR=127\\.0\\.0\\.1 MASTER_PORT=(\\d+)\n");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out, m, line)) << "rank " << k << " missing in:\n" << out;
    ports.insert(m[1]);
    EXPECT_NE(err.find("[rank " + std::to_string(k) + "] stderr of rank " + std::to_string(k) + "\n"),
              std::string::npos)
        << err;
  }
  ASSERT_EQ(ports.size(), 1u) << "ranks disagree on MASTER_PORT";
  EXPECT_GT(std::stoi(*ports.begin()), 0);
}

TEST(Launcher, MultiNodeRanksFollowNodeRank) {
  contrax::LaunchOptions o = options(2);
  o.nnodes = 2;
  o.node_rank = 1;
  o.master_port = 29555;
  o.master_addr = "10.1.2.3";  // not contacted: the worker only prints it
  // sh starts in a millisecond; the probe loads LibTorch, as every program
  // linked to contrax does.
  auto [r, out, err] = launch_captured(
      {"sh", "-c", "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT"}, o);
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_NE(out.find("[rank 2] 2 0 4 2 1 10.1.2.3 29555\n"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 3] 3 1 4 2 1 10.1.2.3 29555\n"), std::string::npos) << out;
}

TEST(Launcher, ForwardsLinesAndFlushesPartialLastLine) {
  auto [r, out, err] = launch_captured({"sh", "-c", "printf 'a\\nb'; printf 'c\\n' >&2"}, options(1));
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_EQ(out, "[rank 0] a\n[rank 0] b\n");
  EXPECT_EQ(err, "[rank 0] c\n");
}

TEST(Launcher, NoPrefixPassesOutputThrough) {
  contrax::LaunchOptions o = options(1);
  o.prefix_output = false;
  auto [r, out, err] = launch_captured({"sh", "-c", "printf 'a\\nb'"}, o);
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_EQ(out, "a\nb");
}

// ---- failures ----------------------------------------------------------------

TEST(Launcher, FailedRankIsNamedAndTheOthersAreStopped) {
  TempDir dir;
  auto [r, out, err] = launch_captured({kProbe, "fail", dir.path.string()}, options(4));
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.message, "rank 1 exited with status 3");
  for (pid_t pid : wait_for_pids(dir.path, {0, 2, 3})) EXPECT_TRUE(gone(pid)) << "worker " << pid << " survived";
}

TEST(Launcher, RankKilledBySignalIsNamedWithTheSignal) {
  TempDir dir;
  auto [r, out, err] = launch_captured({kProbe, "signal", dir.path.string()}, options(3));
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
  EXPECT_EQ(r.failed_rank, 2);
  EXPECT_EQ(r.message, "rank 2 was killed by signal 9 (" + std::string(strsignal(SIGKILL)) + ")");
  for (pid_t pid : wait_for_pids(dir.path, {0, 1})) EXPECT_TRUE(gone(pid)) << "worker " << pid << " survived";
}

TEST(Launcher, WorkersIgnoringSigtermAreKilledAfterGrace) {
  TempDir dir;
  const milliseconds grace(300);
  const auto start = std::chrono::steady_clock::now();
  auto [r, out, err] = launch_captured({kProbe, "stubborn", dir.path.string()}, options(2, grace));
  EXPECT_GE(std::chrono::steady_clock::now() - start, grace);
  EXPECT_EQ(r.message, "rank 1 exited with status 3");
  for (pid_t pid : wait_for_pids(dir.path, {0})) EXPECT_TRUE(gone(pid)) << "worker " << pid << " survived";
}

TEST(Launcher, SigintIsForwardedAndHandlersRestored) {
  TempDir dir;
  struct sigaction before {};
  ::sigaction(SIGINT, nullptr, &before);
  // Signals the launcher once all workers are up, like a Ctrl-C would.
  std::thread interrupter([&] {
    wait_for_pids(dir.path, {0, 1});
    ::kill(::getpid(), SIGINT);
  });
  auto [r, out, err] = launch_captured({kProbe, "sleep", dir.path.string()}, options(2));
  interrupter.join();
  EXPECT_EQ(r.exit_code, 128 + SIGINT);
  EXPECT_EQ(r.failed_rank, -1);
  EXPECT_EQ(r.message, "interrupted by signal 2 (" + std::string(strsignal(SIGINT)) + "); workers stopped");
  for (pid_t pid : wait_for_pids(dir.path, {0, 1})) EXPECT_TRUE(gone(pid)) << "worker " << pid << " survived";
  struct sigaction after {};
  ::sigaction(SIGINT, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
}

TEST(Launcher, ProgramThatCannotStartThrows) {
  const std::vector<std::string> missing = {"/nonexistent/contrax_probe"}, missing_in_path = {"contrax-no-such-program"};
  CONTRAX_EXPECT_ERROR(contrax::launch(missing, options(2)),
                       "launch(): cannot start '/nonexistent/contrax_probe': No such file or directory");
  // The same through the PATH search.
  CONTRAX_EXPECT_ERROR(contrax::launch(missing_in_path, options(1)),
                       "launch(): cannot start 'contrax-no-such-program': No such file or directory");
}

// ---- option errors -------------------------------------------------------------

TEST(Launcher, EachBadOptionIsNamed) {
  const std::vector<std::string> none, empty = {""}, prog = {"true"};
  auto with = [](const std::function<void(contrax::LaunchOptions&)>& set) {
    contrax::LaunchOptions o;
    set(o);
    return o;
  };
  CONTRAX_EXPECT_ERROR(contrax::launch(none, contrax::LaunchOptions()),
                       "launch(): argument 'argv' must name a program, but got an empty list");
  CONTRAX_EXPECT_ERROR(contrax::launch(empty, contrax::LaunchOptions()),
                       "launch(): argument 'argv' must name a program, but got an empty program name");
  CONTRAX_EXPECT_ERROR(contrax::launch(prog, with([](auto& o) { o.nproc = 0; })),
                       "launch(): argument 'nproc' must be >= 1, but got 0");
  CONTRAX_EXPECT_ERROR(contrax::launch(prog, with([](auto& o) { o.nnodes = 0; })),
                       "launch(): argument 'nnodes' must be >= 1, but got 0");
  CONTRAX_EXPECT_ERROR(contrax::launch(prog, with([](auto& o) {
                         o.nnodes = 2;
                         o.node_rank = 2;
                         o.master_port = 29500;
                       })),
                       "launch(): argument 'node_rank' must be in [0, nnodes) = [0, 2), but got 2");
  CONTRAX_EXPECT_ERROR(contrax::launch(prog, with([](auto& o) { o.node_rank = -1; })),
                       "launch(): argument 'node_rank' must be in [0, nnodes) = [0, 1), but got -1");
  CONTRAX_EXPECT_ERROR(contrax::launch(prog, with([](auto& o) { o.master_port = 70000; })),
                       "launch(): argument 'master_port' must be in [0, 65535], but got 70000");
  CONTRAX_EXPECT_ERROR(contrax::launch(prog, with([](auto& o) { o.nnodes = 2; })),
                       "launch(): argument 'master_port' must be set explicitly when nnodes > 1");
  CONTRAX_EXPECT_ERROR(contrax::launch(prog, with([](auto& o) { o.master_addr = ""; })),
                       "launch(): argument 'master_addr' must not be empty");
  CONTRAX_EXPECT_ERROR(contrax::launch(prog, with([](auto& o) { o.grace = milliseconds(-1); })),
                       "launch(): argument 'grace' must be >= 0 ms, but got -1 ms");
}

// ---- helpers -------------------------------------------------------------------

TEST(Launcher, FindFreePort) {
  int64_t port = contrax::find_free_port();
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
  CONTRAX_EXPECT_ERROR(contrax::find_free_port(""), "find_free_port(): cannot resolve ''");
  // TEST-NET-1 (RFC 5737): never an address of this machine.
  CONTRAX_EXPECT_ERROR(contrax::find_free_port("192.0.2.1"), "find_free_port(): cannot bind a socket on '192.0.2.1'");
}

TEST(Launcher, InLaunchedWorkerAndSelfExecutable) {
  {
    ScopedEnv world("WORLD_SIZE", nullptr);
    EXPECT_FALSE(contrax::in_launched_worker());
  }
  {
    ScopedEnv world("WORLD_SIZE", "2");
    EXPECT_TRUE(contrax::in_launched_worker());
  }
  const fs::path self = contrax::self_executable();
  EXPECT_TRUE(self.is_absolute());
  EXPECT_EQ(self.filename().string(), "launch_tests");
}

// ---- issue 14 item 10 and issue 13 item 4: blame, whole lines, logs, restarts ----

TEST(Launcher, RankThatFailedFirstIsBlamedNotThePeerThatExitedFirst) {
  // Rank 0 fails on its own and takes 0.8 s to exit; rank 1's failure is the
  // consequence and exits at once. The exit order blames rank 1; the records
  // in CONTRAX_ERROR_FILE must blame rank 0, with its last stderr line.
  TempDir dir;
  auto [r, out, err] = launch_captured({kProbe, "blame", dir.path.string()}, options(2));
  EXPECT_EQ(r.failed_rank, 0) << r.message;
  EXPECT_EQ(r.exit_code, 4) << r.message;
  EXPECT_EQ(r.message,
            "rank 0 exited with status 4: error: cannot write '/ro/metrics.jsonl': Read-only file system "
            "(it failed first; rank 1 exited before it)");
}

TEST(Launcher, LinesOfDifferentRanksNeverInterleaveWithOrWithoutPrefix) {
  for (bool prefix : {true, false}) {
    contrax::LaunchOptions o = options(3);
    o.prefix_output = prefix;
    auto [r, out, err] = launch_captured({kProbe, "chatter"}, o);
    ASSERT_EQ(r.exit_code, 0) << r.message;
    std::istringstream lines(out);
    std::string line;
    int count = 0;
    const std::regex whole(prefix ? R"(\[rank (\d)\] rank(\d)-line\d+-([a-c])+)" : R"(()rank(\d)-line\d+-([a-c])+)");
    while (std::getline(lines, line)) {
      std::smatch m;
      ASSERT_TRUE(std::regex_match(line, m, whole)) << "torn line: '" << line << "'";
      if (prefix) EXPECT_EQ(m[1], m[2]) << line;
      EXPECT_EQ(line.back(), static_cast<char>('a' + std::stoi(m[2]))) << line;
      EXPECT_EQ(line.find_first_not_of(line.back(), line.rfind('-') + 1), std::string::npos) << line;
      ++count;
    }
    EXPECT_EQ(count, 600);
  }
}

TEST(Launcher, StoppedWorkerIsContinuedNamedAndDoesNotWaitForTheGrace) {
  // Before: a SIGSTOPped worker kept SIGTERM pending, so the launcher waited
  // the whole grace period (60 s under `contrax train`) before SIGKILL.
  TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  auto [r, out, err] = launch_captured({kProbe, "stop", dir.path.string()}, options(2, milliseconds(30000)));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, std::chrono::seconds(10));
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.message.find("rank 0 exited with status 2: collective timed out"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("rank 1 was stopped (SIGSTOP) when the job failed"), std::string::npos) << r.message;
}

TEST(Launcher, LogDirHoldsEachRanksWholeOutput) {
  TempDir dir;
  contrax::LaunchOptions o = options(2);
  o.log_dir = (dir.path / "logs" / "nested").string();
  auto [r, out, err] = launch_captured({"sh", "-c", "echo out of $RANK; echo err of $RANK >&2; printf 'tail'"}, o);
  ASSERT_EQ(r.exit_code, 0) << r.message;
  for (int k = 0; k < 2; ++k) {
    const std::string log = read_file(dir.path / "logs" / "nested" / ("rank_" + std::to_string(k) + ".log"));
    const std::string rank = std::to_string(k);
    EXPECT_NE(log.find("out of " + rank + "\n"), std::string::npos) << log;
    EXPECT_NE(log.find("err of " + rank + "\n"), std::string::npos) << log;
    EXPECT_NE(log.find("tail"), std::string::npos) << log;
    EXPECT_EQ(log.find("[rank"), std::string::npos) << "logs are unprefixed: " << log;
  }
  // Still forwarded to the terminal as well.
  EXPECT_NE(out.find("[rank 1] out of 1\n"), std::string::npos) << out;
  // A log directory that cannot be made is an error naming it.
  contrax::LaunchOptions bad = options(1);
  bad.log_dir = "/proc/contrax-no-such-dir";
  CONTRAX_EXPECT_ERROR(contrax::launch({"true"}, bad), "launch(): cannot create log directory '/proc/contrax-no-such-dir'");
}

TEST(Launcher, MaxRestartsRestartsAllWorkersAfterAFailure) {
  {
    // Without restarts the failure ends the job.
    TempDir dir;
    auto [r, out, err] = launch_captured({kProbe, "once", dir.path.string()}, options(2));
    EXPECT_EQ(r.exit_code, 3);
    EXPECT_EQ(r.restarts, 0);
  }
  TempDir dir;
  contrax::LaunchOptions o = options(2);
  o.max_restarts = 1;
  o.log_dir = (dir.path / "logs").string();
  auto [r, out, err] = launch_captured({kProbe, "once", dir.path.string()}, o);
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_EQ(r.restarts, 1);
  EXPECT_NE(err.find("launch: rank 1 exited with status 3: failing once; restarting all workers (restart 1 of 1)"),
            std::string::npos)
      << err;
  // Both ranks ran again (the restart count is in their environment), and each
  // log holds both attempts.
  EXPECT_NE(out.find("[rank 0] attempt ok on rank 0 (restart 1)"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 1] attempt ok on rank 1 (restart 1)"), std::string::npos) << out;
  const std::string log1 = read_file(dir.path / "logs" / "rank_1.log");
  EXPECT_NE(log1.find("failing once\n"), std::string::npos) << log1;
  EXPECT_NE(log1.find("restarting all workers"), std::string::npos) << log1;
  EXPECT_NE(log1.find("attempt ok on rank 1 (restart 1)"), std::string::npos) << log1;

  contrax::LaunchOptions neg = options(1);
  neg.max_restarts = -1;
  CONTRAX_EXPECT_ERROR(contrax::launch({"true"}, neg), "launch(): argument 'max_restarts' must be >= 0, but got -1");
}

TEST(Launcher, InterruptionIsNeverRestarted) {
  TempDir dir;
  contrax::LaunchOptions o = options(2, milliseconds(500));
  o.max_restarts = 3;
  std::thread interrupter([&] {
    wait_for_pids(dir.path, {0, 1});
    ::kill(::getpid(), SIGINT);
  });
  auto [r, out, err] = launch_captured({kProbe, "sleep", dir.path.string()}, o);
  interrupter.join();
  EXPECT_EQ(r.exit_code, 128 + SIGINT);
  EXPECT_EQ(r.restarts, 0);
}

TEST(Launcher, RecordWorkerFailureWritesTheFirstRecordOnly) {
  // The format the launcher reads (and launcher_probe imitates): a monotonic
  // time stamp, "origin" or "peer", then the message's first line.
  TempDir dir;
  const std::string file = (dir.path / "rank_0").string();
  {
    ScopedEnv unset("CONTRAX_ERROR_FILE", nullptr);
    contrax::record_worker_failure(false, "ignored without a launcher");
  }
  EXPECT_FALSE(fs::exists(file));
  ScopedEnv env("CONTRAX_ERROR_FILE", file.c_str());
  contrax::record_worker_failure(true, "collective failed\nbacktrace line");
  contrax::record_worker_failure(false, "later: must not replace the first");
  const std::string text = read_file(file);
  EXPECT_TRUE(std::regex_match(text, std::regex("[0-9]+ peer\ncollective failed\n"))) << text;
}

// ---- the command-line tool -------------------------------------------------------

TEST(LaunchCli, RunsWorkersWithoutPrefix) {
  CliRun r = run_cli({"launch", "--nproc", "2", "--no-prefix", "--", "sh", "-c", "echo r$RANK/$WORLD_SIZE"});
  ASSERT_TRUE(WIFEXITED(r.status)) << r.err;
  EXPECT_EQ(WEXITSTATUS(r.status), 0) << r.err;
  EXPECT_NE(r.out.find("r0/2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("r1/2\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << r.out;
}

TEST(LaunchCli, ReportsFailedRankAndExitsWithItsStatus) {
  TempDir dir;
  CliRun r = run_cli({"launch", "--nproc", "2", "--grace-ms", "500", "--", kProbe, "fail", dir.path.string()});
  ASSERT_TRUE(WIFEXITED(r.status)) << r.err;
  EXPECT_EQ(WEXITSTATUS(r.status), 3);
  EXPECT_NE(r.err.find("contrax launch: rank 1 exited with status 3\n"), std::string::npos) << r.err;
  for (pid_t pid : wait_for_pids(dir.path, {0})) EXPECT_TRUE(gone(pid)) << "worker " << pid << " survived";
}

TEST(LaunchCli, SigtermStopsAllWorkers) {
  TempDir dir;
  pid_t cli = spawn_cli({"launch", "--nproc", "2", "--grace-ms", "500", "--", kProbe, "sleep", dir.path.string()},
                        dir.path);
  std::vector<pid_t> workers = wait_for_pids(dir.path, {0, 1});
  ::kill(cli, SIGTERM);
  int status = wait_cli(cli);
  ASSERT_TRUE(WIFEXITED(status)) << "the launcher must survive SIGTERM to stop its workers";
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  const std::string err = read_file(dir.path / "cli.err");
  EXPECT_NE(err.find("contrax launch: interrupted by signal 15"), std::string::npos) << err;
  for (pid_t pid : workers) EXPECT_TRUE(gone(pid)) << "worker " << pid << " survived";
}

TEST(LaunchCli, UnknownFlagIsAnError) {
  CliRun r = run_cli({"launch", "--nproc", "1", "--bogus", "1", "--", "true"});
  ASSERT_TRUE(WIFEXITED(r.status));
  EXPECT_NE(WEXITSTATUS(r.status), 0);
  EXPECT_NE(r.err.find("unknown flag '--bogus'"), std::string::npos) << r.err;
}

TEST(LaunchCli, MissingProgramAndBadOptionsAreErrors) {
  CliRun none = run_cli({"launch", "--nproc", "2"});
  ASSERT_TRUE(WIFEXITED(none.status));
  EXPECT_NE(WEXITSTATUS(none.status), 0);
  EXPECT_NE(none.err.find("contrax launch: error: no PROGRAM given"), std::string::npos) << none.err;

  CliRun bad = run_cli({"launch", "--nproc", "0", "--", "true"});
  ASSERT_TRUE(WIFEXITED(bad.status));
  EXPECT_NE(WEXITSTATUS(bad.status), 0);
  EXPECT_EQ(WEXITSTATUS(bad.status), 2) << "a usage error";
  EXPECT_NE(bad.err.find("contrax launch: error: flag '--nproc' must be >= 1, but got 0"), std::string::npos)
      << bad.err;
}

}  // namespace
