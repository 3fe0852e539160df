// A training step's memory as one line, and whether it fits (see
// step_memory.h).
#include "contrax/train/common/step_memory.h"

#include <algorithm>

#include "c10/util/StringUtil.h"
#include "contrax/util/memory.h"

namespace contrax::train {

std::string to_string(const StepMemory& m) {
  const auto b = [](int64_t n) { return format_bytes(static_cast<double>(n)); };
  return "activations " + b(m.activations) + ", loss " + b(m.loss) + ", model " + b(m.model) + ", input " + b(m.batch);
}

std::string StepMemoryFit::shortfall() const {
  return c10::str("needs about ", format_bytes(static_cast<double>(need.total())), " per process for a training step (",
                  to_string(need), "), but ", where, " allows ", format_bytes(static_cast<double>(available)),
                  processes > 1 ? c10::str(" for its ", processes, " processes") : std::string());
}

StepMemoryFit step_memory_fit(const StepMemory& need, int64_t global_rows, int64_t world, int64_t processes,
                              int64_t available, const std::string& where) {
  StepMemoryFit fit;
  fit.need = need;
  fit.global_rows = global_rows;
  fit.rows_per_process = (global_rows + world - 1) / world;
  fit.processes = std::max<int64_t>(processes, 1);
  fit.available = available;
  fit.where = where;
  const double all = static_cast<double>(need.total()) * static_cast<double>(fit.processes);
  if (need.total() <= 0 || available <= 0 || all <= static_cast<double>(available)) return fit;
  fit.fits = false;
  // What to change: whatever holds the most.
  const int64_t input = need.activations + need.batch;
  fit.shrink = StepMemoryShrink::kActivations;
  if (need.loss > input && need.loss >= need.model) fit.shrink = StepMemoryShrink::kBatch;
  if (need.model > input && need.model > need.loss) fit.shrink = StepMemoryShrink::kModel;
  return fit;
}

}  // namespace contrax::train
