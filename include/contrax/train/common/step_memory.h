// The host memory of one training step, per rank, by what holds it: what a
// recipe estimates before it allocates (image/memory_estimate.h), so that
// a caller (`contrax train`) can refuse a run that cannot fit, saying what
// to shrink, instead of failing in the allocator at its first step.
#pragma once

#include <cstdint>
#include <string>

namespace contrax::train {

/// The peak bytes of one rank during a training step, by what holds them:
/// `model`, the parameters, their gradients, DataParallel's gradient buckets
/// and AdamW's two moments (and copies such as MoCo v3's momentum encoder);
/// `batch`, the step's input rows and what the recipe makes of them before
/// the model (augmented views, their concatenation); `activations`, what the
/// model keeps for the backward for the rows that run with gradient at once
/// (all, or one gradient-cache chunk); `loss`, the loss's own buffers on its
/// path (contrax::plan_loss).
struct StepMemory {
  int64_t model = 0;        ///< the model and its training state
  int64_t batch = 0;        ///< the step's inputs
  int64_t activations = 0;  ///< what the backward needs
  int64_t loss = 0;         ///< the loss's buffers

  /// The sum of the four.
  int64_t total() const { return model + batch + activations + loss; }
};

/// "activations 1.2 GiB, loss 64 MiB, model 9.4 MiB, input 3.1 MiB".
std::string to_string(const StepMemory& memory);

/// What a step that does not fit should shrink first: what holds the most.
enum class StepMemoryShrink {
  kNothing,      ///< the step fits, or its size or the memory available is unknown
  kActivations,  ///< the inputs and activations: a gradient cache (a recipe's chunk size) or a smaller batch
  kBatch,        ///< the loss's buffers: a smaller batch
  kModel,        ///< the model and its training state: a smaller model
};

/// Whether `processes` steps fit in the memory they share, and if not, by how
/// much and what to shrink (step_memory_fit). A caller words the refusal in
/// its own terms: the `contrax train` tool names its flags.
struct StepMemoryFit {
  bool fits = true;                                      ///< false when the step is known not to fit
  StepMemoryShrink shrink = StepMemoryShrink::kNothing;  ///< what to shrink first (kNothing when it fits)
  StepMemory need;                                       ///< one step's memory per process
  int64_t global_rows = 0;                               ///< rows in the largest global batch
  int64_t rows_per_process = 0;                          ///< the most rows one process has
  int64_t processes = 1;                                 ///< the processes that share `available`
  int64_t available = 0;                                 ///< bytes the processes share
  std::string where;  ///< "this machine (or its memory limit)", "GPU cuda:1"

  /// "needs about 21 GiB per process for a training step (activations ...),
  /// but this machine (or its memory limit) allows 15 GiB for its 2 processes".
  std::string shortfall() const;
};

/// Whether `processes` steps of `need` each (this node's processes of a run
/// with `global_rows` rows per step over `world` ranks) fit in `available`
/// bytes of `where` ("this machine (or its memory limit)", or a GPU: "GPU
/// cuda:1", each process's own). Fits when either is unknown (0).
///
///   auto fit = contrax::train::step_memory_fit(need, 60000, 2, 2, contrax::available_memory_bytes());
///   if (!fit.fits && fit.shrink == contrax::train::StepMemoryShrink::kActivations) ...;
StepMemoryFit step_memory_fit(const StepMemory& need, int64_t global_rows, int64_t world, int64_t processes,
                              int64_t available, const std::string& where = "this machine (or its memory limit)");

}  // namespace contrax::train
