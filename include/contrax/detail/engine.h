// The contrastive-loss engine: the autograd functions every InfoNCE-family loss
// (CLIP symmetric and one-directional, NT-Xent, MoCo v3) runs on once its
// front end (losses.cpp) has validated the arguments, exchanged the row counts
// and gathered what it needs. Internal: the public API is contrax/losses.h.
//
// Two ideas make it cheaper than the usual "two directions, both towers
// gathered with gradient" formulation, and both are exact:
//
// * Symmetric CLIP from one row block. Rank r owns S_r = s A_r B_all^T + bias
//   ([b_r x B]). The text-to-image direction is the *column* softmax of the
//   same global S, so each rank forms the partial log-sum-exp of every column
//   over its own rows; combining the W partial vectors (O(B) floats each) gives
//   every column's exact log-sum-exp. The gradient of the global loss with
//   respect to S_r is then local (see ClipBlock::backward), so dA_r = s G_r
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
// Beyond plain CLIP the same block form carries grouped candidates (g keys per
// row, the positive of global row u at column u g), labels (duplicates masked
// to -inf, or extra positives with the row's positive term their mean) and the
// per-row reductions; see BlockSpec and the derivation above ClipBlock in
// engine.cpp. The convention is unchanged: with kNone rank r's upstream is a
// [b_r] vector g_r and the gradient held for rank r's rows is that of
// sum_{all rows u} g_u l_u (i.e. W times that of (1/W) sum_r <g_r, out_r>); the
// symmetric column term then needs every column owner's g, all-gathered in
// backward (O(B)), so every rank must run backward.
//
// Memory: one logits buffer per rank ([b x B] for CLIP, [2b x 2B] for NT-Xent),
// saved by the forward and turned in place into G by the backward, never a
// second [b x B] temporary. Time: the buffer is produced and consumed in row
// chunks of ~8 MiB (its GEMM, then the chunk's log-sum-exps; in backward the
// chunk's gradient, then the GEMMs that read it), and the element-wise passes
// are fused vectorised kernels (contrax/detail/lse_kernels.h): two passes over
// a chunk in forward, one in backward, each while the chunk is in cache. Where
// the logits are provably bounded (CLIP: |S| <= s max|q| max|k| + |bias|;
// NT-Xent on unit rows: |S| <= 1/T) and the window fits the exponent range,
// the bound is every softmax's exact shift: the buffer keeps E = exp(S - M),
// one exponential per logit in forward and none in backward (G = E (a_i + b_j)).
// Hence one backward per graph: a second one (retain_graph) is an error, not a
// wrong result.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "contrax/communicator.h"
#include "contrax/losses.h"

