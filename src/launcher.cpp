// The local process launcher behind `contrax launch` (see contrax/launcher.h).
//
// One supervisor loop owns everything: it forks the workers (each in its own
// process group, so a worker and whatever it spawned go down together), pumps
// their stdout/stderr through pipes into ours with a rank prefix, reaps them,
// and on the first failure or on SIGINT/SIGTERM stops the rest with SIGTERM,
// then SIGKILL after the grace period. Signals reach the loop through a
// self-pipe, the one async-signal-safe way to wake poll() that does not depend
// on which thread of a multi-threaded host the kernel picks for delivery.
#include "contrax/launcher.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

extern char** environ;

namespace contrax {
namespace {

using Clock = std::chrono::steady_clock;

// Variables the launcher owns; inherited copies are dropped so that a launch
// from inside a launched worker does not hand its children two RANKs.
constexpr std::array<const char*, 9> kLauncherVars = {
    "RANK",        "LOCAL_RANK",  "WORLD_SIZE",         "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "CONTRAX_ERROR_FILE"};

constexpr const char* kErrorFileVar = "CONTRAX_ERROR_FILE";

// A monotonic clock shared by all processes of the machine: the workers'
// failure records and the launcher compare on it.
int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// A line longer than this is forwarded in pieces: a worker printing a progress
// bar without newlines must not make the launcher buffer without bound.
constexpr size_t kMaxLine = 64 * 1024;

std::string errno_text(int err) { return std::strerror(err); }

void close_fd(int& fd) {
  if (fd >= 0) {
    // Linux closes the descriptor even when close() reports EINTR; retrying
    // could close a descriptor another thread just opened.
    ::close(fd);
    fd = -1;
  }
}

// write() until done: short writes happen on pipes, EINTR whenever a signal
// arrives. EPIPE (our reader went away) drops the output rather than killing
// the launcher, which would orphan the workers; SIGPIPE is ignored meanwhile.
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

// ---- signals ---------------------------------------------------------------
// The handler only writes the signal number into the self-pipe; everything
// else happens in the loop. Handlers are process-wide, hence one launch at a
// time per process (launch() holds g_launch_mutex). SIGCHLD goes through the
// same pipe so that a worker's exit wakes the loop at once; taking it over
// also keeps a host's own SIGCHLD handler (or SIG_IGN, which auto-reaps) from
// stealing the workers' exit statuses.

std::mutex g_launch_mutex;
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

// ---- one worker ------------------------------------------------------------

struct Stream {
  int64_t rank = 0;
  int fd = -1;         // read end of the worker's stdout or stderr pipe
  int out_fd = 1;      // where it is forwarded: our stdout or stderr
  std::string buffer;  // bytes after the last forwarded newline
  std::string last_line;  // last non-empty complete line (stderr: the failure's reason)
};

struct Worker {
  int64_t rank = 0;
  pid_t pid = -1;  // also the worker's process-group id
  bool running = false;
  int status = 0;  // waitpid status once !running
  std::array<Stream, 2> streams;
  int log_fd = -1;             // DIR/rank_<rank>.log, or -1
  std::string error_file;      // CONTRAX_ERROR_FILE of this worker
  bool failed = false;         // exited non-zero or by a signal the launcher did not send
  int64_t failed_ns = 0;       // when the launcher saw that
  bool stopped_when_failing = false;  // SIGSTOPped when the job began to stop
};

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

// True when the process is in state T (stopped by SIGSTOP/SIGTSTP) or t.
bool process_stopped(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  // Field 3 follows the command name in parentheses, which may hold spaces.
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() &&
         (stat[close + 2] == 'T' || stat[close + 2] == 't');
}

// Everything a launch holds, released in the destructor whichever way
// launch() leaves: no worker outlives it, no descriptor leaks, and the
// caller's signal dispositions come back.
class Supervisor {
 public:
  // Reserving keeps pointers into workers_ (failed_, the Stream*s that
  // supervise() polls) valid while workers are added.
  explicit Supervisor(const LaunchOptions& options) : options_(options) {
    workers_.reserve(static_cast<size_t>(options.nproc));
  }

  ~Supervisor() {
    // Normal returns have reaped everyone already; this is for exceptions.
    signal_all(SIGKILL);
    for (auto& w : workers_) {
      if (w.running) wait_blocking(w);
      for (auto& s : w.streams) close_fd(s.fd);
      close_fd(w.log_fd);
    }
    restore_signals();
  }

  void install_signals() {
    int fds[2];
    TORCH_CHECK(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, "launch(): cannot create a pipe: ", errno_text(errno));
    signal_read_ = fds[0];
    signal_write_ = fds[1];
    g_signal_pipe_write = signal_write_;

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

  // Async-signal-safe: also called in the forked child before exec, because
  // ignored signals stay ignored across exec.
  void restore_dispositions() const {
    for (size_t i = 0; i < kHandled.size(); ++i) ::sigaction(kHandled[i], &saved_[i], nullptr);
  }

  void restore_signals() {
    if (installed_) {
      restore_dispositions();
      installed_ = false;
    }
    g_signal_pipe_write = -1;
    close_fd(signal_read_);
    close_fd(signal_write_);
  }

  // Forks and execs one worker; returns errno of a failed exec, 0 on success.
  int start(const std::vector<std::string>& argv, int64_t rank, const std::vector<std::string>& env,
            const std::string& log_path, const std::string& error_file) {
    Worker w;
    w.rank = rank;
    w.error_file = error_file;
    if (!log_path.empty()) {
      w.log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      TORCH_CHECK(w.log_fd >= 0, "launch(): cannot open log file '", log_path, "': ", errno_text(errno));
    }
    int out[2], err[2], exec_status[2];
    // CLOEXEC everywhere: a worker must not inherit another worker's pipe ends,
    // or that pipe would never see EOF.
    TORCH_CHECK(::pipe2(out, O_CLOEXEC) == 0, "launch(): cannot create a pipe: ", errno_text(errno));
    w.streams[0].rank = w.streams[1].rank = rank;
    w.streams[0].fd = out[0];
    w.streams[0].out_fd = 1;
    w.streams[1].out_fd = 2;
    workers_.push_back(std::move(w));  // from here on the destructor closes the read ends
    Worker& worker = workers_.back();
    if (::pipe2(err, O_CLOEXEC) != 0) {
      int e = errno;
      ::close(out[1]);
      TORCH_CHECK(false, "launch(): cannot create a pipe: ", errno_text(e));
    }
    worker.streams[1].fd = err[0];
    // The exec-status pipe closes by itself on a successful exec; a failed one
    // sends errno through it, so the launcher can report the real reason.
    if (::pipe2(exec_status, O_CLOEXEC) != 0) {
      int e = errno;
      ::close(out[1]);
      ::close(err[1]);
      TORCH_CHECK(false, "launch(): cannot create a pipe: ", errno_text(e));
    }

    // Between fork and exec the child of a possibly multi-threaded process
    // may only make async-signal-safe calls: everything is prepared here.
    std::vector<char*> c_argv, c_env;
    for (const auto& a : argv) c_argv.push_back(const_cast<char*>(a.c_str()));
    c_argv.push_back(nullptr);
    for (const auto& e : env) c_env.push_back(const_cast<char*>(e.c_str()));
    c_env.push_back(nullptr);
    const pid_t parent = ::getpid();

    // Blocked across fork so that the child cannot run the launcher's handler
    // (and write into its self-pipe) before it has reset the dispositions.
    sigset_t block, old_mask;
    sigemptyset(&block);
    for (int sig : kHandled) sigaddset(&block, sig);
    ::pthread_sigmask(SIG_BLOCK, &block, &old_mask);
    pid_t pid = ::fork();
    if (pid != 0) ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    if (pid < 0) {
      int e = errno;
      ::close(out[1]);
      ::close(err[1]);
      ::close(exec_status[0]);
      ::close(exec_status[1]);
      TORCH_CHECK(false, "launch(): cannot fork: ", errno_text(e));
    }
    if (pid == 0) {
      // Own process group: the launcher can stop the worker's whole tree, and
      // a Ctrl-C on the terminal reaches the launcher only, which forwards it
      // once instead of every process getting it twice.
      ::setpgid(0, 0);
      // Should the launcher itself be killed (SIGKILL cannot be forwarded),
      // its workers must not live on unsupervised.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      restore_dispositions();
      ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
      // Workers run in a background process group, where reading the terminal
      // would stop them (SIGTTIN): give them no stdin.
      int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // dup2 clears CLOEXEC on fd 0 only
      if (devnull >= 0) ::dup2(devnull, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      // glibc's execvpe searches PATH without allocating.
      ::execvpe(c_argv[0], c_argv.data(), c_env.data());
      int e = errno;
      ssize_t ignored = ::write(exec_status[1], &e, sizeof e);
      (void)ignored;
      ::_exit(127);
    }
    // Also from the parent: signalling the group must work even if the child
    // has not run its own setpgid yet.
    ::setpgid(pid, pid);
    worker.pid = pid;
    worker.running = true;
    ::close(out[1]);
    ::close(err[1]);
    ::close(exec_status[1]);

    int exec_errno = 0;
    size_t got = 0;
    while (got < sizeof exec_errno) {
      ssize_t n = ::read(exec_status[0], reinterpret_cast<char*>(&exec_errno) + got, sizeof exec_errno - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(exec_status[0]);
    return got == sizeof exec_errno ? exec_errno : 0;
  }

  // Signals the process group of every worker still running; what exited
  // workers left behind is swept once all are reaped (end of supervise()).
  void signal_all(int sig) {
    for (auto& w : workers_) {
      if (!w.running) continue;
      ::kill(-w.pid, sig);
      // A SIGSTOPped worker would hold SIGTERM pending until the grace period
      // ends in SIGKILL; continuing it lets it act on the request now.
      if (sig != SIGKILL) ::kill(-w.pid, SIGCONT);
    }
  }

  LaunchResult supervise() {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    const auto poll_period = std::chrono::milliseconds(200);
    while (any_running()) {
      fds.clear();
      streams.clear();
      fds.push_back({signal_read_, POLLIN, 0});
      for (auto& w : workers_) {
        for (auto& s : w.streams) {
          if (s.fd >= 0) {
            fds.push_back({s.fd, POLLIN, 0});
            streams.push_back(&s);
          }
        }
      }
      // SIGCHLD wakes the loop; the period is only a backstop.
      auto timeout = poll_period;
      if (stopping_ && !killed_) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(kill_deadline_ - Clock::now());
        timeout = std::max(std::chrono::milliseconds(0), std::min(timeout, left));
      }
      int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
      if (n < 0 && errno != EINTR) {
        TORCH_CHECK(false, "launch(): poll failed: ", errno_text(errno));
      }
      if (n > 0) {
        if (fds[0].revents) handle_signals();
        for (size_t i = 1; i < fds.size(); ++i) {
          if (fds[i].revents) pump(*streams[i - 1]);
        }
      }
      reap();
      if (stopping_ && !killed_ && Clock::now() >= kill_deadline_) {
        signal_all(SIGKILL);
        killed_ = true;
      }
    }
    // The job is over: what a worker left running in its process group
    // (a background helper, say) must not outlive the launcher. The group id
    // is the reaped worker's pid, which Linux does not hand out again while
    // the group has members; once it is empty, kill() just fails with ESRCH.
    for (auto& w : workers_) ::kill(-w.pid, SIGKILL);
    // What the workers wrote is still in the pipes. Descendants that escaped
    // the group and kept a pipe open must not hold the launcher, so read only
    // what is already there.
    for (auto& w : workers_) {
      for (auto& s : w.streams) {
        drain(s);
        close_fd(s.fd);
      }
    }
    return result();
  }

 private:
  bool any_running() const {
    return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; });
  }

  void wait_blocking(Worker& w) {
    while (::waitpid(w.pid, &w.status, 0) < 0) {
      if (errno != EINTR) break;  // ECHILD: another thread of the host reaped it
    }
    w.running = false;
  }

  void begin_stop(int sig) {
    stopping_ = true;
    kill_deadline_ = Clock::now() + options_.grace;
    // Noted before the SIGCONT below: a stopped rank is the likely reason its
    // peers' collectives timed out.
    for (auto& w : workers_) {
      if (w.running && process_stopped(w.pid)) w.stopped_when_failing = true;
    }
    signal_all(sig);
  }

  void handle_signals() {
    unsigned char buf[16];
    ssize_t n;
    while ((n = ::read(signal_read_, buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
      for (ssize_t i = 0; i < n; ++i) {
        int sig = buf[i];
        if (sig == SIGCHLD) continue;  // reap() runs after every wake-up
        if (!stopping_) {
          interrupted_by_ = sig;
          begin_stop(sig);
        } else if (!killed_) {
          // A second Ctrl-C means "now": skip the rest of the grace period.
          signal_all(SIGKILL);
          killed_ = true;
        }
      }
    }
  }

  void reap() {
    for (auto& w : workers_) {
      if (!w.running) continue;
      pid_t r;
      do {
        r = ::waitpid(w.pid, &w.status, WNOHANG);
      } while (r < 0 && errno == EINTR);
      if (r == 0) continue;
      w.running = false;
      if (r < 0) {
        // ECHILD: another thread of the host reaped it with waitpid(-1);
        // the exit status is lost.
        w.status = 0;
        continue;
      }
      const bool failed = !(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0);
      // Killed by the signal the launcher sent: the stop's doing. So is a
      // SIGPIPE after the stop began (its peers are gone: a rank that was
      // SIGSTOPped wakes on our SIGCONT, writes to a closed socket and dies
      // of it), and any signal that ends a rank we found stopped. An exit
      // status after the stop began may still be a root cause that merely
      // took longer to exit than its peers (decided in result()).
      const bool our_signal = stopping_ && WIFSIGNALED(w.status) &&
                              (WTERMSIG(w.status) == SIGTERM || WTERMSIG(w.status) == SIGKILL ||
                               WTERMSIG(w.status) == SIGPIPE || WTERMSIG(w.status) == interrupted_by_ ||
                               w.stopped_when_failing);
      if (failed && !our_signal) {
        w.failed = true;
        w.failed_ns = monotonic_ns();
      }
      if (failed && !stopping_) {
        failed_ = &w;
        begin_stop(SIGTERM);
      }
    }
  }

  std::string prefix(int64_t rank) const {
    return options_.prefix_output ? "[rank " + std::to_string(rank) + "] " : std::string();
  }

  // Forwards complete lines of `s.buffer`, or everything at EOF / when the
  // line grew past kMaxLine, one write per line: lines of different workers
  // never interleave mid-line, prefixed or not. Without a prefix, a last line
  // without newline is passed on as it is.
  void flush_lines(Stream& s, bool all) {
    Worker& w = owner(s);
    const std::string p = prefix(s.rank);
    size_t start = 0;
    for (;;) {
      const size_t nl = s.buffer.find('\n', start);
      size_t end;  // one past the bytes forwarded now
      bool add_newline = false;
      if (nl == std::string::npos) {
        if (start == s.buffer.size()) break;
        if (!all && s.buffer.size() - start < kMaxLine) break;
        end = s.buffer.size();
        add_newline = options_.prefix_output;
      } else {
        end = nl + 1;
      }
      std::string body = s.buffer.substr(start, end - start);
      if (&s == &w.streams[1]) {
        std::string trimmed = body;
        while (!trimmed.empty() && (trimmed.back() == '\n' || trimmed.back() == '\r')) trimmed.pop_back();
        if (!trimmed.empty()) s.last_line = trimmed.substr(0, 2000);
      }
      if (w.log_fd >= 0) write_log(w, body + (add_newline ? "\n" : ""));
      std::string line = p + body + (add_newline ? "\n" : "");
      write_all(s.out_fd, line.data(), line.size());
      start = end;
    }
    s.buffer.erase(0, start);
  }

  Worker& owner(Stream& s) {
    for (auto& w : workers_) {
      if (&s == &w.streams[0] || &s == &w.streams[1]) return w;
    }
    TORCH_INTERNAL_ASSERT(false, "launch(): stream without a worker");
  }

  // A log file that cannot be written (full disk) must not stop the job or
  // the forwarding to the terminal: say so once and stop logging that rank.
  void write_log(Worker& w, const std::string& text) {
    const char* data = text.data();
    size_t left = text.size();
    while (left > 0) {
      const ssize_t n = ::write(w.log_fd, data, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string msg = "launch: cannot write the log of rank " + std::to_string(w.rank) + " in '" +
                                options_.log_dir + "': " + (n < 0 ? errno_text(errno) : "no progress") +
                                "; that rank is no longer logged\n";
        write_all(2, msg.data(), msg.size());
        close_fd(w.log_fd);
        return;
      }
      data += n;
      left -= static_cast<size_t>(n);
    }
  }

  void pump(Stream& s) {
    char buf[65536];
    ssize_t n;
    do {
      n = ::read(s.fd, buf, sizeof buf);
    } while (n < 0 && errno == EINTR);
    if (n > 0) {
      s.buffer.append(buf, static_cast<size_t>(n));
      flush_lines(s, false);
    } else {
      // EOF (or an error, which leaves nothing more to read either).
      flush_lines(s, true);
      close_fd(s.fd);
    }
  }

  void drain(Stream& s) {
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
    flush_lines(s, true);
  }

  // The rank to blame: the earliest worker that recorded a failure of its own
  // (CONTRAX_ERROR_FILE); without any such record, the first worker seen
  // failing. A rank whose record says its collective failed is a consequence.
  const Worker* root_cause() const {
    const Worker* best = nullptr;
    int64_t best_ns = 0;
    // A record of its own counts even when the launcher's SIGTERM ended the
    // worker afterwards: it says when the worker began to fail.
    for (const auto& w : workers_) {
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
    for (const auto& w : workers_) {
      if (!w.failed || read_failure_record(w.error_file).present) continue;
      if (best == nullptr || w.failed_ns < best->failed_ns) best = &w;
    }
    return best != nullptr ? best : failed_;
  }

  LaunchResult result() const {
    LaunchResult r;
    const Worker* culprit = failed_ != nullptr ? root_cause() : nullptr;
    if (culprit != nullptr) {
      const int st = culprit->status;
      r.failed_rank = culprit->rank;
      if (WIFSIGNALED(st)) {
        r.exit_code = 128 + WTERMSIG(st);
        r.message = "rank " + std::to_string(culprit->rank) + " was killed by signal " +
                    std::to_string(WTERMSIG(st)) + " (" + ::strsignal(WTERMSIG(st)) + ")";
      } else {
        r.exit_code = WEXITSTATUS(st);
        r.message = "rank " + std::to_string(culprit->rank) + " exited with status " + std::to_string(r.exit_code);
      }
      if (!culprit->streams[1].last_line.empty()) r.message += ": " + culprit->streams[1].last_line;
      if (culprit != failed_) {
        r.message += " (it failed first; rank " + std::to_string(failed_->rank) + " exited before it)";
      }
      for (const auto& w : workers_) {
        if (w.stopped_when_failing) {
          r.message += "; rank " + std::to_string(w.rank) + " was stopped (SIGSTOP) when the job failed";
        }
      }
    } else if (interrupted_by_ != 0) {
      // The shell convention for "ended by signal N", so scripts see it as such.
      r.exit_code = 128 + interrupted_by_;
      r.message = "interrupted by signal " + std::to_string(interrupted_by_) + " (" + ::strsignal(interrupted_by_) +
                  "); workers stopped";
    }
    return r;
  }

 public:
  bool interrupted() const { return interrupted_by_ != 0 && failed_ == nullptr; }

 private:
  const LaunchOptions& options_;
  std::vector<Worker> workers_;
  int signal_read_ = -1, signal_write_ = -1;
  static constexpr std::array<int, 4> kHandled = {SIGINT, SIGTERM, SIGCHLD, SIGPIPE};
  std::array<struct sigaction, 4> saved_{};
  bool installed_ = false;
  bool stopping_ = false, killed_ = false;
  Clock::time_point kill_deadline_;
  int interrupted_by_ = 0;
  const Worker* failed_ = nullptr;
};

std::vector<std::string> worker_environment(const LaunchOptions& o, int64_t local_rank, int64_t port,
                                            int64_t restart, const std::string& error_file) {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    bool ours = std::any_of(kLauncherVars.begin(), kLauncherVars.end(), [&](const char* v) { return name == v; });
    if (!ours) env.push_back(entry);
  }
  env.push_back("RANK=" + std::to_string(o.node_rank * o.nproc + local_rank));
  env.push_back("LOCAL_RANK=" + std::to_string(local_rank));
  env.push_back("WORLD_SIZE=" + std::to_string(o.nnodes * o.nproc));
  env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(o.nproc));
  env.push_back("GROUP_RANK=" + std::to_string(o.node_rank));
  env.push_back("MASTER_ADDR=" + o.master_addr);
  env.push_back("MASTER_PORT=" + std::to_string(port));
  // torchrun's name for the attempt number, so a worker can tell a restart.
  env.push_back("TORCHELASTIC_RESTART_COUNT=" + std::to_string(restart));
  if (!error_file.empty()) env.push_back(std::string(kErrorFileVar) + "=" + error_file);
  return env;
}

// mkdir -p; errors name the directory.
void make_dirs(const std::string& dir) {
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    cur = dir.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "launch(): cannot create log directory '", cur, "': ", errno_text(errno));
    }
  }
}

// The per-launch directory of the workers' failure records, removed with it.
class ErrorFileDir {
 public:
  ErrorFileDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/contrax-launch-XXXXXX";
    if (::mkdtemp(&templ[0]) != nullptr) path_ = templ;  // without it, blame falls back to exit order
  }
  ~ErrorFileDir() {
    clear();
    if (!path_.empty()) ::rmdir(path_.c_str());
  }
  std::string file(int64_t rank) const {
    return path_.empty() ? std::string() : path_ + "/rank_" + std::to_string(rank);
  }
  // Records of a previous attempt must not blame a restarted worker.
  void clear() {
    for (const auto& f : files_) ::unlink(f.c_str());
  }
  void remember(const std::string& f) {
    if (!f.empty()) files_.push_back(f);
  }

