// Runs the `contrax` tool as a child process and captures what it prints, for
// tests of the command line (exit status, messages, time taken).
#pragma once

#include <string>

namespace contrax::testing {

struct CliRun {
  int status = -1;      // exit status; -1 when the tool did not exit normally
  std::string out;      // stdout and stderr, interleaved
  double seconds = 0;   // wall time of the run
  double cpu_seconds = 0;  // user + system CPU time of the run (all its processes)
};

/// Any shell command line (e.g. with an environment prefix or `ulimit`);
/// captures what it writes to stdout (add `2>&1` for stderr too).
CliRun run_shell(const std::string& cmd);

/// `contrax train` for a few steps on a small subset, without the evaluation,
/// the exactness check or the plot: a second or two on one core. The tests of
/// train's flags add theirs after it.
inline const std::string kTinyTrain =
    "train --nproc 1 --threads 1 --train-limit 256 --batch-size 64 --max-steps 3 --warmup-steps 1 --log-every 1 "
    "--no-eval --no-verify --no-plot";

/// The tool's path (the build's `contrax`).
inline const std::string kCli = CONTRAX_CLI_PATH;

/// `contrax train`'s flags for short multi-process runs of the fault tests:
/// a small subset, one thread a rank, no evaluation or exactness check.
inline const std::string kFastTrain =
    "--train-limit 512 --batch-size 64 --warmup-steps 2 --no-eval --no-verify --log-every 1 --threads 1";

/// `contrax ARGS 2>&1` (ARGS is passed to the shell as it is).
CliRun run_cli(const std::string& args);

/// The same, with DIR as the working directory.
CliRun run_cli_in(const std::string& dir, const std::string& args);

/// `contrax ARGS` with stdout only (stderr discarded), e.g. for --json or --dump-config.
CliRun run_cli_stdout(const std::string& args);

/// Expects `run` to have exited with `status` and printed `text`.
void expect_exit(const CliRun& run, int status, const std::string& text);

/// Whether Debian's dataset-fashion-mnist (the tool's default --data) is installed.
bool have_fashion_mnist();

/// Skips the test, saying why, where the data set is missing.
#define CONTRAX_REQUIRE_FASHION_MNIST()          \
  if (!contrax::testing::have_fashion_mnist()) \
  GTEST_SKIP() << "dataset-fashion-mnist is not installed"

/// The bytes of a file ("" when it cannot be read).
std::string read_file(const std::string& path);

}  // namespace contrax::testing
