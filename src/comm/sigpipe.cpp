// SIGPIPE blocked on one thread for a while (see comm/sigpipe.h).
#include "comm/sigpipe.h"

#include <pthread.h>

#include <ctime>

namespace contrax::detail {

SigpipeBlocked::SigpipeBlocked() {
  sigemptyset(&pipe_);
  sigaddset(&pipe_, SIGPIPE);
  sigset_t before;
  ::pthread_sigmask(SIG_BLOCK, &pipe_, &before);
  was_blocked_ = sigismember(&before, SIGPIPE) == 1;
}

SigpipeBlocked::~SigpipeBlocked() {
  if (was_blocked_) return;
  // Unblocked with a SIGPIPE pending, the thread would take it at once.
  sigset_t pending;
  const timespec now{0, 0};
  if (::sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) ::sigtimedwait(&pipe_, nullptr, &now);
  ::pthread_sigmask(SIG_UNBLOCK, &pipe_, nullptr);
}

}  // namespace contrax::detail