 private:
  std::string path_;
  std::vector<std::string> files_;
};

}  // namespace

void record_worker_failure(bool caused_by_peer, const std::string& what) noexcept {
  const char* path = std::getenv(kErrorFileVar);
  if (path == nullptr || *path == '\0') return;
  // O_EXCL: the first record of the process is the one that tells when it
  // began failing; later ones (the unwinding after it) change nothing.
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return;
  std::string first = what.substr(0, what.find('\n'));
  std::string text = std::to_string(monotonic_ns()) + (caused_by_peer ? " peer\n" : " origin\n") + first + "\n";
  write_all(fd, text.data(), text.size());
  ::close(fd);
}

LaunchResult launch(const std::vector<std::string>& argv, const LaunchOptions& options) {
  TORCH_CHECK(!argv.empty() && !argv[0].empty(), "launch(): argument 'argv' must name a program, but got ",
              argv.empty() ? "an empty list" : "an empty program name");
  TORCH_CHECK(options.nproc >= 1, "launch(): argument 'nproc' must be >= 1, but got ", options.nproc);
  TORCH_CHECK(options.nnodes >= 1, "launch(): argument 'nnodes' must be >= 1, but got ", options.nnodes);
  TORCH_CHECK(options.node_rank >= 0 && options.node_rank < options.nnodes,
              "launch(): argument 'node_rank' must be in [0, nnodes) = [0, ", options.nnodes, "), but got ",
              options.node_rank);
  TORCH_CHECK(options.master_port >= 0 && options.master_port <= 65535,
              "launch(): argument 'master_port' must be in [0, 65535], but got ", options.master_port);
  // Another node cannot guess a port picked here.
  TORCH_CHECK(options.nnodes == 1 || options.master_port != 0,
              "launch(): argument 'master_port' must be set explicitly when nnodes > 1 (every node must agree on "
              "it), but got 0");
  TORCH_CHECK(!options.master_addr.empty(), "launch(): argument 'master_addr' must not be empty");
  TORCH_CHECK(options.grace.count() >= 0, "launch(): argument 'grace' must be >= 0 ms, but got ",
              options.grace.count(), " ms");
  TORCH_CHECK(options.max_restarts >= 0, "launch(): argument 'max_restarts' must be >= 0, but got ",
              options.max_restarts);

  std::lock_guard<std::mutex> lock(g_launch_mutex);
  std::vector<std::string> log_paths(static_cast<size_t>(options.nproc));
  if (!options.log_dir.empty()) {
    make_dirs(options.log_dir);
    for (int64_t local = 0; local < options.nproc; ++local) {
      const std::string path =
          options.log_dir + "/rank_" + std::to_string(options.node_rank * options.nproc + local) + ".log";
      // One launch, one log: truncated here, appended to by restarts.
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      TORCH_CHECK(fd >= 0, "launch(): cannot create log file '", path, "': ", errno_text(errno));
      ::close(fd);
      log_paths[static_cast<size_t>(local)] = path;
    }
  }
  ErrorFileDir error_dir;

  LaunchResult r;
  for (int64_t attempt = 0;; ++attempt) {
    // A fresh port per attempt when the launcher picks it: the previous
    // store's port may linger in TIME_WAIT or be taken meanwhile.
    const int64_t port = options.master_port != 0 ? options.master_port : find_free_port(options.master_addr);

    // Output the caller buffered so far must come before the workers' output.
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);

    error_dir.clear();
    bool interrupted = false;
    {
      Supervisor sup(options);
      sup.install_signals();
      for (int64_t local = 0; local < options.nproc; ++local) {
        const int64_t rank = options.node_rank * options.nproc + local;
        const std::string error_file = error_dir.file(rank);
        error_dir.remember(error_file);
        int exec_errno = sup.start(argv, rank, worker_environment(options, local, port, attempt, error_file),
                                   log_paths[static_cast<size_t>(local)], error_file);
        if (exec_errno != 0) {
          // Same program for every rank: once one cannot start, none can. The
          // Supervisor's destructor kills and reaps the ones already running.
          TORCH_CHECK(false, "launch(): cannot start '", argv[0], "': ", errno_text(exec_errno));
        }
      }
      r = sup.supervise();
      interrupted = sup.interrupted();
    }
    r.restarts = attempt;
    if (r.exit_code == 0 || interrupted || attempt >= options.max_restarts) break;
    const std::string note = "launch: " + r.message + "; restarting all workers (restart " +
                             std::to_string(attempt + 1) + " of " + std::to_string(options.max_restarts) + ")\n";
    write_all(2, note.data(), note.size());
    for (const auto& path : log_paths) {
      if (path.empty()) continue;
      const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
      if (fd >= 0) {
        write_all(fd, note.data(), note.size());
        ::close(fd);
      }
    }
  }
  return r;
}

