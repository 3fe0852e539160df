// One attempt of a launch: the supervisor loop that owns the workers. It
// starts them (launch/spawn.h), pumps their output (launch/output.h), reaps
// them, and on the first failure or on SIGINT/SIGTERM (launch/signals.h)
// stops the rest with SIGTERM, then SIGKILL after the grace period; the
// result names the rank to blame (launch/diagnosis.h). Everything it holds is
// released in its destructor whichever way the launch leaves: no worker
// outlives it, no descriptor leaks, and the caller's signal dispositions come
// back. Internal to the launcher (src/launch/), not installed.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <c10/macros/Macros.h>

#include "contrax/launch/launcher.h"
#include "launch/out_of_memory.h"
#include "launch/output.h"
#include "launch/signals.h"
#include "launch/worker.h"

namespace contrax::detail {

class Supervisor {
 public:
  /// Takes the signals over (one launch at a time per process).
  explicit Supervisor(const LaunchOptions& options);
  ~Supervisor();
  C10_DISABLE_COPY_AND_ASSIGN(Supervisor);

  /// Starts one worker; returns the errno of a failed exec, 0 on success.
  int start(const std::vector<std::string>& argv, int64_t rank, const std::vector<std::string>& env,
            const std::string& log_path, const std::string& error_file);

  /// Supervises the started workers until all have ended.
  LaunchResult supervise();

  /// Ended by SIGINT/SIGTERM rather than by a failure (never restarted).
  bool interrupted() const { return interrupted_by_ != 0 && failed_ == nullptr; }

 private:
  bool any_running() const;
  void wait_blocking(Worker& w);
  void signal_all(int sig);
  void begin_stop(int sig);
  // SIGTERMs the deferred workers still running (their deadline passed).
  void end_deferral();
  void handle_signal(int sig);
  void reap();

  std::chrono::milliseconds grace_;
  OutputOptions output_;
  std::vector<Worker> workers_;
  OomWatch oom_;  // the out-of-memory killer's counters when the attempt began
  SignalPipe signals_;
  bool stopping_ = false, killed_ = false;
  std::chrono::steady_clock::time_point kill_deadline_;
  // Workers that had recorded a failure of their own when the job began to
  // stop are exiting already, with a status of their own (2 for a usage
  // error): they are left to exit until this deadline, not SIGTERMed, so that
  // the launcher reports that status rather than the signal it sent.
  std::chrono::steady_clock::time_point deferred_deadline_;
  bool deferring_ = false;
  int interrupted_by_ = 0;
  const Worker* failed_ = nullptr;
};

}  // namespace contrax::detail
