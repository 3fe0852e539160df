// This process's control groups (see util/cgroup.h).
#include "util/cgroup.h"

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

}  // namespace contrax::detail
