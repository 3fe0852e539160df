// This process's control groups, read from /proc (internal, not installed):
// where its cgroup's files are, in the unified (v2) hierarchy or in the v1
// hierarchy of one controller, and one number from such a file. The limits
// Contrax compares a run with before it starts (memory: memory.cpp; tasks:
// tasks.cpp) are read through it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace contrax::detail {

/// The directories of this process's cgroup: with `v1_controller` empty in
/// the unified (v2) hierarchy, else in the v1 hierarchy that holds that
/// controller (e.g. "pids" on a hybrid host). With `ancestors`, its parents
/// up to the hierarchy's mount follow, own first (a limit set on any of them
/// binds). Empty when there is no such hierarchy mounted.
std::vector<std::string> cgroup_dirs(const std::string& v1_controller, bool ancestors);

/// The number in `dir`/`file` (e.g. "pids.max"); -1 for "max", a missing or
/// unreadable file.
int64_t cgroup_number(const std::string& dir, const std::string& file);

/// The number after `key` on its line of `dir`/`file` ("oom_kill 3" in
/// memory.events or memory.oom_control, /proc/vmstat); 0 when absent.
int64_t keyed_number(const std::string& dir, const std::string& file, const std::string& key);

/// The tightest memory limit over this process's cgroup and its ancestors.
struct MemoryLimit {
  int64_t limit = -1;  ///< bytes; -1: no limit
  int64_t used = 0;    ///< bytes charged to that cgroup now
  std::string file;    ///< where the limit was read ("/sys/fs/cgroup/memory/job/memory.limit_in_bytes")
};

/// The limit of this process: cgroup v2 (memory.max, memory.current) and
/// v1's memory hierarchy (memory.limit_in_bytes, memory.usage_in_bytes;
/// its "unlimited" is a number near 2^63), whichever leaves the least.
MemoryLimit memory_limit();
/// The same over given directories (own first, then ancestors): the tests'.
MemoryLimit memory_limit_of(const std::vector<std::string>& v2_dirs, const std::vector<std::string>& v1_dirs);

/// How many processes the kernel's out-of-memory killer has ended: in this
/// process's memory cgroups (v2 memory.events and v1 memory.oom_control,
/// "oom_kill", its own and its ancestors', summed) and on the whole machine
/// (/proc/vmstat "oom_kill"). Counters only grow: compare two readings.
struct OomKills {
  int64_t cgroup = 0;   ///< this process's cgroups
  int64_t machine = 0;  ///< every process of the machine
};
OomKills oom_kills();
/// The same over given directories and a vmstat file: the tests'.
OomKills oom_kills_of(const std::vector<std::string>& v2_dirs, const std::vector<std::string>& v1_dirs,
                      const std::string& vmstat);

}  // namespace contrax::detail
