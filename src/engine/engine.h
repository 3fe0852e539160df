// The contrastive-loss engine's one seam: the two calls every InfoNCE-family
// loss (CLIP symmetric and one-directional, grouped, NT-Xent, MoCo v3, the
// tiled InfoNCE core) makes once its front end has run the shared prologue
// (engine/prologue.h: row counts, layout, routing) and gathered what it needs.
// They run the block on the path the prologue chose: materialised
// (engine/materialised_blocks.cpp) or tiled (engine/tiled_blocks.h). Internal
// (src/engine/); the public API is contrax/losses/losses.h, grouped.h and
// tiled.h. Two ideas make it cheaper than gathering both towers with gradient,
// both exact (docs/engine.md):
//
// * Symmetric CLIP from one row block. Rank r owns S_r = s A_r B_all^T + bias
//   ([b_r x B]). The text-to-image direction is the *column* softmax of the
//   same global S, so each rank forms the partial log-sum-exp of every column
//   over its own rows; combining the W partial vectors (O(B) floats each) gives
//   every column's exact log-sum-exp. The gradient of the global loss with
//   respect to S_r is then local (see engine/block.h), so dA_r = s G_r
//   B_all and dB_all = s G_r^T A_r: three GEMMs per rank instead of six, and
//   only B is gathered (with gradient, i.e. reduce-scattered back).
// * NT-Xent with no backward collective. S = Z Z^T / T over all 2B views is
//   symmetric, so dZ = (G + G^T) Z / T, and the rows of G^T a rank needs come
//   from its own row block and every row's log-sum-exp (all-gathered in the
//   forward, O(B)). Z is gathered once without gradient; nothing moves in
//   backward.
//
// Gradient convention (DESIGN.md): rank r returns L_r with (1/W) sum_r L_r = L,
// and after every rank's backward the gradient held for rank r's rows (and the
// mean over ranks of a scalar parameter's gradient) must equal W dL/dx_r
// (resp. dL/ds). Both functions therefore inject into their own row block the
// block of W dL/dS, scaled by the upstream gradient of L_r. This assumes every
// rank backpropagates its L_r with the same upstream factor (loss.backward(),
// or the same loss scale on every rank), which is what data-parallel training
// does; the per-rank L_r value is exact regardless.
//
// Grouped candidates, labels and the per-row reductions take the same block
// form (BlockSpec in engine/block.h, with the derivation). With kNone rank r's
// upstream is a [b_r] vector g_r and the gradient held for rank r's rows is
// that of sum_{all rows u} g_u l_u; the symmetric column term then needs every
// column owner's g, all-gathered in backward (O(B)), so every rank must run
// backward.
//
// Memory: the materialised path keeps one logits buffer per rank ([b x B] for
// CLIP, [2b x 2B] for NT-Xent; engine/workspace.h), made and consumed in row
// panels of ~8 MiB by fused kernels (engine/lse_kernels.h) and turned in place
// into G by the backward. Where the logits are provably bounded (CLIP:
// |S| <= s max|q| max|k| + |bias|; NT-Xent on unit rows: |S| <= 1/T) and the
// window fits the exponent range, the bound is every softmax's exact shift: the
// buffer keeps E = exp(S - M), one exponential per logit in forward and none
// in backward (G = E (a_i + b_j)). Hence one backward per graph: a second one
// (retain_graph) is an error, not a wrong result. The tiled path computes the
// same one [tile x tile] block at a time (engine/tiles.h), memory O(b x tile).
#pragma once

#include <torch/torch.h>

#include "contrax/util/vocabulary.h"
#include "engine/block.h"
#include "engine/prologue.h"

namespace contrax::detail {

/// CLIP / InfoNCE / grouped on one row block. q: [b, d] this rank's queries
/// (image tower); k: [N, d] every rank's keys in rank order (gathered with
/// gradient for CLIP, without for MoCo v3), or on the ring (`p.ring`) this
/// rank's own [b g, d] while the blocks travel around the ring (forward and
/// backward), so no rank holds more than two remote blocks; scale: 0-dim (the
/// scale itself); bias: 0-dim or undefined. Plain symmetric CLIP returns
///   L_r = (W/B) * 1/2 * sum_{i in r} (lse_row_i + lse_col_{off+i} - 2 S_{i,off+i})
/// (see BlockSpec for the general form). The symmetric form runs one
/// collective in the forward (the column log-sum-exps, (W-1) B floats sent
/// per rank; three such vectors with multi-positive labels) and, except with
/// kNone (the upstream gradients, O(B)), none of its own in backward.
torch::Tensor clip_block_loss(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                              const torch::Tensor& bias, const Prologue& p, const BlockSpec& spec);

/// NT-Xent on one row block. z: [2b, d] this rank's [z1_r; z2_r] (with
/// gradient), z_all: [2B, d] = [z1_all; z2_all] gathered without gradient
/// (ignored on the ring, where every rank's own rows travel instead, in the
/// forward and once more in the backward). Returns
/// L_r = (W / 2B) sum over this rank's 2b rows of lse_u - S_{u,pos(u)},
/// S = z z_all^T / T with the self column at -inf. One O(B) all-gather in the
/// forward; no gradient collective in the backward. kNone returns the [b]
/// per-example losses (the mean of the two views'), and its backward
/// all-gathers the upstream gradients (O(B)); kSum is not handled here (the
/// front end scales kMean). `unit_rows`: the rows of z and z_all are
/// L2-normalised, so every logit lies in [-1/T, 1/T] and (for T not too small)
/// the materialised forward takes one pass per panel and its backward no
/// exponentials.
torch::Tensor nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& z_all, double inv_temperature,
                                 const Prologue& p, Reduction reduction, bool unit_rows);

/// SigLIP on one row block (engine/siglip_block.cpp). a: [b, d] this rank's
/// prepared features (with gradient); keys: [B, d] every rank's, gathered with
/// gradient, or on the ring (`p.ring`) this rank's own [b, d] while the blocks
/// travel (forward and backward); scale: 0-dim, the scale itself (clamped);
/// bias: 0-dim or none. Returns L_r = (W/B) sum_{i in r} sum_j softplus(-z_ij x_ij),
/// x = s a keys^T + bias, z_ij = +1 on the positives (i, offset + i), -1
/// elsewhere (the derivation of its backward is beside the autograd function).
torch::Tensor siglip_block_loss(const torch::Tensor& a, const torch::Tensor& keys, const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& bias, const Prologue& p);

}  // namespace contrax::detail
