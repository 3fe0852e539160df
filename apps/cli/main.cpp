// Entry point of the `contrax` tool: dispatches to the subcommand registered
// under its first word (cli.h), and turns what the subcommand throws into its
// message and exit status.
#include <malloc.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <system_error>

#include <unistd.h>

#include "cli/build_info.h"
#include "cli/cli.h"
#include "cli/stop_signal.h"
#include "contrax/launch/launcher.h"
#include "train/train_threads.h"

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