namespace contrax::detail {

/// Where this rank's rows sit in the global batch; identical on every rank
/// except `rank` and `offset`.
struct EngineLayout {
  CommunicatorPtr comm;         // null when W == 1
  std::vector<int64_t> counts;  // b_s for every rank
  int64_t rank = 0;
  int64_t world = 1;
  int64_t offset = 0;  // off_r
  int64_t total = 0;   // B
};

/// Builds the layout from exchanged counts.
EngineLayout make_layout(const CommunicatorPtr& comm, std::vector<int64_t> counts);

/// The dtype the engine computes in for features of dtype `t`: fp16 and bf16
/// are accumulated in fp32 (log-sum-exps, loss, gradients of the block); fp32
/// and fp64 stay.
c10::ScalarType compute_dtype(c10::ScalarType t);

/// L2 normalisation of rows that cannot overflow: rows are divided by their
/// largest magnitude before the norm is taken, so 1e20-sized fp32 inputs give
/// unit rows instead of zeros. Same value and gradient as
/// F::normalize(x, dim 1, eps 1e-12) wherever that one does not overflow.
torch::Tensor safe_normalize(const torch::Tensor& x /* [n, d] */);

/// The logit scale min(exp(logit_scale), max_scale) with the clamp taken on the
/// log side: exp never sees a value above log(max_scale), so a huge
/// logit_scale gives the clamped scale and a zero (not NaN) gradient.
torch::Tensor clamped_scale(const torch::Tensor& logit_scale, double max_scale);

/// The shape of an InfoNCE-family problem beyond plain CLIP.
///
/// Columns: the keys of every rank in rank order, `group` per row (N = B g);
/// the designated positive of global row u is column u g. With labels,
/// P_ij = [row_labels_i == col_labels_j] or j the designated positive of i:
///   kMaskDuplicates: the P_ij other than the designated one are -inf in S
///     (out of both softmaxes), the positive term stays S_{i,pos(i)};
///   kMultiPositive: nothing is masked and the positive term of row i is
///     (1/n_i) sum_j P_ij S_ij, n_i = sum_j P_ij (of column j, when symmetric,
///     (1/m_j) sum_i P_ij S_ij over all ranks' rows, m_j = sum_i P_ij).
/// Per-row loss l_i = l^row_i, or (l^row_i + l^col_{off+i}) / 2 when symmetric
/// (group 1 only). Reduction as in contrax/losses.h:
///   kMean: L_r = (W/B) sum_{i in r} l_i; kSum: W sum_{i in r} l_i; kNone: [b] l_i.
struct BlockSpec {
  bool symmetric = false;
  int64_t group = 1;
  Reduction reduction = Reduction::kMean;
  torch::Tensor row_labels;  // int64 [b] (this rank's rows) or undefined
  torch::Tensor col_labels;  // int64 [N] (every column, global order) or undefined
  LabelMode label_mode = LabelMode::kMultiPositive;
};

/// CLIP / InfoNCE / grouped on one row block. q: [b, d] this rank's queries
/// (image tower), k_all: [N, d] every rank's keys in rank order (gathered with
/// gradient for CLIP, without for MoCo v3), scale: 0-dim (the scale itself),
/// bias: 0-dim or undefined. Plain symmetric CLIP returns
///   L_r = (W/B) * 1/2 * sum_{i in r} (lse_row_i + lse_col_{off+i} - 2 S_{i,off+i})
/// (see BlockSpec for the general form). The symmetric form runs one
/// collective in the forward (the column log-sum-exps, (W-1) B floats sent
/// per rank; three such vectors with multi-positive labels) and, except with
/// kNone (the upstream gradients, O(B)), none of its own in backward.
torch::Tensor clip_block_loss(const torch::Tensor& q, const torch::Tensor& k_all, const torch::Tensor& scale,
                              const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec);

/// NT-Xent on one row block. z: [2b, d] this rank's [z1_r; z2_r] (with
/// gradient), z_all: [2B, d] = [z1_all; z2_all] gathered without gradient.
/// Returns L_r = (W / 2B) sum over this rank's 2b rows of lse_u - S_{u,pos(u)},
/// S = z z_all^T / T with the self column at -inf. One O(B) all-gather in the
/// forward; the backward is local. kNone returns the [b] per-example losses
/// (the mean of the two views'), and its backward all-gathers the upstream
/// gradients (O(B)); kSum is not handled here (the front end scales kMean).
/// `unit_rows`: the rows of z and z_all are L2-normalised, so every logit lies
/// in [-1/T, 1/T] and (for T not too small) the forward takes one pass per
/// chunk and the backward none of exponentials.
torch::Tensor nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& z_all, double inv_temperature,
                                 const EngineLayout& layout, Reduction reduction = Reduction::kMean,
                                 bool unit_rows = false);

/// `clip_block_loss` with the logits computed one [tile x tile] block at a time
/// (same value and gradients). Gathered keys: k is k_all [B, d]. `ring`
/// (W > 1): k is this rank's block [b, d] and the blocks travel around the ring
/// (forward and backward), so no rank holds more than two remote blocks
/// (with `spec.group` g, rank s's block has g counts[s] rows).
torch::Tensor tiled_clip_block_loss(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                                    const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec,
                                    int64_t tile, bool ring);

/// `nt_xent_block_loss` with the logits computed one [tile x tile] block at a
/// time. `keys`: the gathered Z ([2B, d], no gradient); with `ring` (W > 1)
/// it is ignored and every rank's own rows [z1_r; z2_r] travel around the ring
/// instead, in the forward and once more in the backward (no gradient blocks:
/// each rank's gradient is complete from its own rows' logits and every row's
/// log-sum-exp, all-gathered).
torch::Tensor tiled_nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& keys, double inv_temperature,
                                       const EngineLayout& layout, int64_t tile, Reduction reduction = Reduction::kMean,
                                       bool ring = false);

/// The memory-path routing every loss and `plan_loss` share (MemoryPath in
/// losses.h): tiled for path kTiled or `ring`; materialised for kMaterialised
/// or the deprecated tile_size -1; tiled for a positive tile_size; otherwise
/// tiled when the largest rank's materialised logits (`logits_bytes`) would
/// exceed `max_logits_bytes`. Computed from exchanged counts, it is the same on
/// every rank.
bool route_tiled(MemoryPath path, int64_t tile_size, bool ring, int64_t logits_bytes, int64_t max_logits_bytes);

/// How many [b x B] logits blocks the materialised path of `loss` holds per
/// rank ("clip"/"infonce": 1, "nt_xent": 4 (one [2b x 2B]), "moco_v3": 2): the
/// automatic routing and `plan_loss` compare this with `max_logits_bytes`.
int64_t logits_blocks(const std::string& loss);

/// Rows per chunk when walking a [rows x cols] buffer of `element_size` so that
/// one chunk's temporaries stay near `chunk_bytes` (at least one row).
int64_t chunk_rows(int64_t cols, int64_t element_size, int64_t chunk_bytes = int64_t{1} << 20);

}  // namespace contrax::detail
