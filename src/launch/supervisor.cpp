// The supervisor of one launch attempt (see launch/supervisor.h).
#include "launch/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>

#include "launch/diagnosis.h"
#include "launch/posix.h"
#include "launch/spawn.h"

namespace contrax::detail {

using Clock = std::chrono::steady_clock;

Supervisor::Supervisor(const LaunchOptions& options)
    : grace_(options.grace), output_{options.prefix_output, options.log_dir} {
  // Reserving keeps pointers into workers_ (failed_, the streams supervise()
  // polls) valid while workers are added.
  workers_.reserve(static_cast<size_t>(options.nproc));
  signals_.install();
}

Supervisor::~Supervisor() {
  // Normal returns have reaped everyone already; this is for exceptions.
  signal_all(SIGKILL);
  for (auto& w : workers_) {
    if (w.running) wait_blocking(w);
    for (auto& s : w.streams) close_fd(s.fd);
    close_fd(w.log_fd);
  }
  signals_.restore();
}

int Supervisor::start(const std::vector<std::string>& argv, int64_t rank, const std::vector<std::string>& env,
                      const std::string& log_path, const std::string& error_file) {
  Worker w;
  w.rank = rank;
  w.error_file = error_file;
  if (!log_path.empty()) {
    w.log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644);
    TORCH_CHECK(w.log_fd >= 0, "launch(): cannot open log file '", log_path, "': ", errno_text(errno));
  }
  workers_.push_back(std::move(w));  // from here on the destructor closes its descriptors
  return spawn(workers_.back(), argv, env, signals_);
}

LaunchResult Supervisor::supervise() {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> streams;
  const auto poll_period = std::chrono::milliseconds(200);
  while (any_running()) {
    fds.clear();
    streams.clear();
    fds.push_back({signals_.read_fd(), POLLIN, 0});
    for (auto& w : workers_) {
      for (auto& s : w.streams) {
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          streams.emplace_back(&w, &s);
        }
      }
    }
    // SIGCHLD wakes the loop; the period is only a backstop.
    auto timeout = poll_period;
    if (stopping_ && !killed_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          (deferring_ ? std::min(kill_deadline_, deferred_deadline_) : kill_deadline_) - Clock::now());
      timeout = std::max(std::chrono::milliseconds(0), std::min(timeout, left));
    }
    int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
    TORCH_CHECK(n >= 0 || errno == EINTR, "launch(): poll failed: ", errno_text(errno));
    if (n > 0) {
      if (fds[0].revents) signals_.drain([&](int sig) { handle_signal(sig); });
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents) pump(*streams[i - 1].first, *streams[i - 1].second, output_);
      }
    }
    reap();
    if (deferring_ && Clock::now() >= deferred_deadline_) end_deferral();
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
  // What the workers wrote is still in the pipes.
  for (auto& w : workers_) {
    for (auto& s : w.streams) {
      drain(w, s, output_);
      close_fd(s.fd);
    }
  }
  return summarize(workers_, failed_, interrupted_by_, oom_);
}

bool Supervisor::any_running() const {
  return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; });
}

void Supervisor::wait_blocking(Worker& w) {
  while (::waitpid(w.pid, &w.status, 0) < 0) {
    if (errno != EINTR) break;  // ECHILD: another thread of the host reaped it
  }
  w.running = false;
}

// Signals the process group of every worker still running; what exited
// workers left behind is swept once all are reaped (end of supervise()).
void Supervisor::signal_all(int sig) {
  for (auto& w : workers_) {
    if (!w.running || (w.stop_deferred && sig != SIGKILL)) continue;
    ::kill(-w.pid, sig);
    // A SIGSTOPped worker would hold SIGTERM pending until the grace period
    // ends in SIGKILL; continuing it lets it act on the request now.
    if (sig != SIGKILL) ::kill(-w.pid, SIGCONT);
  }
}

void Supervisor::begin_stop(int sig) {
  stopping_ = true;
  kill_deadline_ = Clock::now() + grace_;
  // Noted before the SIGCONT below: a stopped rank is the likely reason its
  // peers' collectives timed out.
  for (auto& w : workers_) {
    if (w.running && process_stopped(w.pid)) w.stopped_when_failing = true;
    // A failure stop (not an interruption): a rank failing on its own exits
    // by itself, with its own status (SIGTERMed, a usage error would read 143).
    if (w.running && interrupted_by_ == 0 && !w.stopped_when_failing && failed_on_its_own(w)) {
      w.stop_deferred = true;
      deferring_ = true;
    }
  }
  deferred_deadline_ = Clock::now() + std::min<std::chrono::milliseconds>(grace_, std::chrono::seconds(5));
  signal_all(sig);
}

void Supervisor::end_deferral() {
  deferring_ = false;
  for (auto& w : workers_) {
    if (!w.stop_deferred) continue;
    w.stop_deferred = false;
    if (w.running) {
      ::kill(-w.pid, SIGTERM);
      ::kill(-w.pid, SIGCONT);
    }
  }
}

void Supervisor::handle_signal(int sig) {
  if (sig == SIGCHLD) return;  // reap() runs after every wake-up
  if (!stopping_) {
    interrupted_by_ = sig;
    begin_stop(sig);
  } else if (!killed_) {
    // A second Ctrl-C means "now": skip the rest of the grace period.
    signal_all(SIGKILL);
    killed_ = true;
  }
}

void Supervisor::reap() {
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
    // of it; Gloo's threads block SIGPIPE, a user's program's own writes
    // may not), and any signal that ends a rank we found stopped. An exit
    // status after the stop began may still be a root cause that merely
    // took longer to exit than its peers (decided in summarize()).
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

}  // namespace contrax::detail
