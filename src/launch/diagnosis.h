// Which rank failed first (why: contrax/launch/launcher.h), and how the launch
// ended: the workers' CONTRAX_ERROR_FILE records, stamped on a clock every
// process of the machine shares. Internal to src/launch/, not installed.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include <c10/macros/Macros.h>

#include "contrax/launch/launcher.h"
#include "launch/out_of_memory.h"
#include "launch/worker.h"

namespace contrax::detail {

/// Writes this process's failure record to `path` (the first of a process
/// counts: later ones change nothing); never throws.
void write_failure_record(const char* path, bool caused_by_peer, const std::string& what) noexcept;

/// Whether the worker has recorded a failure of its own (not caused by a
/// peer): it is exiting, and its status will be its own.
bool failed_on_its_own(const Worker& w);

/// Whether the process is stopped (SIGSTOP/SIGTSTP: state T or t): a stopped
/// rank is the likely reason its peers' collectives timed out.
bool process_stopped(pid_t pid);

/// How the launch ended: the rank to blame among `workers` (the earliest
/// that recorded a failure of its own; without any such record, the first
/// seen failing that recorded nothing; else `first_failed`, the first the
/// launcher saw failing), its exit and reason; or the interruption by signal
/// `interrupted_by`; or success.
/// A rank killed by SIGKILL while `oom` saw the out-of-memory killer fire is
/// reported as killed by it, with the memory limit and the rank's memory
/// note.
LaunchResult summarize(const std::vector<Worker>& workers, const Worker* first_failed, int interrupted_by,
                       const OomWatch& oom);

/// The per-launch directory of the workers' failure records, removed with it.
class ErrorFileDir {
 public:
  ErrorFileDir();
  ~ErrorFileDir();
  C10_DISABLE_COPY_AND_ASSIGN(ErrorFileDir);
  /// The record of `rank` ("" without a directory: blame falls back to the
  /// order of exits); remembered, so that clear() removes it.
  std::string file(int64_t rank);
  /// Removes every record: those of a previous attempt must not blame a
  /// restarted worker.
  void clear();

 private:
  std::string path_;
  std::vector<std::string> files_;
};

}  // namespace contrax::detail
