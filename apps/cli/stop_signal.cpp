// SIGINT and SIGTERM in the `contrax` tool (see stop_signal.h).
#include "cli/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace contrax::cli {

namespace {

volatile sig_atomic_t g_request_stop = 0;  // OnSignal::kRequestStop
volatile sig_atomic_t g_noted = 0;          // the signal noted while deferred

// The lines, built before any signal can arrive: the handler may only call
// async-signal-safe functions (write, signal, raise), not format text.
constexpr int kSignals[] = {SIGINT, SIGTERM};
char g_line[2][160];
size_t g_length[2] = {0, 0};

extern "C" void on_stop_signal(int sig) {
  if (g_request_stop != 0) {
    g_noted = sig;
    return;
  }
  end_by_signal(sig);
}

}  // namespace

void install_stop_signals(const std::string& command) {
  // Quiet under Contrax's launcher, which reports the job's interruption once.
  const char* launched = std::getenv("CONTRAX_ERROR_FILE");
  const bool quiet = launched != nullptr && *launched != '\0';
  const char* rank = std::getenv("RANK");
  const std::string who = "contrax " + command + (rank != nullptr && *rank != '\0' ? std::string(": rank ") + rank : "");
  for (size_t i = 0; i < 2; ++i) {
    const std::string line = quiet ? "" : who + ": stopped by signal " + std::to_string(kSignals[i]) + " (" +
                                              ::strsignal(kSignals[i]) + ")\n";
    const size_t n = std::min(line.size(), sizeof g_line[i]);
    std::memcpy(g_line[i], line.data(), n);
    g_length[i] = n;
  }
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : kSignals) ::sigaction(sig, &sa, nullptr);
}

void stop_signals(OnSignal what) {
  g_request_stop = what == OnSignal::kRequestStop ? 1 : 0;
  if (what == OnSignal::kEndAtOnce && g_noted != 0) end_by_signal(g_noted);
}

int stop_signal() { return g_noted; }

void end_by_signal(int sig) {
  const size_t i = sig == SIGINT ? 0 : 1;
  if (g_length[i] > 0) {
    ssize_t ignored = ::write(STDERR_FILENO, g_line[i], g_length[i]);
    (void)ignored;
  }
  // The default action, so that the parent sees "killed by signal N" (a
  // shell: status 128 + N), as for any program that does not catch it;
  // unblocked, as it is inside its own handler. (All async-signal-safe.)
  ::signal(sig, SIG_DFL);
  sigset_t block;
  sigemptyset(&block);
  sigaddset(&block, sig);
  ::sigprocmask(SIG_UNBLOCK, &block, nullptr);
  ::raise(sig);
  ::_exit(128 + sig);  // not reached
}

}  // namespace contrax::cli
