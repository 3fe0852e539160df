// Whether the kernel's out-of-memory killer ended a worker, and the words
// that say so: the counters of the killer (util/cgroup.h) read when an
// attempt starts and again when a worker dies of SIGKILL, the memory limit
// in force, and what the worker said it was doing and needed
// (contrax::note_worker_memory). Internal to src/launch/, not installed.
#pragma once

#include <string>

#include "util/cgroup.h"

namespace contrax::detail {

/// The out-of-memory killer's counters at one moment.
class OomWatch {
 public:
  OomWatch();
  /// Whether the killer has ended a process since: in this process's memory
  /// cgroups, where they count it, else anywhere on the machine.
  bool fired() const;

 private:
  OomKills before_;
};

/// "the memory limit is 600 MiB (<file>; 190 MiB of it still in use after
/// the kill)", or
/// where no cgroup limits memory, "no memory limit is set; the machine has
/// 23 GiB (MemTotal)".
std::string memory_limit_text();

/// The note a worker left with note_worker_memory (next to its error file
/// `error_file`), "" when none.
std::string worker_memory_note(const std::string& error_file);

/// Where a worker's memory note lives: next to its error file.
std::string memory_note_file(const std::string& error_file);

}  // namespace contrax::detail
