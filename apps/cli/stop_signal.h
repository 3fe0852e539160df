// SIGINT and SIGTERM in the `contrax` tool. main() installs the handlers
// first thing, for every command: a signal ends the process at once, with one
// line on stderr and then by the signal itself (status 128 + N in a shell),
// so that a process waiting in the rendezvous, the store, a collective or a
// data load never outwaits --timeout or a launcher's grace period. A
// training loop defers them while it runs: a signal is then a request, and
// the loop stops at the next step boundary with a checkpoint.
//
//   contrax::cli::install_stop_signals("train");          // main()
//   contrax::cli::stop_signals(cli::OnSignal::kRequestStop);  // the loop's first stop check
//   if (contrax::cli::stop_signal() != 0) ...             // asked to stop
//   contrax::cli::stop_signals(cli::OnSignal::kEndAtOnce);    // the loop is over
//
// A worker started by Contrax's launcher (CONTRAX_ERROR_FILE set) ends
// without the line: its launcher reports the interruption once for the job.
#pragma once

#include <string>

namespace contrax::cli {

enum class OnSignal {
  kEndAtOnce,    // nothing to save: end now (the default)
  kRequestStop,  // a loop is running: note the signal for stop_signal()
};

/// Handlers for SIGINT and SIGTERM, ending at once; `command` names the line
/// ("contrax train: rank 1: stopped by signal 15 (Terminated)").
void install_stop_signals(const std::string& command);

/// Switches what a signal does. Switching to kEndAtOnce with a signal already
/// noted ends the process then.
void stop_signals(OnSignal what);

/// The signal noted while deferred, or 0.
int stop_signal();

/// Ends the process as a signal does in kEndAtOnce (the line, then the signal).
[[noreturn]] void end_by_signal(int sig);

}  // namespace contrax::cli