int64_t find_free_port(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(addr.c_str(), "0", &hints, &found);
  TORCH_CHECK(rc == 0, "find_free_port(): cannot resolve '", addr, "': ", ::gai_strerror(rc));
  int last_errno = 0;
  int64_t port = -1;
  for (addrinfo* a = found; a != nullptr && port < 0; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      last_errno = errno;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  TORCH_CHECK(port > 0, "find_free_port(): cannot bind a socket on '", addr, "': ", errno_text(last_errno),
              " (is it an address of this machine?)");
  return port;
}

bool in_launched_worker() {
  auto set = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0';
  };
  // A task of an `srun` job step: SLURM started the workers (SLURM_STEP_ID
  // tells a step's task from the batch script, which must not wait for peers).
  return set("WORLD_SIZE") || (set("SLURM_NTASKS") && set("SLURM_PROCID") && set("SLURM_STEP_ID"));
}

std::string self_executable() {
  std::vector<char> buf(256);
  for (;;) {
    ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size());
    TORCH_CHECK(n >= 0, "self_executable(): cannot read /proc/self/exe: ", errno_text(errno));
    // readlink truncates silently: a full buffer may be a cut-off path.
    if (static_cast<size_t>(n) < buf.size()) return std::string(buf.data(), static_cast<size_t>(n));
    buf.resize(buf.size() * 2);
  }
}

}  // namespace contrax
