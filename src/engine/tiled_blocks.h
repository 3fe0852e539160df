// The tiled form of the engine's blocks: the materialised blocks' statistics
// and gradient with the logits computed one step at a time (a [tile x tile]
// block on the CPU, a row panel of a key block's columns on a GPU:
// engine/tiles.h, engine/panels.h), online log-sum-exps in the forward and
// recomputed logits in the backward. Memory O(b x tile), or the panel budget,
// instead of O(b x B); GEMM work the materialised path's plus one
// recomputation: 4 passes for symmetric CLIP where two tiled directions took 8.
// With the ring, key blocks travel between neighbours instead of being
// gathered. A scorer other than one dot product (MaxSim) takes the same
// walk through the TileScorer seam below. Internal to the engine
// (src/engine/), not installed.
#pragma once

#include <torch/torch.h>

#include <memory>

#include "engine/block.h"
#include "engine/tiles.h"

namespace contrax::detail {

/// What scores the steps of the tiled CLIP / InfoNCE / grouped block when one
/// dot product of q and the keys does not (MaxSim: engine/maxsim_tiles.h).
/// The rows `q` ([b, ..]) and the key blocks ([n, ..]) are 2-D packings of
/// whatever the scorer scores, so that the gathers and the ring move them
/// unchanged; the scale is the scorer's to apply (logits = scale * score).
/// Everything after the logits (log-sum-exps, labels, the softmax gradient
/// G = dL/dS, the collectives) stays the block's.
class TileScorer {
 public:
  virtual ~TileScorer() = default;
  /// The [R, C] logits of rows [t.r0, +t.rows) of q against columns
  /// [t.c0, +t.cols) of `block`, in the compute dtype; with `keep`, what the
  /// step's backward needs is kept until backward() (one step at a time).
  virtual torch::Tensor logits(const torch::Tensor& q, const torch::Tensor& block, const torch::Tensor& scale,
                               const Tile& t, bool keep) = 0;
  /// The backward of the step last scored with `keep`, given its G = dL/dS
  /// ([R, C]): adds to dq (the gradient of all of q's rows), dblock (of the
  /// whole block; undefined: not wanted) and ds (0-dim, dL/dscale).
  virtual void backward(const torch::Tensor& G, const torch::Tensor& q, const torch::Tensor& block,
                        const torch::Tensor& scale, const Tile& t, torch::Tensor& dq, torch::Tensor& dblock,
                        torch::Tensor& ds) = 0;
};

/// clip_block_loss (engine/engine.h) tile by tile: `k` is every rank's keys
/// [N, d], or with `ring` (W > 1) this rank's block [b g, d]. With a
/// `scorer`, q and k are its packings and it scores each step (no bias, no
/// labels, no masked columns); the designated entries are read off the steps.
torch::Tensor tiled_clip_block(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                               const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec,
                               const TileWalk& walk, bool ring, std::shared_ptr<TileScorer> scorer = nullptr);

/// nt_xent_block_loss (engine/engine.h) tile by tile: `keys` is the gathered
/// Z ([2B, d], no gradient); with `ring` (W > 1) it is ignored and every
/// rank's own rows [z1_r; z2_r] travel around the ring instead, in the forward
/// and once more in the backward (no gradient blocks: each rank's gradient is
/// complete from its own rows' logits and every row's log-sum-exp).
torch::Tensor tiled_nt_xent_block(const torch::Tensor& z, const torch::Tensor& keys, double inv_temperature,
                                  const EngineLayout& layout, const TileWalk& walk, Reduction reduction, bool ring);

}  // namespace contrax::detail
