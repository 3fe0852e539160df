// The run directory: every file a run of `contrax train` leaves, and the
// rules that keep one run from destroying another.
//
//   checkpoint.pt   the last checkpoint (every checkpoint_every steps, at the end, when stopped)
//   metrics.jsonl   one JSON object per step (metrics.h)
//   config.json     every setting, the versions and the world size (the tool)
//   train.log       what rank 0 printed (the tool)
//   results.json    the summary: evaluation table, exactness check, timings (the tool)
//   curves.png      loss, lr and throughput against steps (tools/plot_run.py)
//   .lock           flock'ed while a run uses the directory
//
// Every file is written atomically (checkpoint.h): a crash leaves the old file
// or the new one. No file is opened through a symbolic link: a directory
// that belongs to another user (or is a link another user made), and a
// link or another user's file where a run's file should be, are refused by
// name (RunDirRefused, kRunDirUnsafe) before anything is written. A directory that holds a run is refused unless the caller
// resumes or overwrites it; `ResumeMode::kAuto` resumes when there is a
// checkpoint and starts fresh otherwise, so a preempted job can be requeued
// with the same command.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <c10/macros/Macros.h>

#include "contrax/train/common/errors.h"

namespace contrax::train {

/// How a run starts in its directory: fresh, from the checkpoint, or from the
/// checkpoint when there is one.
enum class ResumeMode { kNever, kAlways, kAuto };

/// "never", "always" or "auto" (anything else reads as "never").
ResumeMode resume_mode(const std::string& name);

/// A run directory (an empty path: none, nothing is written).
///
///   contrax::train::RunDir dir("runs/a");
///   auto claim = dir.claim(contrax::train::ResumeMode::kAuto, /*overwrite=*/false);
///   ... train with resume = claim.resume; the lock is held while `claim` lives ...
///   dir.write("results.json", json);
class RunDir {
 public:
  /// A run directory at `path`; nothing is created until create() or claim().
  explicit RunDir(std::string path = "");

  /// The directory's path (empty: no run directory).
  const std::string& path() const { return path_; }
  /// True for the empty path: no run directory.
  bool empty() const { return path_.empty(); }
  /// PATH/NAME.
  std::string file(const std::string& name) const;
  /// Path of the run's checkpoint file.
  std::string checkpoint() const { return file(kCheckpoint); }
  /// Path of the run's metrics file (one JSON line per logged step).
  std::string metrics() const { return file(kMetrics); }

  static constexpr const char* kCheckpoint = "checkpoint.pt";  ///< file name of the checkpoint
  static constexpr const char* kMetrics = "metrics.jsonl";     ///< file name of the metrics (a line per logged step)
  static constexpr const char* kConfig = "config.json";        ///< file name of the run's configuration
  static constexpr const char* kLog = "train.log";             ///< file name of the training log
  static constexpr const char* kResults = "results.json";      ///< file name of the results (final evaluation)
  static constexpr const char* kCurves = "curves.png";         ///< file name of the plotted training curves
  /// The files a run writes (what overwriting removes; nothing else is touched).
  static const std::vector<std::string>& run_files();

  /// Whether the directory holds a checkpoint file.
  bool has_checkpoint() const;
  /// Creates the directory (and its parents); throws naming it and the cause.
  void create() const;
  /// Writes PATH/NAME atomically; throws naming the file and the cause.
  void write(const std::string& name, const std::string& bytes) const;
  /// Opens PATH/NAME for appending (created 0644 when absent; emptied first
  /// with `truncate`), following no link and refusing another user's file;
  /// returns the descriptor, which the caller closes.
  int open_append(const std::string& name, bool truncate) const;

  /// An exclusive flock on PATH/.lock for the life of the object. A second run
  /// on the same directory is refused (RunDirRefused) naming the directory and
  /// the pid of the run that holds it. The descriptor is close-on-exec, and
  /// the kernel drops the lock when the holder dies, however it dies.
  class Lock {
   public:
    /// Takes the lock on `dir` (whose directory must exist), or throws
    /// RunDirRefused naming the holder's pid.
    explicit Lock(const RunDir& dir);
    ~Lock();
    C10_DISABLE_COPY_AND_ASSIGN(Lock);

   private:
    int fd_ = -1;
  };

  /// What `claim` decided, and the lock, held while this lives.
  struct Claim {
    bool resume = false;         ///< whether the run resumes from the directory's checkpoint
    std::unique_ptr<Lock> lock;  ///< the directory's lock, held while the claim lives
  };

  /// For the process that starts a run (and its workers): refuses a resume
  /// without a checkpoint before anything is created, creates the directory,
  /// takes its lock, removes stale temporaries of killed writers, decides
  /// fresh or resume and, for a fresh start (`overwrite`, or kAuto without a
  /// checkpoint), removes the previous run's files. Refuses (RunDirRefused) an
  /// existing run without resume or overwrite, and overwrite with resume.
  Claim claim(ResumeMode mode, bool overwrite) const;

  /// Whether to resume, decided without touching the directory (for ranks
  /// other than the one that claimed it).
  bool resumes(ResumeMode mode) const;

 private:
  std::string path_;
};

/// Path of the checkpoint in a run directory: `RunDir(run_dir).checkpoint()`.
std::string checkpoint_path(const std::string& run_dir);

/// Path of the metrics file in a run directory: `RunDir(run_dir).metrics()`.
std::string metrics_path(const std::string& run_dir);

}  // namespace contrax::train
