// How `contrax train` reports what the trainer library reports by type
// (contrax/train/common/errors.h, step_memory.h): in words that name the
// tool's flags, and with the tool's exit status: a refused run directory or
// a step that cannot fit is a usage error (2), anything else a failure (1).
// The library's own messages name its options, never these flags.
//
//   try { ... } catch (const contrax::train::TrainError& e) {
//     contrax::cli::throw_train_error(e, contrax::cli::train_error_message(e, recipe.data_hint()));
//   }
#pragma once

#include <string>

#include "contrax/train/common/errors.h"
#include "contrax/train/common/step_memory.h"

namespace contrax::cli {

/// The tool's message for `e`: its fact, then what to change in the tool's
/// flags. `data_hint` ends a kDataUnreadable message (the recipe's: how to
/// install its data or which flag names another directory).
std::string train_error_message(const train::TrainError& e, const std::string& data_hint = "");

/// Throws `message` as the tool reports `e`: a UsageError (exit 2) for a
/// refused run directory, else a std::runtime_error (exit 1).
[[noreturn]] void throw_train_error(const train::TrainError& e, const std::string& message);

/// The refusal of a step that does not fit, naming the flag of the batch and
/// the one that shrinks what holds the most:
///
///   "flag '--batch-size' (60000 rows, up to 30000 per process) needs about
///   21 GiB per process for a training step (activations ...), but this
///   machine (or its memory limit) allows 15 GiB for its 2 processes; try
///   --chunk-size N (a gradient cache: the activations of N rows at a time)
///   or a smaller --batch-size"
std::string step_memory_message(const train::StepMemoryFit& fit);

}  // namespace contrax::cli
