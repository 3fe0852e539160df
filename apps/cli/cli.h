// The subcommands of the `contrax` tool and how a usage error ends one. Each
// apps/*/cmd_*.cpp registers its subcommand with a static `Command` object, so
// adding one touches no other file; main.cpp dispatches to it, and reports a
// UsageError with exit status 2 (flags.h: the typed flags that throw it).
//
//   int run_hello(const std::vector<std::string>& args);
//   contrax::cli::Command hello_cmd("hello", "say hello", run_hello);
#pragma once

#include <c10/util/StringUtil.h>

#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace contrax::cli {

using CommandFn = std::function<int(const std::vector<std::string>& args)>;

struct CommandInfo {
  std::string summary;
  CommandFn run;
};

/// Every subcommand by name (main() dispatches through it, and lists it in
/// order for `contrax --help`).
inline std::map<std::string, CommandInfo>& registry() {
  static std::map<std::string, CommandInfo> commands;
  return commands;
}

/// Registers a subcommand; one static object per apps/*/cmd_*.cpp.
struct Command {
  Command(const std::string& name, const std::string& summary, CommandFn fn) {
    registry()[name] = CommandInfo{summary, std::move(fn)};
  }
};

/// A mistake in the command line (bad flag value, stray word, refused run
/// directory). main() prints "contrax CMD: error: MESSAGE" and exits with 2,
/// the usual status of a usage error; other errors exit with 1.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Throws UsageError with the concatenated message unless `cond` holds.
template <typename... Args>
void usage_check(bool cond, const Args&... message) {
  if (!cond) throw UsageError(c10::str(message...));
}

}  // namespace contrax::cli
