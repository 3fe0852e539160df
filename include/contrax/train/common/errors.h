// The trainer library's typed errors: what went wrong, with its numbers, so a
// caller maps each to its own words and exit status without reading the
// message. The library's messages name only its options (RunOptions::lr,
// ResumeMode); `contrax train` words them in its flags (apps/train/train_errors.cpp).
//
//   try {
//     contrax::train::train_contrastive(comm, data, options);
//   } catch (const contrax::train::Diverged& e) {
//     std::cerr << "stopped at step " << e.step << ", loss " << e.loss << "\n";
//   } catch (const contrax::train::TrainError& e) {
//     if (e.kind() == contrax::train::TrainErrorKind::kOutOfMemory) ...;
//   }
//
// Every one is a c10::Error: a caller that catches c10::Error (or
// std::exception) catches these too.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

namespace contrax::train {

/// What kind of problem a TrainError reports.
enum class TrainErrorKind {
  kDiverged,            ///< a step's loss or gradient was not finite, past those allowed to be skipped (Diverged)
  kOutOfMemory,         ///< an allocation failed during a step (OutOfMemory)
  kRecordLost,          ///< a write of the run's record failed (a full disk); the run stopped at a step boundary
  kCheckpointMismatch,  ///< a checkpoint to resume was written with other settings (CheckpointMismatch: the dtype)
  kDataUnreadable,      ///< a data file the recipe reads is missing or damaged
  kRunDirInUse,         ///< RunDirRefused: another live run holds the directory's lock
  kOverwriteAndResume,  ///< RunDirRefused: asked to overwrite the run and to resume it at once
  kNothingToResume,     ///< RunDirRefused: asked to resume (ResumeMode::kAlways), but there is no checkpoint
  kRunExists,           ///< RunDirRefused: the directory holds a run, neither resumed nor overwritten
  kRunDirUnsafe,        ///< RunDirRefused: the directory, or a run's file in it, is another user's or a link
};

/// A problem the trainer reports by kind: `fact()` says what happened (with
/// paths and numbers, and no advice), what() adds the library's advice in
/// terms of its options. A caller with other words for those options (a
/// command line's flags) writes its own advice after `fact()`.
class TrainError : public c10::Error {
 public:
  /// An error of `kind`: what() is `fact` followed by `advice` (which brings
  /// its own separator, "; ..." or " (...)"; empty: none).
  TrainError(TrainErrorKind kind, std::string fact, const std::string& advice = "");

  /// What kind of problem this is.
  TrainErrorKind kind() const noexcept { return kind_; }
  /// What happened, without advice: "run directory 'runs/a' already holds a run (checkpoint.pt)".
  const std::string& fact() const noexcept { return fact_; }

 private:
  TrainErrorKind kind_;
  std::string fact_;
};

/// How a stopped run's message says what it left: "nothing was saved" without
/// a run directory (empty `checkpoint`), else "the last good checkpoint PATH
/// is kept (if one was written)".
std::string kept_checkpoint(const std::string& checkpoint);

/// A step whose global loss or a gradient was not finite, with more such steps
/// than `RunOptions::skip_nonfinite` allows (kind kDiverged). The step was not
/// applied and no checkpoint written: the last one is the last good state.
/// Its fact(): "training diverged at step 3/8: the loss is not finite (loss
/// nan, lr 0.001)".
class Diverged : public TrainError {
 public:
  /// The divergence at `step` (from 1) of `total_steps`; `loss_finite`: only a
  /// gradient was not finite; `checkpoint`: the run's checkpoint file (empty:
  /// no run directory).
  Diverged(int64_t step, int64_t total_steps, double loss, double lr, bool loss_finite, int64_t skip_nonfinite,
           std::string checkpoint);

  int64_t step;            ///< the step that diverged, from 1
  int64_t total_steps;     ///< the schedule's length in steps
  double loss;             ///< the step's global loss (not finite unless `loss_finite`)
  double lr;               ///< the learning rate of the step
  bool loss_finite;        ///< true when the loss was finite and a gradient was not
  int64_t skip_nonfinite;  ///< how many non-finite steps the run was allowed to skip (all used up)
  std::string checkpoint;  ///< the run's checkpoint file, kept as it was; empty without a run directory
};

/// An allocation that failed during a step on this rank (kind kOutOfMemory).
/// No checkpoint was written: the last one is the last good state.
class OutOfMemory : public TrainError {
 public:
  /// The failure at `step` (from 1) of `total_steps` on `rank`, whose global
  /// batch had `rows` rows, up to `rows_per_rank` on one rank; `cause`: the
  /// allocator's first line; `checkpoint` as for Diverged.
  OutOfMemory(int64_t step, int64_t total_steps, int64_t rank, int64_t rows, int64_t rows_per_rank, std::string cause,
              std::string checkpoint);

  int64_t step;            ///< the step that failed, from 1
  int64_t total_steps;     ///< the schedule's length in steps
  int64_t rank;            ///< the rank whose allocation failed
  int64_t rows;            ///< rows in the step's global batch
  int64_t rows_per_rank;   ///< the most rows one rank had
  std::string cause;       ///< what the allocator said (its first line)
  std::string checkpoint;  ///< the run's checkpoint file, kept as it was; empty without a run directory
};

/// A checkpoint, asked to be resumed, that a run with other settings wrote
/// (kind kCheckpointMismatch): for now its training dtype.
class CheckpointMismatch : public TrainError {
 public:
  /// `checkpoint` was written with `setting` = `saved`; this run has `wanted`.
  CheckpointMismatch(std::string checkpoint, std::string setting, std::string saved, std::string wanted);

  std::string checkpoint;  ///< the checkpoint file
  std::string setting;     ///< the setting that differs, as RunOptions names it ("dtype")
  std::string saved;       ///< its value in the checkpoint ("float")
  std::string wanted;      ///< its value in this run ("double")
};

/// A start the run directory refuses because of what was asked (kinds
/// kRunDirInUse, kOverwriteAndResume, kNothingToResume, kRunExists,
/// kRunDirUnsafe): a
/// caller reports it as a usage error.
class RunDirRefused : public TrainError {
 public:
  /// The refusal of `kind` for the directory `path`; `fact` and `advice` as
  /// for TrainError; `detail`: see below.
  RunDirRefused(TrainErrorKind kind, std::string path, std::string detail, std::string fact, const std::string& advice);

  std::string path;  ///< the run directory
  /// kRunDirInUse: the pid of the run that holds it ("" when unknown);
  /// kNothingToResume: the checkpoint file looked for; kRunExists: the run's
  /// files found ("checkpoint.pt, metrics.jsonl"); else empty.
  std::string detail;
};

}  // namespace contrax::train
