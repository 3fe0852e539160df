// The launcher's POSIX helpers (see launch/posix.h).
#include "launch/posix.h"

#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <ctime>

namespace contrax::detail {

int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void close_fd(int& fd) {
  if (fd >= 0) {
    ::close(fd);
    fd = -1;
  }
}

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void make_dirs(const std::string& dir, const char* what) {
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    cur = dir.substr(0, pos);
    if (cur.empty()) continue;
    TORCH_CHECK(::mkdir(cur.c_str(), 0755) == 0 || errno == EEXIST, "launch(): cannot create ", what, " '", cur,
                "': ", errno_text(errno));
  }
}

}  // namespace contrax::detail
