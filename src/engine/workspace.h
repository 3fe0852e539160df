// The materialised path's logits buffer, kept per thread between calls (the
// public switches are in contrax/engine/workspace.h). Internal to the engine
// (src/engine/), not installed.
#pragma once

#include <torch/torch.h>

namespace contrax::detail {

/// An uninitialised contiguous [rows, cols] buffer: the calling thread's kept
/// one when it fits and is free, otherwise a fresh one (kept when it is a CPU
/// buffer of at least 32 MiB and keeping is on).
torch::Tensor logits_buffer(int64_t rows, int64_t cols, const torch::TensorOptions& opt);

}  // namespace contrax::detail
