// The typed flags of the `contrax` tool and the parse that reports their
// mistakes as usage errors (flags.h).
#include "cli/flags.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "cli/build_info.h"

namespace contrax::cli {

void setup_app(CLI::App& app) {
  // Every option's default is shown by --help and written by --dump-config,
  // so a dumped file is a complete record of the settings.
  app.option_defaults()->always_capture_default();
  // A flag given twice takes its last value (a script appending an override),
  // as in most tools; CLI11 would refuse it.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_help_flag("-h,--help", "print this help and exit")->configurable(false);
  app.set_version_flag("--version", version_string, "print the version, LibTorch and BLAS and exit");
  app.set_config("--config", "", "read flags from this TOML or INI file (see --dump-config); flags given too win");
  // (description set apart: with C++20 LibTorch, CLI11 2.3 finds add_flag(name, text) ambiguous)
  app.add_flag("--dump-config")->description("print every setting as a TOML file for --config and exit")->configurable(false);
  app.get_formatter()->column_width(34);
}

namespace {

bool is_help(const std::string& a) { return a == "-h" || a == "--help"; }

// The name errors use: the first of "--nproc,--nproc-per-node".
std::string flag_of(const std::string& names) {
  const std::string name = names.substr(0, names.find(','));
  return name.rfind("--", 0) == 0 ? name : "--" + name;
}

// Strict base-10 int64: the whole text, no overflow, no "1e3" or "12abc".
bool parse_int64(const std::string& s, int64_t& out) {
  const char* b = s.data();
  const char* e = b + s.size();
  if (b != e && *b == '+') ++b;
  auto [p, ec] = std::from_chars(b, e, out);
  return ec == std::errc() && p == e && b != e;
}

std::string fmt_double(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

}  // namespace

int parse(CLI::App& app, const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--") break;
    if (is_help(a)) {
      std::cout << app.help();
      return 0;
    }
  }
  return parse(app, args, [&app](bool) -> CLI::App& { return app; });
}

namespace {

// A flag that takes a value but is given none ("--lr" last or before
// another flag, "--lr="), named, with what it takes: CLI11 would say "--lr:
// 1 required  missing" or, taking the next flag's value for it, "The
// following argument was not expected: 1". "" when every flag has its value.
std::string missing_value(const CLI::App& app, const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size() && args[i] != "--"; ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) continue;
    const auto eq = a.find('=');
    const CLI::Option* o = app.get_option_no_throw(a.substr(0, eq));
    if (o == nullptr || o->get_expected_min() < 1) continue;
    const std::string flag = a.substr(0, eq), type = o->get_type_name();
    const std::string takes = type.rfind("INT", 0) == 0 ? " (an integer)"
                              : type.rfind("FLOAT", 0) == 0 || type.rfind("NUMBER", 0) == 0 ? " (a number)"
                                                                                           : "";
    if (eq != std::string::npos) {
      if (eq + 1 == a.size()) return "flag '" + flag + "' needs a value" + takes + ", but got none after '='";
      continue;
    }
    const bool last = i + 1 == args.size() || args[i + 1] == "--";
    double number = 0;
    const bool next_is_flag = !last && args[i + 1].size() > 1 && args[i + 1][0] == '-' &&
                              !(std::istringstream(args[i + 1]) >> number);
    if (last) return "flag '" + flag + "' needs a value" + takes + ", but got none";
    if (next_is_flag) {
      return "flag '" + flag + "' needs a value" + takes + ", but is followed by flag '" + args[i + 1] + "'";
    }
  }
  return "";
}

}  // namespace

int parse(CLI::App& app, const std::vector<std::string>& args, const std::function<CLI::App&(bool help)>& resolve) {
  const auto usage_message = [&app](const std::string& what) {
    std::cerr << "contrax " << app.get_name() << ": error: " << what << " (see contrax " << app.get_name()
              << " --help)\n";
    return 2;
  };
  const auto usage_error = [&](const CLI::ParseError& e) { return usage_message(e.what()); };
  if (const std::string m = missing_value(app, args); !m.empty()) {
    bool help = false;
    for (const auto& a : args) help = help || is_help(a);
    if (!help) return usage_message(m);
  }
  // CLI11 reports --help after the whole command line, unless a mistake
  // stops it first; either way the help is what was asked for.
  bool help = false;
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last first
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    help = app.get_help_ptr() != nullptr && app.get_help_ptr()->count() > 0;
    if (!help && e.get_exit_code() == 0) return app.exit(e);  // --version
    if (!help) return usage_error(e);
  }
  try {
    CLI::App& bound = resolve(help);
    if (help) {
      std::cout << bound.help();
      return 0;
    }
    if (app.count("--dump-config") > 0) {
      std::cout << bound.config_to_str(true, true);
      return 0;
    }
  } catch (const CLI::ParseError& e) {
    return usage_error(e);
  }
  return -1;
}

