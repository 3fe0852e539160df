// The trainer library's typed errors in the words of `contrax train`
// (train_errors.h): where the library says "the learning rate (lr)", the tool
// says --lr. The texts are the ones the tool printed when the library still
// wrote them, and its tests assert them.
#include "train/train_errors.h"

#include <c10/util/StringUtil.h>

#include <map>
#include <stdexcept>

#include "cli/cli.h"

namespace contrax::cli {

namespace {

namespace ct = contrax::train;

// The flag of each setting a checkpoint records (RunOptions' names).
std::string flag_of_setting(const std::string& setting) {
  static const std::map<std::string, std::string> flags = {{"dtype", "--dtype"}};
  const auto it = flags.find(setting);
  return it != flags.end() ? it->second : setting;
}

std::string diverged_message(const ct::Diverged& e) {
  return c10::str(e.fact(), "; ",
                  e.skip_nonfinite > 0
                      ? c10::str("more than the allowed ", e.skip_nonfinite, " non-finite steps (--skip-nonfinite); ")
                      : "",
                  ct::kept_checkpoint(e.checkpoint), "; lower --lr or allow skipping with --skip-nonfinite N");
}

}  // namespace

std::string train_error_message(const ct::TrainError& e, const std::string& data_hint) {
  using K = ct::TrainErrorKind;
  switch (e.kind()) {
    case K::kDiverged:
      if (const auto* d = dynamic_cast<const ct::Diverged*>(&e)) return diverged_message(*d);
      break;
    case K::kOutOfMemory:
      if (const auto* m = dynamic_cast<const ct::OutOfMemory*>(&e)) {
        return c10::str(e.fact(), "; use a smaller --batch-size, or a gradient cache (--chunk-size N keeps the ",
                        "activations of N rows at a time); ", ct::kept_checkpoint(m->checkpoint));
      }
      break;
    case K::kRecordLost:
      return e.fact() + " (free space, then --resume)";
    case K::kCheckpointMismatch:
      if (const auto* m = dynamic_cast<const ct::CheckpointMismatch*>(&e)) {
        const std::string flag = flag_of_setting(m->setting);
        return c10::str("checkpoint ", m->checkpoint, " was written with ", flag, " ", m->saved, "; this run has ",
                        flag, " ", m->wanted, " (resume with the same flags)");
      }
      return e.fact() + " (resume with the same flags)";
    case K::kDataUnreadable:
      return e.fact() + data_hint;
    case K::kRunDirInUse:
      return e.fact() + "; wait for it to finish or choose another --run-dir";
    case K::kOverwriteAndResume:
      return "flags '--overwrite' and '--resume' exclude each other (--overwrite starts the run again)";
    case K::kNothingToResume:
      return "flag '--resume': " + e.fact() + " (--resume auto starts fresh when there is none)";
    case K::kRunExists:
      return e.fact() + "; continue it with --resume (or --resume auto), or replace it with --overwrite";
    case K::kRunDirUnsafe:
      return e.fact() + " (choose a --run-dir of your own)";
  }
  return e.what_without_backtrace();
}

void throw_train_error(const ct::TrainError& e, const std::string& message) {
  if (dynamic_cast<const ct::RunDirRefused*>(&e) != nullptr) throw UsageError(message);
  throw std::runtime_error(message);
}

std::string step_memory_message(const ct::StepMemoryFit& fit) {
  using S = ct::StepMemoryShrink;
  const char* advice = fit.shrink == S::kModel   ? "try a smaller model (--encoder-channels)"
                       : fit.shrink == S::kBatch ? "try a smaller --batch-size"
                                                 : "try --chunk-size N (a gradient cache: the activations of N rows "
                                                   "at a time) or a smaller --batch-size";
  return c10::str("flag '--batch-size' (", fit.global_rows, " rows, up to ", fit.rows_per_process, " per process) ",
                  fit.shortfall(), "; ", advice);
}

}  // namespace contrax::cli
