// Entry point of the `contrax` tool: dispatches to the registered subcommands,
// and the flag helpers they share (CLI11 with range-checked typed values).
#include <ATen/Version.h>
#include <malloc.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "cli.h"
#include "train_threads.h"
#include "contrax/launch/launcher.h"
#include "stop_signal.h"

namespace contrax::cli {

std::map<std::string, CommandInfo>& registry() {
  static std::map<std::string, CommandInfo> commands;
  return commands;
}

std::string blas_library() {
  // The CPU BLAS LibTorch was built with (its build settings' BLAS_INFO:
  // "mkl", linked into libtorch_cpu in PyPI's wheels; "open" or "flexi" in
  // Debian's) and, where it is a shared library, the one loaded. CUDA's
  // cuBLAS is not the CPU BLAS.
  const std::string config = at::show_config(), key = "BLAS_INFO=";
  std::string kind = "unknown";
  if (auto p = config.find(key); p != std::string::npos) {
    p += key.size();
    kind = config.substr(p, config.find_first_of(", \n", p) - p);
  }
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    auto pos = line.find('/');
    if (pos == std::string::npos) continue;
    std::string path = line.substr(pos);
    const auto name = path.substr(path.rfind('/') + 1);
    if ((name.find("blas") != std::string::npos || name.find("mkl") != std::string::npos) &&
        name.find("cublas") == std::string::npos) {
      return kind + " (" + path + ")";
    }
  }
  return kind == "mkl" ? "mkl (linked into LibTorch)" : kind;
}

std::string version_string() {
  std::ostringstream o;
  o << "contrax " << CONTRAX_VERSION << ", LibTorch " << TORCH_VERSION << ", BLAS " << blas_library() << ", "
    << at::get_num_threads() << " intra-op thread" << (at::get_num_threads() == 1 ? "" : "s") << " by default, "
    << std::thread::hardware_concurrency() << " cores";
  return o.str();
}

std::string mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

std::string cuda_unavailable_reason() {
  if (torch::cuda::is_available()) return "";
  if (!at::Context::hasCUDART()) return "this LibTorch was built without CUDA (a CPU-only build)";
  return "no CUDA device is visible (torch::cuda::is_available() is false: no GPU, no driver, or "
         "CUDA_VISIBLE_DEVICES hides them)";
}

void check_cuda_device(const std::string& device, int64_t nproc, const std::string& one_gpu_per_rank,
                       const std::string& hint) {
  if (device == "cuda") {
    const std::string why = cuda_unavailable_reason();
    usage_check(why.empty(), "flag '--device' is 'cuda', but ", why, "; use --device cpu");
  }
  if (!one_gpu_per_rank.empty() && !in_launched_worker()) {
    // NCCL refuses two ranks on one GPU; say so before any process starts.
    const auto gpus = static_cast<int64_t>(torch::cuda::device_count());
    usage_check(nproc <= gpus, one_gpu_per_rank, ", which needs one GPU per rank, but --nproc is ", nproc,
                " and this machine has ", gpus, " GPU", gpus == 1 ? "" : "s", hint);
  }
}

int64_t max_procs() { return kMaxProcsPerCore * std::max<int64_t>(1, std::thread::hardware_concurrency()); }

CLI::Option* add_force(CLI::App& app, bool& force) {
  return app.add_flag("--force", force, "allow --nproc above " + std::to_string(max_procs()) + " (" +
                                            std::to_string(kMaxProcsPerCore) + " per core)");
}

void check_procs(const std::string& flag, int64_t n, bool force) {
  usage_check(force || n <= max_procs(), "flag '", flag, "' must be <= ", max_procs(), " (", kMaxProcsPerCore,
              " per core; --force allows more), but got ", n);
}

int64_t max_threads() { return kMaxThreadsPerCore * std::max<int64_t>(1, std::thread::hardware_concurrency()); }

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

namespace {

// Keeps the heap between steps: glibc's defaults unmap each step's ~40 MB of
// freed tensors (above the mmap threshold) and trim the heap's top (above
// 128 KiB free), so the next step page-faults it all in again, a quarter of a
// training step's time on 2 cores. Big blocks stay in the heap; the footprint
// is the peak, as with PyTorch's caching allocator. Set before any allocation
// of size; skipped when GLIBC_TUNABLES is given (mallopt would override it).
void keep_heap() {
  if (std::getenv("GLIBC_TUNABLES") != nullptr) return;
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace

namespace {

// Runs `cmd`; an error becomes its message on stderr and the exit status (2
// for a usage error, else 1), and, for a launcher's worker, its failure
// record (the first record counts: a failure caused by a peer, recorded
// when the collective failed, stays so).
int run_command(const contrax::cli::CommandInfo& command, const std::string& cmd,
                const std::vector<std::string>& args) {
  using namespace contrax::cli;
  std::string message;
  int status = 1;
  try {
    return command.run(args);
  } catch (const UsageError& e) {
    message = e.what() + std::string(" (see contrax ") + cmd + " --help)";
    status = 2;
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  } catch (const std::system_error& e) {
    // A thread that could not start, wherever: said with the tasks limit,
    // not as a bare "Resource temporarily unavailable".
    const bool threads = e.code() == std::errc::resource_unavailable_try_again;
    message = threads ? threads_failed_message(std::string("a thread could not be started: ") + e.what()) : e.what();
  } catch (const std::exception& e) {
    message = e.what();
  }
  const std::string line = "contrax " + cmd + ": error: " + message;
  std::cerr << line << "\n";
  contrax::record_worker_failure(/*caused_by_peer=*/false, line);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  keep_heap();
  using namespace contrax::cli;
  auto usage = [] {
    std::cout << "usage: contrax COMMAND [flags]   (contrax COMMAND --help for its flags)\n\ncommands:\n";
    for (const auto& [name, info] : registry()) std::cout << "  " << name << "  " << info.summary << "\n";
    std::cout << "\n  --version  print the version, LibTorch and BLAS\n";
  };
  if (argc < 2) {
    usage();
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h") {
    usage();
    return 0;
  }
  if (cmd == "--version") {
    std::cout << version_string() << "\n";
    return 0;
  }
  auto it = registry().find(cmd);
  if (it == registry().end()) {
    std::cerr << "contrax: unknown command '" << cmd << "'\n";
    usage();
    return 2;
  }
  install_stop_signals(cmd);
  std::vector<std::string> args(argv + 2, argv + argc);
  const int status = run_command(it->second, cmd, args);
  if (status != 0 && contrax::in_launched_worker()) {
    // A failed worker ends here, without the exit handlers: after a peer or
    // its own threads failed, c10d's and PyTorch's teardown of a broken
    // process group can crash (SIGSEGV seen at exit after 'Connection closed
    // by peer'), and the launcher would then report the crash, not the
    // error just printed. Its record and its output are out already.
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
    ::_exit(status);
  }
  return status;
}
