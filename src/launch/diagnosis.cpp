// Which rank failed first, and how the launch ended (see launch/diagnosis.h).
#include "launch/diagnosis.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "launch/posix.h"

namespace contrax::detail {

namespace {

// What a worker recorded through record_worker_failure().
struct FailureRecord {
  bool present = false;
  int64_t ns = 0;
  bool by_peer = false;
};

FailureRecord read_failure_record(const std::string& path) {
  FailureRecord r;
  if (path.empty()) return r;
  std::ifstream in(path);
  long long ns = 0;
  std::string kind;
  if (in >> ns >> kind) {
    r.present = true;
    r.ns = ns;
    r.by_peer = kind == "peer";
  }
  return r;
}

// The rank to blame (see summarize).
const Worker* root_cause(const std::vector<Worker>& workers, const Worker* first_failed) {
  const Worker* best = nullptr;
  int64_t best_ns = 0;
  // A record of its own counts even when the launcher's SIGTERM ended the
  // worker afterwards: it says when the worker began to fail.
  for (const auto& w : workers) {
    const FailureRecord rec = read_failure_record(w.error_file);
    if (!rec.present || rec.by_peer) continue;
    if (best == nullptr || rec.ns < best_ns) {
      best = &w;
      best_ns = rec.ns;
    }
  }
  if (best != nullptr) return best;
  // Without records, the first failure seen that is not a consequence:
  // workers without a record that failed, earliest first.
  for (const auto& w : workers) {
    if (!w.failed || read_failure_record(w.error_file).present) continue;
    if (best == nullptr || w.failed_ns < best->failed_ns) best = &w;
  }
  return best != nullptr ? best : first_failed;
}

}  // namespace

void write_failure_record(const char* path, bool caused_by_peer, const std::string& what) noexcept {
  // O_EXCL: the first record of the process is the one that tells when it
  // began failing; later ones (the unwinding after it) change nothing.
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return;
  std::string first = what.substr(0, what.find('\n'));
  std::string text = std::to_string(monotonic_ns()) + (caused_by_peer ? " peer\n" : " origin\n") + first + "\n";
  write_all(fd, text.data(), text.size());
  ::close(fd);
}

bool failed_on_its_own(const Worker& w) {
  const FailureRecord rec = read_failure_record(w.error_file);
  return rec.present && !rec.by_peer;
}

bool process_stopped(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  // Field 3 follows the command name in parentheses, which may hold spaces.
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() &&
         (stat[close + 2] == 'T' || stat[close + 2] == 't');
}

LaunchResult summarize(const std::vector<Worker>& workers, const Worker* first_failed, int interrupted_by,
                       const OomWatch& oom) {
  LaunchResult r;
  const Worker* culprit = first_failed != nullptr ? root_cause(workers, first_failed) : nullptr;
  if (culprit != nullptr) {
    const int st = culprit->status;
    r.failed_rank = culprit->rank;
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL && oom.fired()) {
      // The killer sends SIGKILL, which nobody can catch: only its counters
      // tell its kill from any other.
      r.exit_code = 128 + SIGKILL;
      const std::string note = worker_memory_note(culprit->error_file);
      r.message = "rank " + std::to_string(culprit->rank) + " was killed by the out-of-memory killer: " +
                  memory_limit_text() + (note.empty() ? "" : "; the rank was " + note);
    } else if (WIFSIGNALED(st)) {
      r.exit_code = 128 + WTERMSIG(st);
      r.message = "rank " + std::to_string(culprit->rank) + " was killed by signal " + std::to_string(WTERMSIG(st)) +
                  " (" + ::strsignal(WTERMSIG(st)) + ")";
    } else {
      r.exit_code = WEXITSTATUS(st);
      r.message = "rank " + std::to_string(culprit->rank) + " exited with status " + std::to_string(r.exit_code);
    }
    if (!culprit->streams[1].last_line.empty()) r.message += ": " + culprit->streams[1].last_line;
    if (culprit != first_failed) {
      r.message += " (it failed first; rank " + std::to_string(first_failed->rank) + " exited before it)";
    }
    for (const auto& w : workers) {
      if (w.stopped_when_failing) {
        r.message += "; rank " + std::to_string(w.rank) + " was stopped (SIGSTOP) when the job failed";
      }
    }
  } else if (interrupted_by != 0) {
    // The shell convention for "ended by signal N", so scripts see it as such.
    r.exit_code = 128 + interrupted_by;
    r.message = "interrupted by signal " + std::to_string(interrupted_by) + " (" + ::strsignal(interrupted_by) +
                "); workers stopped";
  }
  return r;
}

ErrorFileDir::ErrorFileDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/contrax-launch-XXXXXX";
  if (::mkdtemp(&templ[0]) != nullptr) path_ = templ;  // without it, blame falls back to exit order
}

ErrorFileDir::~ErrorFileDir() {
  clear();
  if (!path_.empty()) ::rmdir(path_.c_str());
}

std::string ErrorFileDir::file(int64_t rank) {
  if (path_.empty()) return "";
  files_.push_back(path_ + "/rank_" + std::to_string(rank));
  return files_.back();
}

void ErrorFileDir::clear() {
  for (const auto& f : files_) {
    ::unlink(f.c_str());
    ::unlink(memory_note_file(f).c_str());
  }
}

}  // namespace contrax::detail
