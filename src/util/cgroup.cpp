// This process's control groups (see util/cgroup.h).
#include "util/cgroup.h"

#include <algorithm>
#include <fstream>
#include <sstream>

namespace contrax::detail {

namespace {

// "/a/b" -> "/a"; "/a" -> "/".
std::string parent_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
}

bool has_word(const std::string& list, const std::string& word) {
  std::stringstream s(list);
  std::string w;
  while (std::getline(s, w, ',')) {
    if (w == word) return true;
  }
  return false;
}

// This process's path in the hierarchy: "0::/x" (v2) or "N:pids:/x" (v1).
std::string own_path(const std::string& v1_controller) {
  std::ifstream f("/proc/self/cgroup");
  std::string line;
  while (std::getline(f, line)) {
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    if (v1_controller.empty() ? line.rfind("0::", 0) == 0 : has_word(controllers, v1_controller)) {
      return line.substr(b + 1);
    }
  }
  return "";
}

// Where the hierarchy is mounted, and the cgroup its mount shows as its root
// (a container's namespace sees its own cgroup as "/").
bool find_mount(const std::string& v1_controller, std::string& mount, std::string& root) {
  std::ifstream f("/proc/self/mountinfo");
  std::string line;
  while (std::getline(f, line)) {
    const auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream left(line.substr(0, dash)), right(line.substr(dash + 3));
    std::string id, parent, dev, r, point, fstype, source, options;
    if (!(left >> id >> parent >> dev >> r >> point) || !(right >> fstype >> source >> options)) continue;
    const bool match = v1_controller.empty() ? fstype == "cgroup2"
                                             : fstype == "cgroup" && has_word(options, v1_controller);
    if (match) {
      mount = point;
      root = r;
      return true;
    }
  }
  return false;
}

}  // namespace

std::vector<std::string> cgroup_dirs(const std::string& v1_controller, bool ancestors) {
  std::string path = own_path(v1_controller), mount, root;
  if (path.empty() || !find_mount(v1_controller, mount, root)) return {};
  if (root != "/" && path.rfind(root, 0) == 0) path = path.size() == root.size() ? "/" : path.substr(root.size());
  std::vector<std::string> dirs;
  for (;;) {
    dirs.push_back(mount + (path == "/" ? std::string() : path));
    if (!ancestors || path == "/") return dirs;
    path = parent_of(path);
  }
}

int64_t cgroup_number(const std::string& dir, const std::string& file) {
  std::ifstream f(dir + "/" + file);
  std::string v;
  if (!(f >> v) || v == "max") return -1;
  try {
    return std::stoll(v);
  } catch (const std::exception&) {
    return -1;
  }
}

int64_t keyed_number(const std::string& dir, const std::string& file, const std::string& key) {
  std::ifstream f(dir.empty() ? file : dir + "/" + file);
  std::string k;
  int64_t v = 0;
  while (f >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

MemoryLimit memory_limit_of(const std::vector<std::string>& v2_dirs, const std::vector<std::string>& v1_dirs) {
  MemoryLimit best;
  auto consider = [&](const std::string& dir, const char* limit_file, const char* usage_file) {
    const int64_t limit = cgroup_number(dir, limit_file);
    // v1 writes "no limit" as the largest page-aligned int64 (2^63 - 4096).
    if (limit < 0 || limit >= (int64_t{1} << 62)) return;
    const int64_t used = std::max<int64_t>(0, cgroup_number(dir, usage_file));
    if (best.limit < 0 || limit - used < best.limit - best.used) best = {limit, used, dir + "/" + limit_file};
  };
  for (const auto& d : v2_dirs) consider(d, "memory.max", "memory.current");
  for (const auto& d : v1_dirs) consider(d, "memory.limit_in_bytes", "memory.usage_in_bytes");
  return best;
}

MemoryLimit memory_limit() {
  return memory_limit_of(cgroup_dirs("", /*ancestors=*/true), cgroup_dirs("memory", /*ancestors=*/true));
}

OomKills oom_kills_of(const std::vector<std::string>& v2_dirs, const std::vector<std::string>& v1_dirs,
                      const std::string& vmstat) {
  OomKills k;
  for (const auto& d : v2_dirs) k.cgroup += keyed_number(d, "memory.events", "oom_kill");
  for (const auto& d : v1_dirs) k.cgroup += keyed_number(d, "memory.oom_control", "oom_kill");
  k.machine = keyed_number("", vmstat, "oom_kill");
  return k;
}

OomKills oom_kills() {
  return oom_kills_of(cgroup_dirs("", /*ancestors=*/true), cgroup_dirs("memory", /*ancestors=*/true), "/proc/vmstat");
}

}  // namespace contrax::detail