void add_unbound_flags(const CLI::App& from, CLI::App& into) {
  for (const CLI::Option* o : from.get_options()) {
    if (o->get_lnames().empty() || into.get_option_no_throw("--" + o->get_lnames()[0]) != nullptr) continue;
    const std::string names = o->get_name(false, true);
    CLI::Option* u = o->get_expected_max() == 0  // a flag
                         ? into.add_flag(names)
                         : into.add_option(names)->expected(o->get_expected_min(), o->get_expected_max());
    u->configurable(o->get_configurable());
  }
}

CLI::Option* add_int(CLI::App& app, const std::string& name, int64_t& value, const std::string& help, int64_t lo,
                     int64_t hi) {
  const std::string flag = flag_of(name);
  auto* opt = app.add_option(name, value, help);
  opt->check(CLI::Validator(
      [flag, lo, hi](std::string& text) -> std::string {
        int64_t v = 0;
        if (!parse_int64(text, v)) {
          // Digits that overflow int64 get the range; anything else the type.
          const bool digits = !text.empty() && text.find_first_not_of("+-0123456789") == std::string::npos;
          throw UsageError(c10::str("flag '", flag, "' must be an integer",
                                    digits ? c10::str(" in [", lo, ", ", hi, "]") : std::string(), ", but got '",
                                    text, "'"));
        }
        usage_check(v >= lo, "flag '", flag, "' must be >= ", lo, ", but got ", v);
        usage_check(v <= hi, "flag '", flag, "' must be <= ", hi, ", but got ", v);
        return std::string();
      },
      lo > std::numeric_limits<int64_t>::min() ? c10::str("INT>=", lo) : std::string("INT")));
  return opt;
}

CLI::Option* add_double(CLI::App& app, const std::string& name, double& value, const std::string& help, double lo,
                        double hi, bool lo_open) {
  const std::string flag = flag_of(name);
  auto* opt = app.add_option(name, value, help);
  opt->check(CLI::Validator(
      [flag, lo, hi, lo_open](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(text.c_str(), &end);
        usage_check(!text.empty() && end == text.c_str() + text.size(), "flag '", flag,
                    "' must be a number, but got '", text, "'");
        usage_check(std::isfinite(v) && errno != ERANGE, "flag '", flag, "' must be a finite number, but got '", text,
                    "'");
        usage_check(lo_open ? v > lo : v >= lo, "flag '", flag, "' must be ", lo_open ? "> " : ">= ", fmt_double(lo),
                    ", but got ", text);
        usage_check(v <= hi, "flag '", flag, "' must be <= ", fmt_double(hi), ", but got ", text);
        return std::string();
      },
      "NUMBER"));
  return opt;
}

CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& value, const std::string& help,
                        const std::vector<std::string>& choices) {
  const std::string flag = flag_of(name);
  std::string list;
  for (size_t i = 0; i < choices.size(); ++i) {
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  }
  auto* opt = app.add_option(name, value, help);
  opt->check(CLI::Validator(
      [flag, choices, list](std::string& text) -> std::string {
        usage_check(std::find(choices.begin(), choices.end(), text) != choices.end(), "flag '", flag, "' must be ",
                    list, ", but got '", text, "'");
        return std::string();
      },
      "{" + list + "}"));
  return opt;
}

std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    int64_t v = 0;
    usage_check(parse_int64(item, v), "flag '", flag, "' must be comma-separated integers, but got '", text, "'");
    usage_check(v >= lo && v <= hi, "flag '", flag, "': every entry must be in [", lo, ", ", hi, "], but got ", v);
    out.push_back(v);
  }
  return out;
}

}  // namespace contrax::cli
