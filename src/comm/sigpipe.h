// SIGPIPE kept off the threads that write to Gloo's sockets. Gloo writes with
// writev, which raises SIGPIPE when the peer has closed its end (a rank that
// failed or was killed), and SIGPIPE's default action ends the process: a
// surviving rank of a C++ program died without a word, where Python (which
// ignores SIGPIPE) reports the closed connection. Gloo writes on three kinds
// of thread: its device's event loop and the process group's workers (the
// collectives), which inherit the mask of the thread that constructs them,
// and the caller of a point-to-point send, which writes in place before
// handing the rest to the loop. While a SigpipeBlocked lives, SIGPIPE is
// blocked on this thread, so a write fails with EPIPE and Gloo reports it;
// at its end the mask is restored and a SIGPIPE raised meanwhile on this
// thread is discarded. The process's disposition of SIGPIPE is never changed.
// Internal to src/comm/, not installed.
#pragma once

#include <signal.h>

#include <c10/macros/Macros.h>

namespace contrax::detail {

class SigpipeBlocked {
 public:
  SigpipeBlocked();
  ~SigpipeBlocked();
  C10_DISABLE_COPY_AND_ASSIGN(SigpipeBlocked);

 private:
  sigset_t pipe_;
  bool was_blocked_ = false;
};

}  // namespace contrax::detail
