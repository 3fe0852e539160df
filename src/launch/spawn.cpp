// Spawning a worker (see launch/spawn.h).
#include "launch/spawn.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cerrno>

#include "launch/posix.h"

extern char** environ;

namespace contrax::detail {

namespace {

// Variables the launcher owns; inherited copies are dropped so that a launch
// from inside a launched worker does not hand its children two RANKs.
constexpr std::array<const char*, 10> kLauncherVars = {
    "RANK",        "LOCAL_RANK",  "WORLD_SIZE",         "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", kErrorFileVar, kJobSecretVar};

constexpr int kWorkerOomScoreAdj = 1000;
constexpr char kWorkerOomScoreAdjText[] = "1000";

// The child between fork and exec: it may only make async-signal-safe calls,
// so everything it needs was prepared by the parent.
[[noreturn]] void exec_child(pid_t parent, const int out[2], const int err[2], const int exec_status[2],
                             char* const* argv, char* const* envp, const SignalPipe& signals,
                             const sigset_t& old_mask) {
  // Own process group: the launcher can stop the worker's whole tree, and
  // a Ctrl-C on the terminal reaches the launcher only, which forwards it
  // once instead of every process getting it twice.
  ::setpgid(0, 0);
  // Should the launcher itself be killed (SIGKILL cannot be forwarded),
  // its workers must not live on unsupervised.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);
  // Where memory runs out, the out-of-memory killer must take a worker, not
  // the launcher, which has to live to say what happened: a worker raises
  // its own score to the most (anyone may raise theirs). The killer ranks
  // by resident memory plus score / 1000 of the memory it may use, so a
  // worker at 1000 goes before the launcher, whose own resident memory
  // (LibTorch's libraries: about 500 MiB, 190 MiB of it anonymous, on PyPI
  // torch 2.15) is below that memory.
  if (const int adj = ::open("/proc/self/oom_score_adj", O_RDWR | O_CLOEXEC); adj >= 0) {
    // Parsed by hand: between fork and exec only async-signal-safe calls.
    char now[16] = {};
    const bool negative = ::read(adj, now, sizeof now - 1) > 0 && now[0] == '-';
    int value = 0;
    for (const char* c = now + (negative ? 1 : 0); *c >= '0' && *c <= '9'; ++c) value = value * 10 + (*c - '0');
    if (negative || value < kWorkerOomScoreAdj) {
      ssize_t ignored = ::pwrite(adj, kWorkerOomScoreAdjText, sizeof kWorkerOomScoreAdjText - 1, 0);
      (void)ignored;
    }
    ::close(adj);
  }
  signals.restore_dispositions();
  ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  // Workers run in a background process group, where reading the terminal
  // would stop them (SIGTTIN): give them no stdin.
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // dup2 clears CLOEXEC on fd 0 only
  if (devnull >= 0) ::dup2(devnull, 0);
  ::dup2(out[1], 1);
  ::dup2(err[1], 2);
  // glibc's execvpe searches PATH without allocating.
  ::execvpe(argv[0], argv, envp);
  int e = errno;
  ssize_t ignored = ::write(exec_status[1], &e, sizeof e);
  (void)ignored;
  ::_exit(127);
}

// The errno a failed exec sent through the exec-status pipe; 0 when the pipe
// closed by itself (the exec succeeded).
int exec_errno(int fd) {
  int value = 0;
  size_t got = 0;
  while (got < sizeof value) {
    ssize_t n = ::read(fd, reinterpret_cast<char*>(&value) + got, sizeof value - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  return got == sizeof value ? value : 0;
}

}  // namespace

std::vector<std::string> worker_environment(const LaunchOptions& o, int64_t local_rank, int64_t port,
                                            int64_t restart, const std::string& error_file,
                                            const std::string& secret) {
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
  // In the environment, which only this user (and root) can read
  // (/proc/<pid>/environ is 0400), never on a command line.
  if (!secret.empty()) env.push_back(std::string(kJobSecretVar) + "=" + secret);
  return env;
}

int spawn(Worker& w, const std::vector<std::string>& argv, const std::vector<std::string>& env,
          const SignalPipe& signals) {
  int out[2], err[2], exec_status[2];
  // CLOEXEC everywhere: a worker must not inherit another worker's pipe ends,
  // or that pipe would never see EOF. The read ends belong to `w` at once
  // (its owner closes them whichever way this leaves).
  TORCH_CHECK(::pipe2(out, O_CLOEXEC) == 0, "launch(): cannot create a pipe: ", errno_text(errno));
  w.streams[0].rank = w.streams[1].rank = w.rank;
  w.streams[0].fd = out[0];
  w.streams[0].out_fd = 1;
  w.streams[1].out_fd = 2;
  if (::pipe2(err, O_CLOEXEC) != 0) {
    int e = errno;
    ::close(out[1]);
    TORCH_CHECK(false, "launch(): cannot create a pipe: ", errno_text(e));
  }
  w.streams[1].fd = err[0];
  // The exec-status pipe closes by itself on a successful exec; a failed one
  // sends errno through it, so the launcher can report the real reason.
  if (::pipe2(exec_status, O_CLOEXEC) != 0) {
    int e = errno;
    ::close(out[1]);
    ::close(err[1]);
    TORCH_CHECK(false, "launch(): cannot create a pipe: ", errno_text(e));
  }
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
  for (int sig : SignalPipe::kHandled) sigaddset(&block, sig);
  ::pthread_sigmask(SIG_BLOCK, &block, &old_mask);
  pid_t pid = ::fork();
  if (pid == 0) exec_child(parent, out, err, exec_status, c_argv.data(), c_env.data(), signals, old_mask);
  ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  if (pid < 0) {
    int e = errno;
    ::close(out[1]);
    ::close(err[1]);
    ::close(exec_status[0]);
    ::close(exec_status[1]);
    TORCH_CHECK(false, "launch(): cannot fork: ", errno_text(e));
  }
  // Also from the parent: signalling the group must work even if the child
  // has not run its own setpgid yet.
  ::setpgid(pid, pid);
  w.pid = pid;
  w.running = true;
  ::close(out[1]);
  ::close(err[1]);
  ::close(exec_status[1]);
  const int result = exec_errno(exec_status[0]);
  ::close(exec_status[0]);
  return result;
}

}  // namespace contrax::detail
