// Forwarding a worker's output (see launch/output.h).
#include "launch/output.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>

#include "launch/posix.h"

namespace contrax::detail {

namespace {

// A line longer than this is forwarded in pieces: a worker printing a progress
// bar without newlines must not make the launcher buffer without bound.
constexpr size_t kMaxLine = 64 * 1024;

// A log file that cannot be written (full disk) must not stop the job or
// the forwarding to the terminal: say so once and stop logging that rank.
void write_log(Worker& w, const std::string& text, const OutputOptions& o) {
  const char* data = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(w.log_fd, data, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string msg = "launch: cannot write the log of rank " + std::to_string(w.rank) + " in '" +
                              o.log_dir + "': " + (n < 0 ? errno_text(errno) : "no progress") +
                              "; that rank is no longer logged\n";
      write_all(2, msg.data(), msg.size());
      close_fd(w.log_fd);
      return;
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
}

// Forwards complete lines of `s.buffer`, or everything at EOF / when the
// line grew past kMaxLine, one write per line. Without a prefix, a last
// line without newline is passed on as it is. A carriage return ends a
// piece too: a progress line redrawn in place (`contrax train` on a
// terminal) reaches the terminal at each redraw, not at the next newline.
void flush_lines(Worker& w, Stream& s, bool all, const OutputOptions& o) {
  const std::string p = o.prefix ? "[rank " + std::to_string(s.rank) + "] " : std::string();
  size_t start = 0;
  for (;;) {
    const size_t nl = s.buffer.find_first_of("\n\r", start);
    size_t end;  // one past the bytes forwarded now
    bool add_newline = false;
    if (nl == std::string::npos) {
      if (start == s.buffer.size()) break;
      if (!all && s.buffer.size() - start < kMaxLine) break;
      end = s.buffer.size();
      add_newline = o.prefix;
    } else {
      end = nl + 1;
    }
    std::string body = s.buffer.substr(start, end - start);
    if (&s == &w.streams[1]) {
      std::string trimmed = body;
      while (!trimmed.empty() && (trimmed.back() == '\n' || trimmed.back() == '\r')) trimmed.pop_back();
      if (!trimmed.empty()) s.last_line = trimmed.substr(0, 2000);
    }
    if (w.log_fd >= 0) write_log(w, body + (add_newline ? "\n" : ""), o);
    std::string line = p + body + (add_newline ? "\n" : "");
    write_all(s.out_fd, line.data(), line.size());
    start = end;
  }
  s.buffer.erase(0, start);
}

}  // namespace

void pump(Worker& w, Stream& s, const OutputOptions& o) {
  char buf[65536];
  ssize_t n;
  do {
    n = ::read(s.fd, buf, sizeof buf);
  } while (n < 0 && errno == EINTR);
  if (n > 0) {
    s.buffer.append(buf, static_cast<size_t>(n));
    flush_lines(w, s, false, o);
  } else {
    // EOF (or an error, which leaves nothing more to read either).
    flush_lines(w, s, true, o);
    close_fd(s.fd);
  }
}

void drain(Worker& w, Stream& s, const OutputOptions& o) {
  if (s.fd >= 0) {
    char buf[65536];
    for (;;) {
      pollfd p{s.fd, POLLIN, 0};
      int r = ::poll(&p, 1, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      ssize_t n = ::read(s.fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      s.buffer.append(buf, static_cast<size_t>(n));
    }
  }
  flush_lines(w, s, true, o);
}

}  // namespace contrax::detail
