// The local process launcher behind `contrax launch` (see contrax/launch/launcher.h):
// the options, the log files, and the attempts (restarting all workers after
// a failure, up to max_restarts); one attempt is a Supervisor
// (launch/supervisor.h). Also the worker's side: record_worker_failure.
#include "contrax/launch/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>

#include "launch/diagnosis.h"
#include "launch/out_of_memory.h"
#include "launch/posix.h"
#include "launch/spawn.h"
#include "launch/supervisor.h"
#include "util/secret.h"

namespace contrax {

namespace {

using detail::errno_text;

std::mutex g_launch_mutex;  // signal handlers are process-wide: one launch at a time

void check_options(const std::vector<std::string>& argv, const LaunchOptions& options) {
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
}

// DIR/rank_<rank>.log of every local rank, created empty ("" each without a
// log_dir): one launch, one log, appended to by restarts.
std::vector<std::string> create_logs(const LaunchOptions& options) {
  std::vector<std::string> paths(static_cast<size_t>(options.nproc));
  if (options.log_dir.empty()) return paths;
  detail::make_dirs(options.log_dir, "log directory");
  for (int64_t local = 0; local < options.nproc; ++local) {
    const std::string path =
        options.log_dir + "/rank_" + std::to_string(options.node_rank * options.nproc + local) + ".log";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    TORCH_CHECK(fd >= 0, "launch(): cannot create log file '", path, "': ", errno_text(errno));
    ::close(fd);
    paths[static_cast<size_t>(local)] = path;
  }
  return paths;
}

// One attempt: every local worker started and supervised to its end.
LaunchResult run_attempt(const std::vector<std::string>& argv, const LaunchOptions& options, int64_t attempt,
                         const std::vector<std::string>& log_paths, detail::ErrorFileDir& error_dir,
                         const std::string& secret, bool& interrupted) {
  // A fresh port per attempt when the launcher picks it: the previous
  // store's port may linger in TIME_WAIT or be taken meanwhile.
  const int64_t port = options.master_port != 0 ? options.master_port : find_free_port(options.master_addr);
  // Output the caller buffered so far must come before the workers' output.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  error_dir.clear();
  detail::Supervisor sup(options);
  for (int64_t local = 0; local < options.nproc; ++local) {
    const int64_t rank = options.node_rank * options.nproc + local;
    const std::string error_file = error_dir.file(rank);
    const int exec_errno = sup.start(argv, rank, detail::worker_environment(options, local, port, attempt, error_file, secret),
                                     log_paths[static_cast<size_t>(local)], error_file);
    // Same program for every rank: once one cannot start, none can. The
    // Supervisor's destructor kills and reaps the ones already running.
    TORCH_CHECK(exec_errno == 0, "launch(): cannot start '", argv[0], "': ", errno_text(exec_errno));
  }
  auto r = sup.supervise();
  interrupted = sup.interrupted();
  return r;
}

// The secret the workers' rendezvous store binds its keys to
// (CommunicatorOptions::job_secret): the user's CONTRAX_JOB_SECRET, else
// one made here for a one-node job. A job over several nodes needs the same
// secret on every node, which only the user can give: without one it runs
// as c10d does, open to whoever reaches the store, and says so.
std::string job_secret(const LaunchOptions& options) {
  const char* given = std::getenv(detail::kJobSecretVar);
  if (given != nullptr && *given != '\0') return given;
  if (options.nnodes == 1) return detail::random_hex(32);
  const std::string note = "launch: warning: no CONTRAX_JOB_SECRET is set for this " + std::to_string(options.nnodes) +
                           "-node job, so anyone who reaches its rendezvous store can read its keys, stop it or join "
                           "it as a rank; give every node the same secret (docs/reliability.md)\n";
  detail::write_all(2, note.data(), note.size());
  return "";
}

// Says on stderr, and in every log, that all workers restart after `r`.
void note_restart(const LaunchResult& r, int64_t attempt, const LaunchOptions& options,
                  const std::vector<std::string>& log_paths) {
  const std::string note = "launch: " + r.message + "; restarting all workers (restart " +
                           std::to_string(attempt + 1) + " of " + std::to_string(options.max_restarts) + ")\n";
  detail::write_all(2, note.data(), note.size());
  for (const auto& path : log_paths) {
    if (path.empty()) continue;
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NOFOLLOW);
    if (fd >= 0) {
      detail::write_all(fd, note.data(), note.size());
      ::close(fd);
    }
  }
}

}  // namespace

void record_worker_failure(bool caused_by_peer, const std::string& what) noexcept {
  const char* path = std::getenv(detail::kErrorFileVar);
  if (path == nullptr || *path == '\0') return;
  detail::write_failure_record(path, caused_by_peer, what);
}

void note_worker_memory(const std::string& what) noexcept {
  const char* path = std::getenv(detail::kErrorFileVar);
  if (path == nullptr || *path == '\0') return;
  const std::string file = detail::memory_note_file(path), text = what.substr(0, what.find('\n')) + "\n";
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return;
  detail::write_all(fd, text.data(), text.size());
  ::close(fd);
}

LaunchResult launch(const std::vector<std::string>& argv, const LaunchOptions& options) {
  check_options(argv, options);
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const auto log_paths = create_logs(options);
  detail::ErrorFileDir error_dir;
  const std::string secret = job_secret(options);
  LaunchResult r;
  for (int64_t attempt = 0;; ++attempt) {
    bool interrupted = false;
    r = run_attempt(argv, options, attempt, log_paths, error_dir, secret, interrupted);
    r.restarts = attempt;
    if (r.exit_code == 0 || interrupted || attempt >= options.max_restarts) break;
    note_restart(r, attempt, options, log_paths);
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
