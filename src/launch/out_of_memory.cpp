// Telling an out-of-memory kill from any other SIGKILL (see launch/out_of_memory.h).
#include "launch/out_of_memory.h"

#include <fstream>
#include <sstream>

#include "contrax/util/memory.h"

namespace contrax::detail {

OomWatch::OomWatch() : before_(oom_kills()) {}

bool OomWatch::fired() const {
  const OomKills now = oom_kills();
  return now.cgroup > before_.cgroup || now.machine > before_.machine;
}

std::string memory_limit_text() {
  const MemoryLimit m = memory_limit();
  if (m.limit >= 0) {
    return "the memory limit is " + format_bytes(static_cast<double>(m.limit)) + " (" + m.file + "; " +
           format_bytes(static_cast<double>(m.used)) + " of it still in use after the kill)";
  }
  const int64_t kib = keyed_number("", "/proc/meminfo", "MemTotal:");
  return "no memory limit is set; the machine has " + format_bytes(static_cast<double>(kib) * 1024.0) +
         " (MemTotal)";
}

std::string memory_note_file(const std::string& error_file) { return error_file + ".memory"; }

std::string worker_memory_note(const std::string& error_file) {
  if (error_file.empty()) return "";
  std::ifstream in(memory_note_file(error_file));
  std::string note;
  std::getline(in, note);
  return note;
}

}  // namespace contrax::detail
