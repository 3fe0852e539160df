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

}  // namespace contrax::detail
