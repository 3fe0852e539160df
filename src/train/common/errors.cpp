// The trainer's typed errors and their messages in the library's own terms
// (see errors.h); the tool's messages are in apps/train/train_errors.cpp.
#include "contrax/train/common/errors.h"

#include <c10/util/StringUtil.h>

#include <utility>

#include "contrax/train/common/loop.h"

namespace contrax::train {

TrainError::TrainError(TrainErrorKind kind, std::string fact, const std::string& advice)
    : c10::Error(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, fact + advice),
      kind_(kind),
      fact_(std::move(fact)) {}

std::string kept_checkpoint(const std::string& checkpoint) {
  return checkpoint.empty() ? std::string("nothing was saved")
                            : "the last good checkpoint " + checkpoint + " is kept (if one was written)";
}

Diverged::Diverged(int64_t step, int64_t total, double loss, double lr, bool loss_finite, int64_t skip,
                   std::string checkpoint)
    : TrainError(TrainErrorKind::kDiverged,
                 c10::str("training diverged at step ", step, "/", total, ": the ", loss_finite ? "gradient" : "loss",
                          " is not finite (loss ", plain_nan(loss), ", lr ", lr, ")"),
                 c10::str("; ", skip > 0 ? c10::str("more than the allowed ", skip, " non-finite steps; ") : "",
                          kept_checkpoint(checkpoint),
                          "; lower the learning rate (lr) or allow skipping such steps (skip_nonfinite)")),
      step(step),
      total_steps(total),
      loss(loss),
      lr(lr),
      loss_finite(loss_finite),
      skip_nonfinite(skip),
      checkpoint(std::move(checkpoint)) {}

OutOfMemory::OutOfMemory(int64_t step, int64_t total, int64_t rank, int64_t rows, int64_t rows_per_rank,
                         std::string cause, std::string checkpoint)
    : TrainError(TrainErrorKind::kOutOfMemory,
                 c10::str("step ", step, "/", total, " ran out of memory on rank ", rank, " (", rows,
                          " rows in the global batch, up to ", rows_per_rank, " per rank): ", cause),
                 c10::str("; use a smaller batch size (batch_size), or a gradient cache (a recipe's chunk size keeps ",
                          "the activations of that many rows at a time); ", kept_checkpoint(checkpoint))),
      step(step),
      total_steps(total),
      rank(rank),
      rows(rows),
      rows_per_rank(rows_per_rank),
      cause(std::move(cause)),
      checkpoint(std::move(checkpoint)) {}

CheckpointMismatch::CheckpointMismatch(std::string checkpoint, std::string setting, std::string saved,
                                       std::string wanted)
    : TrainError(TrainErrorKind::kCheckpointMismatch,
                 c10::str("checkpoint ", checkpoint, " was written with ", setting, " ", saved, "; this run has ",
                          setting, " ", wanted),
                 " (resume with the same settings)"),
      checkpoint(std::move(checkpoint)),
      setting(std::move(setting)),
      saved(std::move(saved)),
      wanted(std::move(wanted)) {}

RunDirRefused::RunDirRefused(TrainErrorKind kind, std::string path, std::string detail, std::string fact,
                             const std::string& advice)
    : TrainError(kind, std::move(fact), advice), path(std::move(path)), detail(std::move(detail)) {}

}  // namespace contrax::train
