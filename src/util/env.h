// Switches read from the environment once, shared by the library and the
// trainer (internal, not installed): the engine's CONTRAX_FUSED_KERNELS,
// CONTRAX_BOUNDED_SHIFT and CONTRAX_KEEP_WORKSPACE, the trainer's
// CONTRAX_FUSED_ENCODER.
#pragma once

namespace contrax::detail {

/// True unless the environment variable `name` is "0": switches that start on.
bool env_on(const char* name);

}  // namespace contrax::detail
