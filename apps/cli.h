// Subcommand registry of the `contrax` tool. Each apps/cmd_*.cpp registers its
// subcommand with a static `Command` object, so adding one touches no other file.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace contrax::cli {

using CommandFn = std::function<int(const std::vector<std::string>& args)>;

struct CommandInfo {
  std::string summary;
  CommandFn run;
};

std::map<std::string, CommandInfo>& registry();

struct Command {
  Command(const std::string& name, const std::string& summary, CommandFn fn) {
    registry()[name] = CommandInfo{summary, std::move(fn)};
  }
};

/// Minimal flag parsing shared by the subcommands: "--name value", "--name=value"
/// and boolean "--flag". Unknown flags are an error naming the flag.
class Args {
 public:
  Args(std::string command, const std::vector<std::string>& args);
  /// Declares and reads a flag; `help` is shown by --help.
  std::string get(const std::string& name, const std::string& def, const std::string& help);
  int64_t get_int(const std::string& name, int64_t def, const std::string& help);
  double get_double(const std::string& name, double def, const std::string& help);
  bool flag(const std::string& name, const std::string& help);
  /// Comma-separated integers ("1024,4096"); "" gives an empty list.
  std::vector<int64_t> get_int_list(const std::string& name, const std::string& def, const std::string& help);
  /// Arguments after "--" (or the first non-flag), for `launch`.
  const std::vector<std::string>& rest() const { return rest_; }
  /// Call after all get()s: throws on unknown flags; returns true if --help was
  /// given (the usage has been printed and the command should return 0).
  bool finish();

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> order_, rest_, help_lines_;
  std::map<std::string, bool> used_;
  bool help_ = false;
};

/// The BLAS library this process actually mapped (Debian picks it through
/// alternatives; benchmarks print it because it changes GEMM speed ~30x).
std::string blas_library();

}  // namespace contrax::cli
