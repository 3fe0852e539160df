// The launcher's signals. SIGINT and SIGTERM sent to the launcher, and SIGCHLD
// when a worker ends, reach the supervisor's poll() through a self-pipe: the
// one async-signal-safe wake-up that does not depend on which thread of a
// multi-threaded host the kernel delivers to. The handler only writes the
// signal number into the pipe. Handlers are process-wide, hence one launch at a
// time per process. Taking SIGCHLD over also keeps a host's own handler (or
// SIG_IGN, which auto-reaps) from stealing the workers' exit statuses.
// Internal to src/launch/, not installed.
#pragma once

#include <signal.h>

#include <array>

#include <c10/macros/Macros.h>

namespace contrax::detail {

class SignalPipe {
 public:
  /// The signals taken over while a launch runs.
  static constexpr std::array<int, 4> kHandled = {SIGINT, SIGTERM, SIGCHLD, SIGPIPE};

  SignalPipe() = default;
  ~SignalPipe() { restore(); }
  C10_DISABLE_COPY_AND_ASSIGN(SignalPipe);

  /// Creates the pipe and takes the signals over (SIGPIPE ignored meanwhile).
  void install();
  /// Gives the signals back and closes the pipe (idempotent).
  void restore();
  /// The caller's dispositions back, nothing else: async-signal-safe, for the
  /// forked child before exec (ignored signals stay ignored across exec).
  void restore_dispositions() const;
  /// The pipe's read end, for poll().
  int read_fd() const { return read_; }
  /// Reads every signal number waiting in the pipe; fn(sig) for each.
  template <typename Fn>
  void drain(Fn fn) const;

 private:
  int read_ = -1, write_ = -1;
  std::array<struct sigaction, kHandled.size()> saved_{};
  bool installed_ = false;
  int read_some(unsigned char* buf, int n) const;
};

template <typename Fn>
void SignalPipe::drain(Fn fn) const {
  unsigned char buf[16];
  int n;
  while ((n = read_some(buf, sizeof buf)) > 0) {
    for (int i = 0; i < n; ++i) fn(static_cast<int>(buf[i]));
  }
}

}  // namespace contrax::detail
