// A training step's memory as one line, and whether it fits (see
// step_memory.h).
#include "contrax/train/common/step_memory.h"

#include <algorithm>

#include "c10/util/StringUtil.h"
#include "contrax/util/memory.h"

namespace contrax {
namespace train {

std::string to_string(const StepMemory& m) {
  const auto b = [](int64_t n) { return format_bytes(static_cast<double>(n)); };
  return "activations " + b(m.activations) + ", loss " + b(m.loss) + ", model " + b(m.model) + ", input " + b(m.batch);
}

std::string step_memory_problem(const StepMemory& need, int64_t global_rows, int64_t world, int64_t processes,
                                int64_t available, const std::string& where) {
  const double per_process = static_cast<double>(need.total()), all = per_process * std::max<int64_t>(processes, 1);
  if (need.total() <= 0 || available <= 0 || all <= static_cast<double>(available)) return {};
  // What to change: whatever holds the most.
  const int64_t input = need.activations + need.batch;
  std::string advice = "try --chunk-size N (a gradient cache: the activations of N rows at a time) or a smaller "
                       "--batch-size";
  if (need.loss > input && need.loss >= need.model) advice = "try a smaller --batch-size";
  if (need.model > input && need.model > need.loss) advice = "try a smaller model (--encoder-channels)";
  return c10::str("flag '--batch-size' (", global_rows, " rows, up to ", (global_rows + world - 1) / world,
                  " per process) needs about ", format_bytes(per_process), " per process for a training step (",
                  to_string(need), "), but ", where, " allows ",
                  format_bytes(static_cast<double>(available)),
                  processes > 1 ? c10::str(" for its ", processes, " processes") : std::string(), "; ", advice);
}

}  // namespace train
}  // namespace contrax
