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
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
constexpr std::array<const char*, 7> kLauncherVars = {"RANK",       "LOCAL_RANK",  "WORLD_SIZE",
                                                     "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                                     "MASTER_PORT"};

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
};

struct Worker {
  int64_t rank = 0;
  pid_t pid = -1;  // also the worker's process-group id
  bool running = false;
  int status = 0;  // waitpid status once !running
  std::array<Stream, 2> streams;
};

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
  int start(const std::vector<std::string>& argv, int64_t rank, const std::vector<std::string>& env) {
    Worker w;
    w.rank = rank;
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
      if (w.running) ::kill(-w.pid, sig);
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
      bool failed = !(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0);
      // Exits after the stop began are the stop's doing, not new failures.
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
  // line grew past kMaxLine. Prefixing per line keeps concurrent workers'
  // output readable; unprefixed output needs no line discipline.
  void flush_lines(Stream& s, bool all) {
    if (!options_.prefix_output) {
      write_all(s.out_fd, s.buffer.data(), s.buffer.size());
      s.buffer.clear();
      return;
    }
    const std::string p = prefix(s.rank);
    size_t start = 0;
    for (;;) {
      size_t nl = s.buffer.find('\n', start);
      if (nl == std::string::npos) {
        if (!all && s.buffer.size() - start < kMaxLine) break;
        if (start == s.buffer.size()) break;
        std::string line = p + s.buffer.substr(start) + "\n";
        write_all(s.out_fd, line.data(), line.size());
        start = s.buffer.size();
        break;
      }
      std::string line = p + s.buffer.substr(start, nl + 1 - start);
      write_all(s.out_fd, line.data(), line.size());
      start = nl + 1;
    }
    s.buffer.erase(0, start);
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

  LaunchResult result() const {
    LaunchResult r;
    if (failed_ != nullptr) {
      const int st = failed_->status;
      r.failed_rank = failed_->rank;
      if (WIFSIGNALED(st)) {
        r.exit_code = 128 + WTERMSIG(st);
        r.message = "rank " + std::to_string(failed_->rank) + " was killed by signal " +
                    std::to_string(WTERMSIG(st)) + " (" + ::strsignal(WTERMSIG(st)) + ")";
      } else {
        r.exit_code = WEXITSTATUS(st);
        r.message = "rank " + std::to_string(failed_->rank) + " exited with status " + std::to_string(r.exit_code);
      }
    } else if (interrupted_by_ != 0) {
      // The shell convention for "ended by signal N", so scripts see it as such.
      r.exit_code = 128 + interrupted_by_;
      r.message = "interrupted by signal " + std::to_string(interrupted_by_) + " (" + ::strsignal(interrupted_by_) +
                  "); workers stopped";
    }
    return r;
  }

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

std::vector<std::string> worker_environment(const LaunchOptions& o, int64_t local_rank, int64_t port) {
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
  return env;
}

}  // namespace

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

  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const int64_t port = options.master_port != 0 ? options.master_port : find_free_port(options.master_addr);

  // Output the caller buffered so far must come before the workers' output.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);

  Supervisor sup(options);
  sup.install_signals();
  for (int64_t local = 0; local < options.nproc; ++local) {
    int exec_errno = sup.start(argv, options.node_rank * options.nproc + local, worker_environment(options, local, port));
    if (exec_errno != 0) {
      // Same program for every rank: once one cannot start, none can. The
      // Supervisor's destructor kills and reaps the ones already running.
      TORCH_CHECK(false, "launch(): cannot start '", argv[0], "': ", errno_text(exec_errno));
    }
  }
  return sup.supervise();
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

bool in_launched_worker() { return std::getenv("WORLD_SIZE") != nullptr; }

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
