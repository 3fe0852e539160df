#include "run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "cli.h"
#include "contrax/launcher.h"
#include "contrax/train/common/checkpoint.h"

namespace fs = std::filesystem;

namespace contrax::cli {

const std::vector<std::string>& run_files() {
  static const std::vector<std::string> files = {"checkpoint.pt", "metrics.jsonl", "config.json",
                                                 "train.log",     "results.json",  "curves.png"};
  return files;
}

ResumeMode parse_resume_mode(const std::string& s) {
  if (s == "always") return ResumeMode::kAlways;
  if (s == "auto") return ResumeMode::kAuto;
  return ResumeMode::kNever;
}

RunDirLock::RunDirLock(const std::string& dir) {
  const std::string path = dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot open the run directory's lock file ", path, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    std::ifstream(path) >> holder;
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(err == EWOULDBLOCK, "cannot lock ", path, ": ", std::strerror(err));
    throw UsageError(c10::str("run directory '", dir, "' is in use by another run",
                              holder.empty() ? std::string() : " (pid " + holder + ")",
                              "; wait for it to finish or choose another --run-dir"));
  }
  // The holder's pid, for the message above (the lock itself is the flock).
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
    // Only the message of a competing run loses its pid; the lock holds.
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

namespace {

bool exists(const std::string& dir, const std::string& name) {
  std::error_code ec;
  return fs::exists(dir + "/" + name, ec);
}

void remove_run_files(const std::string& dir) {
  for (const auto& f : run_files()) {
    std::error_code ec;
    fs::remove(dir + "/" + f, ec);
    TORCH_CHECK(!ec, "cannot remove ", dir, "/", f, ": ", ec.message());
  }
}

}  // namespace

bool resolve_resume(const std::string& dir, ResumeMode mode) {
  if (mode == ResumeMode::kAuto) return exists(dir, "checkpoint.pt");
  return mode == ResumeMode::kAlways;
}

bool prepare_run_dir(const std::string& dir, ResumeMode mode, bool overwrite) {
  usage_check(!(overwrite && mode != ResumeMode::kNever),
              "flags '--overwrite' and '--resume' exclude each other (--overwrite starts the run again)");
  const std::string ckpt = dir + "/checkpoint.pt";
  usage_check(mode != ResumeMode::kAlways || exists(dir, "checkpoint.pt"), "flag '--resume': no checkpoint ", ckpt,
              " to resume from (--resume auto starts fresh when there is none)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec, "cannot create run directory '", dir, "': ", ec.message());
  for (const auto& f : run_files()) contrax::train::remove_stale_temporaries(dir + "/" + f);
  std::vector<std::string> present;
  for (const char* f : {"checkpoint.pt", "metrics.jsonl", "results.json"}) {
    if (exists(dir, f)) present.push_back(f);
  }
  if (mode == ResumeMode::kAlways) return true;
  if (mode == ResumeMode::kAuto && exists(dir, "checkpoint.pt")) return true;
  if (!present.empty() && mode == ResumeMode::kNever && !overwrite) {
    std::string list;
    for (const auto& f : present) list += (list.empty() ? "" : ", ") + f;
    throw UsageError(c10::str("run directory '", dir, "' already holds a run (", list,
                              "); continue it with --resume (or --resume auto), or replace it with --overwrite"));
  }
  // Fresh: --overwrite, or --resume auto after a run that never reached its
  // first checkpoint. Only the run's own files go.
  remove_run_files(dir);
  return false;
}

void write_run_file(const std::string& dir, const std::string& name, const std::string& bytes) {
  try {
    contrax::train::write_file_atomically(dir + "/" + name, bytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "cannot write ", dir, "/", name, ": ", e.what_without_backtrace());
  }
}

std::string plot_script() {
  if (const char* env = std::getenv("CONTRAX_PLOT_SCRIPT")) return env;
  const fs::path exe_dir = fs::path(contrax::self_executable()).parent_path();
  for (const fs::path& p : {exe_dir / "plot_run.py", exe_dir / "../share/contrax/plot_run.py"}) {
    std::error_code ec;
    if (fs::exists(p, ec)) return p.lexically_normal().string();
  }
  return "";
}

int plot_run(const std::string& dir, bool quiet) {
  const std::string script = plot_script();
  if (script.empty()) {
    std::cerr << "contrax plot: the plotting script plot_run.py is not next to " << contrax::self_executable()
              << " nor in ../share/contrax (set CONTRAX_PLOT_SCRIPT)\n";
    return 1;
  }
  // Debian's interpreter, where python3-matplotlib installs matplotlib (a
  // python3 earlier on PATH, e.g. pyenv's, would not see it).
  std::string python = "python3";
  if (const char* env = std::getenv("CONTRAX_PYTHON")) {
    python = env;
  } else if (::access("/usr/bin/python3", X_OK) == 0) {
    python = "/usr/bin/python3";
  }
  const pid_t pid = ::fork();
  TORCH_CHECK(pid >= 0, "cannot start ", python, ": ", std::strerror(errno));
  if (pid == 0) {
    if (quiet) {
      const int devnull = ::open("/dev/null", O_WRONLY);
      if (devnull >= 0) ::dup2(devnull, STDOUT_FILENO);
    }
    ::execlp(python.c_str(), python.c_str(), script.c_str(), dir.c_str(), static_cast<char*>(nullptr));
    std::fprintf(stderr, "contrax plot: cannot run %s: %s (apt-get install python3 python3-matplotlib)\n",
                 python.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace contrax::cli
