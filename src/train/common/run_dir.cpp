// The run directory's files, lock and start decision (see run_dir.h).
#include "contrax/train/common/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cerrno>
#include <cstring>
#include <cstdio>
#include <filesystem>

#include "contrax/train/common/checkpoint.h"
#include "contrax/train/common/errors.h"
#include "util/files.h"

namespace fs = std::filesystem;

namespace contrax::train {

ResumeMode resume_mode(const std::string& s) {
  if (s == "always") return ResumeMode::kAlways;
  if (s == "auto") return ResumeMode::kAuto;
  return ResumeMode::kNever;
}

RunDir::RunDir(std::string path) : path_(std::move(path)) {}

std::string RunDir::file(const std::string& name) const { return path_ + "/" + name; }

const std::vector<std::string>& RunDir::run_files() {
  static const std::vector<std::string> files = {kCheckpoint, kMetrics, kConfig, kLog, kResults, kCurves};
  return files;
}

namespace {

// The run directory, opened: refused (kRunDirUnsafe) when it belongs to
// another user, or when its last component is a link that another user
// made (a link of one's own, runs -> /scratch/runs, is followed). Files in
// it are opened by name with O_NOFOLLOW (util/files.h).
contrax::detail::Directory open_dir(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode) && st.st_uid != ::geteuid()) {
    throw RunDirRefused(TrainErrorKind::kRunDirUnsafe, path, "",
                        c10::str("run directory '", path, "' is a symbolic link made by another user (uid ",
                                 st.st_uid, "); Contrax follows no link it did not make"),
                        "; choose a directory of your own");
  }
  try {
    return contrax::detail::Directory(path, "run directory", /*owned=*/true);
  } catch (const c10::Error& e) {
    if (::lstat(path.c_str(), &st) != 0 || st.st_uid == ::geteuid()) throw;
    throw RunDirRefused(TrainErrorKind::kRunDirUnsafe, path, "", e.what_without_backtrace(), "");
  }
}

// Every run file (and the lock) is refused by name where it is a link or
// another user's, before anything is opened, truncated or removed.
void check_run_files(const contrax::detail::Directory& d, const std::string& path) {
  for (const auto& f : RunDir::run_files()) {
    try {
      d.check_entry(f);
    } catch (const c10::Error& e) {
      throw RunDirRefused(TrainErrorKind::kRunDirUnsafe, path, f, e.what_without_backtrace(), "");
    }
  }
}

}  // namespace

bool RunDir::has_checkpoint() const {
  struct stat st {};
  return ::lstat(checkpoint().c_str(), &st) == 0;
}

void RunDir::create() const {
  std::error_code ec;
  fs::create_directories(path_, ec);
  TORCH_CHECK(!ec, "cannot create run directory '", path_, "': ", ec.message());
  open_dir(path_);
}

void RunDir::write(const std::string& name, const std::string& bytes) const {
  try {
    open_dir(path_).write_atomically(name, bytes);
  } catch (const RunDirRefused&) {
    throw;
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "cannot write ", file(name), ": ", e.what_without_backtrace());
  }
}

int RunDir::open_append(const std::string& name, bool truncate) const {
  return open_dir(path_).open(name, O_WRONLY | O_APPEND | O_CREAT | (truncate ? O_TRUNC : 0)).release();
}

// The lock file is never truncated: the holder's pid is written over its
// first bytes, padded to a fixed width, and only once the lock is held.
RunDir::Lock::Lock(const RunDir& dir) {
  const auto d = open_dir(dir.path());
  const std::string path = dir.file(".lock");
  try {
    d.check_entry(".lock");
    fd_ = d.open(".lock", O_RDWR | O_CREAT, 0600).release();
  } catch (const c10::Error& e) {
    throw RunDirRefused(TrainErrorKind::kRunDirUnsafe, dir.path(), ".lock", e.what_without_backtrace(), "");
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
    holder = holder.substr(0, holder.find_first_not_of("0123456789"));
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(err == EWOULDBLOCK, "cannot lock ", path, ": ", std::strerror(err));
    throw RunDirRefused(TrainErrorKind::kRunDirInUse, dir.path(), holder,
                        c10::str("run directory '", dir.path(), "' is in use by another run",
                                 holder.empty() ? std::string() : " (pid " + holder + ")"),
                        "; wait for it to finish or choose another run directory");
  }
  // The holder's pid, for the message above (the lock itself is the flock).
  char pid[24];
  const int len = std::snprintf(pid, sizeof pid, "%-20d\n", static_cast<int>(::getpid()));
  if (::pwrite(fd_, pid, static_cast<size_t>(len), 0) < 0) {
    // Only the message of a competing run loses its pid; the lock holds.
  }
}

RunDir::Lock::~Lock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

bool RunDir::resumes(ResumeMode mode) const {
  return mode == ResumeMode::kAlways || (mode == ResumeMode::kAuto && has_checkpoint());
}

RunDir::Claim RunDir::claim(ResumeMode mode, bool overwrite) const {
  if (overwrite && mode != ResumeMode::kNever) {
    throw RunDirRefused(TrainErrorKind::kOverwriteAndResume, path_, "", "overwriting and resuming exclude each other",
                        " (overwriting starts the run again)");
  }
  // Before the directory is created: a mistyped path asked to resume must
  // not leave a new empty directory behind.
  if (mode == ResumeMode::kAlways && !has_checkpoint()) {
    throw RunDirRefused(TrainErrorKind::kNothingToResume, path_, checkpoint(),
                        c10::str("no checkpoint ", checkpoint(), " to resume from"),
                        " (ResumeMode::kAuto starts fresh when there is none)");
  }
  create();
  const auto d = open_dir(path_);
  Claim c;
  c.lock = std::make_unique<Lock>(*this);
  check_run_files(d, path_);
  for (const auto& f : run_files()) d.remove_stale_temporaries(f);
  c.resume = resumes(mode);
  if (c.resume) return c;
  std::string present;
  for (const char* f : {kCheckpoint, kMetrics, kResults}) {
    if (d.exists(f)) present += (present.empty() ? "" : ", ") + std::string(f);
  }
  if (!present.empty() && mode == ResumeMode::kNever && !overwrite) {
    throw RunDirRefused(TrainErrorKind::kRunExists, path_, present,
                        c10::str("run directory '", path_, "' already holds a run (", present, ")"),
                        "; continue it (ResumeMode::kAlways or kAuto), or replace it (overwrite)");
  }
  // Fresh: overwriting, or ResumeMode::kAuto after a run that never reached its
  // first checkpoint. Only the run's own files go.
  for (const auto& f : run_files()) d.remove(f);
  return c;
}

std::string checkpoint_path(const std::string& run_dir) { return RunDir(run_dir).checkpoint(); }

std::string metrics_path(const std::string& run_dir) { return RunDir(run_dir).metrics(); }

}  // namespace contrax::train
