// Switches read from the environment once, shared by the library and the
// trainer (internal, not installed): the engine's CONTRAX_FUSED_KERNELS,
// CONTRAX_BOUNDED_SHIFT, CONTRAX_KEEP_WORKSPACE, CONTRAX_REDUCED_OPERANDS and
// CONTRAX_PANEL_BYTES, the trainer's CONTRAX_FUSED_ENCODER, and the integers of
// the process group's environment (comm/environment.cpp).
#pragma once

#include <cstdint>

namespace contrax::detail {

/// True unless the environment variable `name` is "0": switches that start on.
bool env_on(const char* name);

/// True only when the environment variable `name` is "1": switches that start off.
bool env_set(const char* name);

/// The integer in the environment variable `name`, `def` when it is unset or
/// empty; anything else is an error "<who>: environment variable '<name>' must
/// be <expected>, but got '<value>'".
int64_t env_int(const char* name, int64_t def, const char* expected, const char* who);

}  // namespace contrax::detail
