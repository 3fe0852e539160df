// Subcommand registry and flag helpers of the `contrax` tool. Each
// apps/cmd_*.cpp registers its subcommand with a static `Command` object, so
// adding one touches no other file.
//
// Flags go through CLI11. The helpers below add typed flags whose values are
// checked while parsing (integer syntax, overflow, range), so that every
// usage error names the flag and what was expected and ends the tool with
// exit status 2, before anything starts. Usage:
//
//   CLI::App app{"check ...", "verify"};
//   contrax::cli::setup_app(app);
//   int64_t nproc = 4;
//   contrax::cli::add_int(app, "--nproc", nproc, "local processes", 1, contrax::cli::max_procs());
//   if (int st = contrax::cli::parse(app, args); st >= 0) return st;  // --help, --dump-config, errors
#pragma once

#include <CLI/CLI.hpp>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <functional>
#include <limits>
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

std::map<std::string, CommandInfo>& registry();

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

/// Sets up the app of a subcommand: --help, --version, --config FILE
/// (TOML/INI) and --dump-config, defaults captured so that --help and
/// --dump-config show them.
void setup_app(CLI::App& app);

/// Parses `args` (argv after the subcommand). Returns -1 when the command
/// should run, otherwise the status to exit with: 0 after --help, --version or
/// --dump-config (printed here), 2 after a usage error (printed to stderr).
/// `-h`/`--help` anywhere before a `--` wins over everything else, so a help
/// request never starts anything even next to a bad value.
int parse(CLI::App& app, const std::vector<std::string>& args);

/// The same for a command whose flags depend on what its command line says
/// (`contrax train`'s recipe): `app` knows every flag by name, unbound, and
/// parses `args`, once; then `resolve(help)` returns the app whose flags are
/// bound, with the values given applied (unless `help`: --help was given),
/// and whose --help or --dump-config is printed. A help request wins over a
/// mistake in `args`; `resolve`'s UsageError and CLI11 errors are usage
/// errors too.
int parse(CLI::App& app, const std::vector<std::string>& args, const std::function<CLI::App&(bool help)>& resolve);

/// The flags of `from` added to `into` by name and arity, unbound and
/// unchecked, where `into` has none of that name: what a command line is
/// parsed into (parse with a resolve step) before the app that gives the
/// flags their defaults and checks is known.
void add_unbound_flags(const CLI::App& from, CLI::App& into);

/// Integer flag in [lo, hi]; errors: "flag '--x' must be an integer, but got
/// 'v'", "... must be >= lo, but got v", "... must be <= hi, but got v".
CLI::Option* add_int(CLI::App& app, const std::string& name, int64_t& value, const std::string& help,
                     int64_t lo = std::numeric_limits<int64_t>::min(),
                     int64_t hi = std::numeric_limits<int64_t>::max());

/// Finite floating-point flag; `lo_open`: the value must be > lo (else >= lo).
CLI::Option* add_double(CLI::App& app, const std::string& name, double& value, const std::string& help,
                        double lo = -std::numeric_limits<double>::max(),
                        double hi = std::numeric_limits<double>::max(), bool lo_open = false);

/// String flag limited to `choices`: "flag '--x' must be a or b, but got 'c'".
CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& value, const std::string& help,
                        const std::vector<std::string>& choices);

/// `--device`, cpu or cuda; `help` says what runs where.
inline CLI::Option* add_device(CLI::App& app, std::string& value, const std::string& help) {
  return add_choice(app, "--device", value, help, {"cpu", "cuda"});
}

/// Comma-separated integers ("1024,4096"), each in [lo, hi]; the option keeps
/// the text (so --dump-config writes it back) and `parse_int_list` reads it.
std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& text, int64_t lo, int64_t hi);

/// Why `--device cuda` cannot run here, or "" when it can.
std::string cuda_unavailable_reason();

/// The checks of `--device cuda` before any process starts (UsageError): a
/// usable GPU when `device` is "cuda"; and when `one_gpu_per_rank` names why
/// each rank needs a GPU of its own (NCCL: "flag '--backend' is 'nccl'"), at
/// most one of the `nproc` processes per GPU, `hint` ending that message.
void check_cuda_device(const std::string& device, int64_t nproc, const std::string& one_gpu_per_rank = "",
                       const std::string& hint = "");

/// Processes or threads a flag may ask for without --force: a small multiple of
/// the cores (oversubscribing more than that only thrashes, and a typo such as
/// --nproc 1000 would fork a thousand processes).
int64_t max_procs();
constexpr int64_t kMaxProcsPerCore = 8;

/// `--force`, and its check: UsageError "flag 'FLAG' must be <= N (K per core;
/// --force allows more), but got n" unless `force` or `n` <= max_procs().
CLI::Option* add_force(CLI::App& app, bool& force);
void check_procs(const std::string& flag, int64_t n, bool force);

/// Intra-op threads per process that not even --force allows: a multiple of
/// the cores. OpenMP starts its whole team at the first parallel region and
/// cannot fail politely: `--force --threads 100000` hung silently (and ignored
/// SIGTERM) while the kernel created the threads.
int64_t max_threads();
constexpr int64_t kMaxThreadsPerCore = 64;

/// The BLAS library this process actually mapped (Debian picks it through
/// alternatives; benchmarks print it because it changes GEMM speed ~30x).
std::string blas_library();

/// "contrax 0.1.0, LibTorch 1.13.1, BLAS /usr/lib/..., N threads".
std::string version_string();

/// "12.3 MiB": a byte count as the benchmarks print it.
std::string mib(int64_t bytes);

}  // namespace contrax::cli
