// The tasks limit (see contrax/util/tasks.h).
#include "contrax/util/tasks.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "util/cgroup.h"

namespace contrax {

namespace {

// The tightest pids.max - pids.current over this process's cgroup and its
// parents, in whichever hierarchy carries the pids controller.
TasksLimit cgroup_limit() {
  TasksLimit best;
  for (const char* hierarchy : {"", "pids"}) {
    for (const auto& dir : detail::cgroup_dirs(hierarchy, /*ancestors=*/true)) {
      const int64_t max = detail::cgroup_number(dir, "pids.max");
      if (max < 0) continue;
      const int64_t current = std::max<int64_t>(0, detail::cgroup_number(dir, "pids.current"));
      const int64_t left = std::max<int64_t>(0, max - current);
      if (best.left < 0 || left < best.left) {
        best.left = left;
        best.what = "the pids cgroup " + dir + " (pids.max " + std::to_string(max) + ", pids.current " +
                    std::to_string(current) + ")";
      }
    }
  }
  return best;
}

// The tasks (threads of all processes) whose real user is `uid`: what the
// kernel counts against RLIMIT_NPROC.
int64_t tasks_of_user(uid_t uid) {
  int64_t n = 0;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return 0;
  while (const dirent* e = ::readdir(proc)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/status");
    std::string line;
    int64_t real_uid = -1, threads = 0;
    while (std::getline(f, line)) {
      std::istringstream s(line);
      std::string key;
      s >> key;
      if (key == "Uid:") s >> real_uid;
      if (key == "Threads:") s >> threads;
    }
    if (real_uid == static_cast<int64_t>(uid)) n += threads;
  }
  ::closedir(proc);
  return n;
}

TasksLimit rlimit_nproc() {
  TasksLimit lim;
  rlimit r{};
  // The kernel exempts root (and CAP_SYS_ADMIN/CAP_SYS_RESOURCE) from it.
  if (::getuid() == 0 || ::getrlimit(RLIMIT_NPROC, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return lim;
  const int64_t max = static_cast<int64_t>(r.rlim_cur), running = tasks_of_user(::getuid());
  lim.left = std::max<int64_t>(0, max - running);
  lim.what = "RLIMIT_NPROC (ulimit -u) " + std::to_string(max) + " of user " + std::to_string(::getuid()) +
             ", who runs " + std::to_string(running) + " tasks";
  return lim;
}

}  // namespace

TasksLimit tasks_limit() {
  try {
    const TasksLimit a = cgroup_limit(), b = rlimit_nproc();
    if (a.left < 0) return b;
    if (b.left < 0) return a;
    return a.left <= b.left ? a : b;
  } catch (const std::exception&) {
    return TasksLimit();  // unreadable limits count as none
  }
}

}  // namespace contrax
