// The flags of the `contrax` tool's subcommands: CLI11, with typed flags whose
// values are checked while parsing (integer syntax, overflow, range), so that
// every usage error names the flag and what was expected and ends the tool
// with exit status 2 (a UsageError, cli.h), before anything starts. Usage:
//
//   CLI::App app{"check ...", "verify"};
//   contrax::cli::setup_app(app);
//   int64_t nproc = 4;
//   contrax::cli::add_int(app, "--nproc", nproc, "local processes", 1, contrax::cli::max_procs());
//   if (int st = contrax::cli::parse(app, args); st >= 0) return st;  // --help, --dump-config, errors
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cli/cli.h"

namespace contrax::cli {

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

}  // namespace contrax::cli
