// Switches read from the environment once, shared by the library and the
// trainer (internal, not installed): the engine's CONTRAX_FUSED_KERNELS,
// CONTRAX_BOUNDED_SHIFT, CONTRAX_KEEP_WORKSPACE and CONTRAX_REDUCED_OPERANDS,
// the trainer's CONTRAX_FUSED_ENCODER.
#pragma once

namespace contrax::detail {

/// True unless the environment variable `name` is "0": switches that start on.
bool env_on(const char* name);

/// True only when the environment variable `name` is "1": switches that start off.
bool env_set(const char* name);

}  // namespace contrax::detail
