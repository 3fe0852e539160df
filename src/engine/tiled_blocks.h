// The tiled form of the engine's blocks: the materialised blocks' statistics
// and gradient with the logits computed one step at a time (a [tile x tile]
// block on the CPU, a row panel of a key block's columns on a GPU:
// engine/tiles.h, engine/panels.h), online log-sum-exps in the forward and
// recomputed logits in the backward. Memory O(b x tile), or the panel budget,
// instead of O(b x B); GEMM work the materialised path's plus one
// recomputation: 4 passes for symmetric CLIP where two tiled directions took 8.
// With the ring, key blocks travel between neighbours instead of being
// gathered. Internal to the engine (src/engine/), not installed.
#pragma once

#include <torch/torch.h>

#include "engine/block.h"

namespace contrax::detail {

/// clip_block_loss (engine/engine.h) tile by tile: `k` is every rank's keys
/// [N, d], or with `ring` (W > 1) this rank's block [b g, d].
torch::Tensor tiled_clip_block(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                               const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec,
                               const TileWalk& walk, bool ring);

/// nt_xent_block_loss (engine/engine.h) tile by tile: `keys` is the gathered
/// Z ([2B, d], no gradient); with `ring` (W > 1) it is ignored and every
/// rank's own rows [z1_r; z2_r] travel around the ring instead, in the forward
/// and once more in the backward (no gradient blocks: each rank's gradient is
/// complete from its own rows' logits and every row's log-sum-exp).
torch::Tensor tiled_nt_xent_block(const torch::Tensor& z, const torch::Tensor& keys, double inv_temperature,
                                  const EngineLayout& layout, const TileWalk& walk, Reduction reduction, bool ring);

}  // namespace contrax::detail
