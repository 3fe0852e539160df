// The host memory of one training step, per rank, by what holds it: what a
// recipe estimates before it allocates (image/memory_estimate.h), so that
// `contrax train` can refuse a run that cannot fit, naming the flags that
// shrink it, instead of failing in the allocator at its first step.
#pragma once

#include <cstdint>
#include <string>

namespace contrax {
namespace train {

/// The peak bytes of one rank during a training step, by what holds them:
/// `model`, the parameters, their gradients, DataParallel's gradient buckets
/// and AdamW's two moments (and copies such as MoCo v3's momentum encoder);
/// `batch`, the step's input rows and what the recipe makes of them before
/// the model (augmented views, their concatenation); `activations`, what the
/// model keeps for the backward for the rows that run with gradient at once
/// (all of them, or one gradient-cache chunk); `loss`, the loss's own buffers on the path it takes
/// (contrax::plan_loss).
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

/// Empty when `processes` steps of `need` each (this node's processes of a
/// run with `global_rows` rows per step over `world` ranks) fit in
/// `available` bytes of `where` ("this machine (or its memory limit)", or a
/// GPU: "GPU cuda:1", each process's own), or when either is unknown (0);
/// otherwise why not, naming the flag that shrinks what holds the most:
///
///   "flag '--batch-size' (60000 rows, up to 30000 per process) needs about
///   21 GiB per process for a training step (activations ..., loss ...), but
///   this machine (or its memory limit) allows 15 GiB for its 2 processes;
///   try --chunk-size N (a gradient cache: the activations of N rows at a
///   time) or a smaller --batch-size"
std::string step_memory_problem(const StepMemory& need, int64_t global_rows, int64_t world, int64_t processes,
                                int64_t available, const std::string& where = "this machine (or its memory limit)");

}  // namespace train
}  // namespace contrax
