// c10d's own log lines where Contrax reports the failure itself. A TCPStore
// client that loses its server logs "[W ... TCPStore.cpp:106] sendBytes
// failed ... Broken pipe" with the C++ backtrace of the exception it is about
// to throw, and one that cannot connect logs each retry the same way; Contrax
// catches those exceptions and says in one line which rank ended and where to
// look, so the raw lines only read like a crash before it. Muted: the
// store-polling diagnosis thread, the TCPStore client's connect, and the
// process group's construction (Gloo waits on the store). While a QuietC10dLog
// lives, c10's log threshold is raised to FATAL (process-wide: c10 has one
// threshold); the outermost one restores it.
//
// The debug switch is c10's own: with TORCH_CPP_LOG_LEVEL set (e.g. INFO or
// WARNING), or TORCH_DISTRIBUTED_DEBUG, nothing is muted and c10d prints in
// full. Internal to src/comm/, not installed.
#pragma once

#include <c10/macros/Macros.h>

namespace contrax::detail {

class QuietC10dLog {
 public:
  QuietC10dLog();
  ~QuietC10dLog();
  C10_DISABLE_COPY_AND_ASSIGN(QuietC10dLog);

 private:
  bool active_;
};

}  // namespace contrax::detail
