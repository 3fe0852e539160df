// The tasks limit: how many more threads and processes this process may start.
//
// Linux counts threads and processes alike as tasks, and two limits bound
// them: a pids cgroup (pids.max, on the process's cgroup or any parent) and
// RLIMIT_NPROC (`ulimit -u`, per user). A run that starts more than fits
// fails inside a thread library that cannot fail politely (libgomp prints
// "Thread creation failed" and exits; Gloo and c10d throw EAGAIN mid-way),
// so the tool compares the threads a run will start with this limit first,
// as it compares a step's memory with available_memory_bytes().
#pragma once

#include <cstdint>
#include <string>

namespace contrax {

/// The tightest limit on the tasks this process may still start.
struct TasksLimit {
  /// Tasks (threads or processes) that may still start; -1 when no limit
  /// applies (none set, or the process's user is exempt).
  int64_t left = -1;
  /// The limit that binds, for a message, e.g. "the pids cgroup
  /// /sys/fs/cgroup/pids/job (pids.max 10, pids.current 4)" or
  /// "RLIMIT_NPROC (ulimit -u) 50 of user 1000, who runs 12 tasks".
  std::string what;
};

/// Reads the limits now: pids.max - pids.current of this process's cgroup and
/// every parent (cgroup v2, or v1's pids hierarchy), and RLIMIT_NPROC less
/// the tasks the process's real user runs (root, whom the kernel exempts,
/// has none). Never throws; a limit it cannot read counts as none.
///
///   const auto lim = contrax::tasks_limit();
///   if (lim.left >= 0 && needed > lim.left) { /* refuse, naming lim.what */ }
TasksLimit tasks_limit();

}  // namespace contrax
