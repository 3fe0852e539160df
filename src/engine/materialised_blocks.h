// The materialised form of the engine's blocks: one logits buffer per rank
// (engine/workspace.h), turned in place into the gradient in backward (see
// engine/engine.h for the ideas and engine/block.h for the derivation).
// Internal to the engine (src/engine/), not installed.
#pragma once

#include <torch/torch.h>

#include "engine/block.h"

namespace contrax::detail {

/// clip_block_loss (engine/engine.h) on the materialised path; `k_all`: every
/// rank's keys [N, d].
torch::Tensor materialised_clip_block(const torch::Tensor& q, const torch::Tensor& k_all, const torch::Tensor& scale,
                                      const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec);

/// nt_xent_block_loss (engine/engine.h) on the materialised path.
torch::Tensor materialised_nt_xent_block(const torch::Tensor& z, const torch::Tensor& z_all, double inv_temperature,
                                         const EngineLayout& layout, Reduction reduction, bool unit_rows);

}  // namespace contrax::detail
