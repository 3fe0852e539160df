// What the launcher's supervisor knows about one worker process: its rank,
// process (group) id and status, and its two output streams on their way to
// the launcher's own stdout and stderr (and its log file). Internal to the
// launcher (src/launch/), not installed.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <string>

namespace contrax::detail {

/// One of a worker's output pipes.
struct Stream {
  int64_t rank = 0;
  int fd = -1;            // read end of the worker's stdout or stderr pipe
  int out_fd = 1;         // where it is forwarded: our stdout or stderr
  std::string buffer;     // bytes after the last forwarded newline
  std::string last_line;  // last non-empty complete line (stderr: the failure's reason)
};

struct Worker {
  int64_t rank = 0;
  pid_t pid = -1;  // also the worker's process-group id
  bool running = false;
  int status = 0;  // waitpid status once !running
  std::array<Stream, 2> streams;      // stdout, stderr
  int log_fd = -1;                    // DIR/rank_<rank>.log, or -1
  std::string error_file;             // CONTRAX_ERROR_FILE of this worker
  bool failed = false;                // exited non-zero or by a signal the launcher did not send
  int64_t failed_ns = 0;              // when the launcher saw that
  bool stopped_when_failing = false;  // SIGSTOPped when the job began to stop
  bool stop_deferred = false;         // failing on its own when the job began to stop: left to exit
};

}  // namespace contrax::detail
