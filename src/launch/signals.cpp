// The launcher's self-pipe for signals (see launch/signals.h).
#include "launch/signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>

#include "launch/posix.h"

namespace contrax::detail {

namespace {

volatile sig_atomic_t g_signal_pipe_write = -1;

extern "C" void forward_signal_handler(int sig) {
  int saved = errno;  // the interrupted code may be about to read errno
  unsigned char byte = static_cast<unsigned char>(sig);
  int fd = g_signal_pipe_write;
  if (fd >= 0) {
    ssize_t ignored = ::write(fd, &byte, 1);  // non-blocking: a full pipe already has a wake-up
    (void)ignored;
  }
  errno = saved;
}

}  // namespace

void SignalPipe::install() {
  int fds[2];
  TORCH_CHECK(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, "launch(): cannot create a pipe: ", errno_text(errno));
  read_ = fds[0];
  write_ = fds[1];
  g_signal_pipe_write = write_;

  struct sigaction forward {};
  forward.sa_handler = forward_signal_handler;
  sigemptyset(&forward.sa_mask);
  forward.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &forward, &saved_[0]);
  ::sigaction(SIGTERM, &forward, &saved_[1]);
  forward.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  ::sigaction(SIGCHLD, &forward, &saved_[2]);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, &saved_[3]);
  installed_ = true;
}

void SignalPipe::restore_dispositions() const {
  for (size_t i = 0; i < kHandled.size(); ++i) ::sigaction(kHandled[i], &saved_[i], nullptr);
}

void SignalPipe::restore() {
  if (installed_) {
    restore_dispositions();
    installed_ = false;
  }
  g_signal_pipe_write = -1;
  close_fd(read_);
  close_fd(write_);
}

int SignalPipe::read_some(unsigned char* buf, int n) const {
  for (;;) {
    const ssize_t got = ::read(read_, buf, static_cast<size_t>(n));
    if (got < 0 && errno == EINTR) continue;
    return got < 0 ? 0 : static_cast<int>(got);
  }
}

}  // namespace contrax::detail
