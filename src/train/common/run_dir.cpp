// The run directory's files, lock and start decision (see run_dir.h).
#include "contrax/train/common/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "contrax/train/common/checkpoint.h"
#include "contrax/train/common/errors.h"

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

bool RunDir::has_checkpoint() const {
  std::error_code ec;
  return fs::exists(checkpoint(), ec);
}

void RunDir::create() const {
  std::error_code ec;
  fs::create_directories(path_, ec);
  TORCH_CHECK(!ec, "cannot create run directory '", path_, "': ", ec.message());
}

void RunDir::write(const std::string& name, const std::string& bytes) const {
  try {
    write_file_atomically(file(name), bytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "cannot write ", file(name), ": ", e.what_without_backtrace());
  }
}

RunDir::Lock::Lock(const RunDir& dir) {
  const std::string path = dir.file(".lock");
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot open the run directory's lock file ", path, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    std::ifstream(path) >> holder;
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(err == EWOULDBLOCK, "cannot lock ", path, ": ", std::strerror(err));
    throw RunDirRefused(TrainErrorKind::kRunDirInUse, dir.path(), holder,
                        c10::str("run directory '", dir.path(), "' is in use by another run",
                                 holder.empty() ? std::string() : " (pid " + holder + ")"),
                        "; wait for it to finish or choose another run directory");
  }
  // The holder's pid, for the message above (the lock itself is the flock).
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
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
  Claim c;
  c.lock = std::make_unique<Lock>(*this);
  for (const auto& f : run_files()) remove_stale_temporaries(file(f));
  c.resume = resumes(mode);
  if (c.resume) return c;
  std::string present;
  for (const char* f : {kCheckpoint, kMetrics, kResults}) {
    std::error_code ec;
    if (fs::exists(file(f), ec)) present += (present.empty() ? "" : ", ") + std::string(f);
  }
  if (!present.empty() && mode == ResumeMode::kNever && !overwrite) {
    throw RunDirRefused(TrainErrorKind::kRunExists, path_, present,
                        c10::str("run directory '", path_, "' already holds a run (", present, ")"),
                        "; continue it (ResumeMode::kAlways or kAuto), or replace it (overwrite)");
  }
  // Fresh: overwriting, or ResumeMode::kAuto after a run that never reached its
  // first checkpoint. Only the run's own files go.
  for (const auto& f : run_files()) {
    std::error_code ec;
    fs::remove(file(f), ec);
    TORCH_CHECK(!ec, "cannot remove ", file(f), ": ", ec.message());
  }
  return c;
}

std::string checkpoint_path(const std::string& run_dir) { return RunDir(run_dir).checkpoint(); }

std::string metrics_path(const std::string& run_dir) { return RunDir(run_dir).metrics(); }

}  // namespace contrax::train
