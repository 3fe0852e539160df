// The run directory of `contrax train`: what a run leaves, and the rules that
// keep one run from destroying another.
//
//   checkpoint.pt   the last checkpoint (every --checkpoint-every steps, at the end, when stopped)
//   metrics.jsonl   one JSON object per step (contrax/train/common/metrics.h)
//   config.json     every setting, the versions and the world size
//   train.log       what rank 0 printed
//   results.json    the summary: evaluation table, exactness check, timings
//   curves.png      loss, lr and throughput against steps (tools/plot_run.py)
//   .lock           flock'ed while a run uses the directory
//
// An existing run is never overwritten by accident: without --resume it is
// refused (naming --resume and --overwrite); --resume auto continues from the
// checkpoint when there is one and starts fresh when there is none, so a
// preempted job can be requeued with the same command.
#pragma once

#include <string>
#include <vector>

namespace contrax::cli {

/// The files a run writes (removed by --overwrite; nothing else is touched).
const std::vector<std::string>& run_files();

/// "never" (default), "always" (bare --resume) or "auto".
enum class ResumeMode { kNever, kAlways, kAuto };
ResumeMode parse_resume_mode(const std::string& s);

/// An exclusive flock on RUN_DIR/.lock for the life of the object. A second
/// run on the same directory gets an error naming the directory and the pid
/// of the run that holds it. The lock file's descriptor is close-on-exec,
/// and the kernel drops the lock when the holder dies, however it dies.
class RunDirLock {
 public:
  explicit RunDirLock(const std::string& dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

/// Decides whether a run starts fresh or resumes, and prepares the directory
/// (created; stale temporaries of killed writers removed; with --overwrite, or
/// --resume auto without a checkpoint, the old run's files removed). Throws
/// UsageError for an existing run without --resume/--overwrite, --resume
/// without a checkpoint, and --overwrite together with --resume. Returns true
/// to resume. Call with the lock held.
bool prepare_run_dir(const std::string& dir, ResumeMode mode, bool overwrite);

/// Whether to resume, decided without touching the directory (for ranks
/// other than the one that prepared it).
bool resolve_resume(const std::string& dir, ResumeMode mode);

/// Writes `bytes` to DIR/NAME atomically; throws naming the path and cause.
void write_run_file(const std::string& dir, const std::string& name, const std::string& bytes);

/// The plotting script: next to the executable (copied there by the build),
/// in ../share/contrax (installed), or $CONTRAX_PLOT_SCRIPT. Empty if none.
std::string plot_script();

/// Draws DIR/curves.png from DIR/metrics.jsonl with python3 + matplotlib.
/// Returns 0 on success; otherwise prints why (matplotlib missing: how to
/// install it) and returns the script's status.
int plot_run(const std::string& dir, bool quiet);

}  // namespace contrax::cli
