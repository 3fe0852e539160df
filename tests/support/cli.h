// Runs the `contrax` tool as a child process and captures what it prints, for
// tests of the command line (exit status and messages).
#pragma once

#include <string>

namespace contrax::testing {

struct CliRun {
  int status = -1;  // exit status; -1 when the tool did not exit normally
  std::string out;  // stdout and stderr, interleaved
};

/// `contrax ARGS 2>&1` (ARGS is passed to the shell as it is).
CliRun run_cli(const std::string& args);

}  // namespace contrax::testing
