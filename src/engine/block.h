// The InfoNCE-family block on one rank, as both of its forms compute it (the
// materialised one, engine/materialised_blocks.cpp, and the tiled one,
// engine/tiled_blocks.h): the state an autograd call keeps besides tensors,
// the label structure and designated positives of a tile, the forward
// statistics and per-row losses, and the gradient of a tile. Internal to the
// engine (src/engine/), not installed.
//
// Notation (BlockSpec below): S = s Q K^T + bias over this rank's
// b rows and all N columns; pos(i) = (off + i) g the designated positive; P_ij
// the positive set (designated, or equal labels in kMultiPositive, where
// n_i = sum_j P_ij and, for columns, m_j = sum_{all rows i} P_ij); duplicates
// masked to -inf in kMaskDuplicates. Per-row losses
//   l^row_i = lse_row_i - sum_j Y_ij S_ij,        Y_ij = P_ij / n_i
//   l^col_j = lse_col_j - sum_i Yc_ij S_ij,       Yc_ij = P_ij / m_j   (symmetric)
// (without labels or with kMaskDuplicates P is the designated entry alone and
// n = m = 1), l_i = l^row_i, or (l^row_i + l^col_{off+i}) / 2 when symmetric.
//
// Backward. The effective objective of rank r's backward is sum_i w_i l_i with
// w_i = (upstream of L_r) dL_r/dl_i: c W/B (kMean), c W (kSum), g_i (kNone).
// Under the gradient convention (engine/engine.h) the gradient held for rank
// r's rows must be W dL/dx_r with L = (1/W) sum_r <upstream_r, out_r>, i.e. the
// gradient of sum_{all rows u} w_u l_u. With a masked entry constant (-inf:
// P = 0 there) and Y constant (labels),
//   d/dS_ij sum_u w_u l_u = h [w_i (exp(S_ij - lse_row_i) - Y_ij)
//                              + w_j (exp(S_ij - lse_col_j) - Yc_ij)]   (second term if symmetric)
// with h = 1/2 when symmetric, else 1. The column term needs w_j of the
// column's owner: for kMean/kSum it is the same c on every rank (every rank
// backpropagates its L_r with the same factor, as data-parallel training
// does); for kNone the upstream g is all-gathered in backward (O(B)); the
// one-directional losses need nothing. Then
//   dq = s G k_all,  dk_all = s G^T q,  ds = sum(q * (G k_all)),  dbias = sum G.
// Summed over ranks these are W times the global gradients, as required.
//
// NT-Xent. Rows of the global Z = [z1_all; z2_all] ([2B, d]): view-1 row i of
// rank r is u = off + i, view-2 row i is u = B + off + i; the positive of u is
// the other view of the same example, pos(u) = u +- B (an involution), and
// S_uu = -inf. L = 1/(2B) sum_u (lse_u - S_{u,pos(u)}) gives
//   dL/dS_uv = 1/(2B) (P_uv - Y_uv),  P_uv = exp(S_uv - lse_u), Y_uv = [v = pos(u)],
// and S_uv = z_u.z_v / T depends on z_u and z_v, so
//   dL/dz_w = 1/(2B T) sum_v (P_wv - Y_wv + P_vw - Y_vw) z_v.
// S is symmetric: P_vw = exp(S_wv - lse_v), the entry of rank r's own row w at
// column v shifted by the (all-gathered) lse of row v; Y_vw = [w = pos(v)] =
// [v = pos(w)] = Y_wv. Hence, with the W of the gradient convention,
//   dz_r = G~ Z / T,  G~ = g W/(2B) [exp(S_r - lse_row) + exp(S_r - lse_all) - 2 Y_r],
// computed from rank r's block alone: no backward collective, and Z needs no
// gradient path (each rank's gradient for its own rows is complete).
#pragma once

#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <memory>
#include <optional>

#include "contrax/util/vocabulary.h"
#include "engine/lse_kernels.h"
#include "engine/prologue.h"

namespace contrax::detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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
/// (group 1 only). Reduction as in contrax/util/vocabulary.h:
///   kMean: L_r = (W/B) sum_{i in r} l_i; kSum: W sum_{i in r} l_i; kNone: [b] l_i.
struct BlockSpec {
  bool symmetric = false;
  int64_t group = 1;
  Reduction reduction = Reduction::kMean;
  torch::Tensor row_labels;  // int64 [b] (this rank's rows) or undefined
  torch::Tensor col_labels;  // int64 [N] (every column, global order) or undefined
  LabelMode label_mode = LabelMode::kMultiPositive;
  /// Tiled path, one direction: column `masked + i` is out of row i's softmax
  /// (-inf), e.g. tiled_info_nce's masked_offset; -1: none.
  int64_t masked = -1;
};

/// What an autograd call of the engine keeps besides tensors.
struct BlockState : torch::CustomClassHolder {
  EngineLayout layout;
  BlockSpec spec;
  double inv_temperature = 1.0;            // NT-Xent
  std::optional<double> shift;             // bound M of |S|, every softmax's shift: the buffer holds exp(S - M)
  Reduction reduction = Reduction::kMean;  // NT-Xent
  bool consumed = false;                   // the buffer has become G: a second backward would be wrong
  // Whether tiles go to the panel kernels with masks and positives by index
  // (kernel_masks): decided by the forward's first tile and kept, so that
  // the backward treats a kept buffer the way its forward did.
  mutable std::optional<bool> by_index;

  bool labeled() const { return spec.row_labels.defined(); }
  bool multi() const { return labeled() && spec.label_mode == LabelMode::kMultiPositive; }
  int64_t n_cols() const { return layout.total * spec.group; }
};

// ---- the designated positives

/// The designated positives inside a tile of local rows [r0, r0 + R) and
/// global columns [c0, c0 + C): `n` entries starting at tile entry (row, col),
/// one row down and g columns right each (pos(i) = (off + i) g).
struct PositiveRun {
  int64_t row = 0, col = 0, n = 0;
};
PositiveRun positives_in(int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t offset, int64_t g);

/// The run as a 1-D view of the 2-D tile `t` (any row stride, unit column
/// stride or not): writable in place.
torch::Tensor run_view(const torch::Tensor& t, const PositiveRun& p, int64_t g);
/// The run's columns picked from a per-column vector `v` ([C]): a 1-D view,
/// writable in place.
torch::Tensor run_cols(const torch::Tensor& v, const PositiveRun& p, int64_t g);

/// Label structure of a tile (local rows [r0, r0+R), global columns
/// [c0, c0+C)): kMaskDuplicates masks the duplicates of `t` in place and
/// returns undefined; kMultiPositive returns P as a [R, C] tensor of t's
/// dtype; no labels: undefined. Where kernel_masks leaves the labels to the
/// panel kernels (by index), nothing is built: undefined.
torch::Tensor apply_labels(const BlockState& state, torch::Tensor& t, int64_t r0, int64_t c0);

/// For a tile that goes to the panel kernels (engine/lse_kernels.h:
/// panel_kernels_take): its designated positives and labels as the kernels'
/// masks by index (kMaskDuplicates: equal labels masked; kMultiPositive: the
/// positive set P, whose sums the forward's kernels add up and whose -Y
/// terms the gradient kernel subtracts), so that no ATen pass builds a label
/// mask or P, or subtracts the positives; nullopt for a tile that takes
/// another path (the CPU kernels and ATen: P built by apply_labels).
std::optional<panels::Masks> kernel_masks(const BlockState& state, const torch::Tensor& t, int64_t r0, int64_t c0);

// ---- the forward

/// Forward accumulators over tiles (materialised: one panel of rows, all
/// columns). The column log-sum-exps are running ones (ColumnLse): no [N]
/// vector is rebuilt per tile.
struct ForwardStats {
  const BlockState& state;
  torch::Tensor lse_row, pos_row, n_row;  // [b]; pos/n only for multi-positive
  torch::Tensor lse_col, pos_col, n_col;  // [N] partials over this rank's rows (symmetric); lse_col set by finish()
  std::unique_ptr<ColumnLse> cols;        // symmetric only

  /// `online_cols` false: the caller sets lse_col itself (the bounded shift).
  ForwardStats(const BlockState& state, int64_t b, const torch::TensorOptions& opt, bool online_cols = true);

  /// t: the (masked) tile at local rows [r0, ..), global columns [c0, ..); P
  /// as apply_labels. `whole_rows`: t spans every column, so its row
  /// log-sum-exps are final (copied, not merged).
  void add(const torch::Tensor& t, const torch::Tensor& P, int64_t r0, int64_t c0, bool whole_rows = false);

  void finish();
};

/// What the backward needs besides the inputs.
struct RowTerms {
  torch::Tensor lse_row, lse_col, inv_n_row, inv_n_col;  // inv_n: multi-positive only
};

/// Keeps `rt` in the context for the backward, and reads it back.
void save_terms(torch::autograd::AutogradContext* ctx, const RowTerms& rt);
RowTerms saved_terms(torch::autograd::AutogradContext* ctx);

/// Finishes the forward: combines the column statistics across ranks, forms
/// the per-row losses [b] and fills `out`. `designated`: [b] S_{i,pos(i)}.
torch::Tensor finish_forward(const BlockState& state, ForwardStats& st, const torch::Tensor& designated,
                             RowTerms& out);

/// Per-row losses [b] -> what the loss returns under `r`.
torch::Tensor reduce_rows(const torch::Tensor& l /* [b] */, const EngineLayout& layout, Reduction r);

// ---- the backward

/// Backward weights (see the derivation above): a 0-dim factor c applied to
/// the products, and per-row / per-column weights for kNone (undefined
/// otherwise: weight 1, the factor carrying c W/B or c W).
struct Weights {
  torch::Tensor c, row, col;
};
Weights backward_weights(const BlockState& state, const torch::Tensor& grad, c10::ScalarType dt);

/// The -Y terms of G / c on the designated positives of a tile (no
/// multi-positive labels): w_i, plus w_j when symmetric (1 each unweighted).
void subtract_positives(const BlockState& state, const Weights& w, torch::Tensor& t, int64_t r0, int64_t c0);
/// Those terms as a vector, one per entry of `run` (positives_in(r0, ., c0, ...)).
torch::Tensor positive_targets(const BlockState& state, const Weights& w, const PositiveRun& run, int64_t r0,
                               int64_t c0, const torch::TensorOptions& options);

/// S tile -> G (c folded in) in the operand dtype `op`, in one pass of the
/// panel kernels, where the tile goes to them (kernel_masks; multi-positive
/// labels' -Y terms by index too): `t` itself when `op` is its dtype, else a new
/// [R, C] tensor of `op`. Undefined otherwise: the caller takes tile_gradient
/// and scaled_operand.
torch::Tensor kernel_gradient(const BlockState& state, const RowTerms& rt, const Weights& w, torch::Tensor& t,
                              int64_t r0, int64_t c0, c10::ScalarType op);

/// S tile -> G / c in place (see the derivation above). `P` as apply_labels.
void tile_gradient(const BlockState& state, const RowTerms& rt, const Weights& w, torch::Tensor& t,
                   const torch::Tensor& P, int64_t r0, int64_t c0);

// ---- NT-Xent

/// NT-Xent's backward weights. kMean/kSum: a 0-dim factor c (W/(2B) g / T).
/// kNone: the per-example upstream g_i weighs each of the example's two view
/// rows by g_i / 2 (an example's loss is the mean of its views'); the
/// transposed term of the gradient (P_vw, above) needs the weight of every row
/// v, so the upstream gradients are all-gathered (O(B)), and then
///   G~_wv = w_w (exp(S_wv - lse_w) - Y_wv) + w_v (exp(S_wv - lse_v) - Y_wv),
/// with w_{pos(w)} = w_w: the positive entry loses 2 w_w. c = 1/T.
struct NtWeights {
  torch::Tensor c, row, all;  // row: [2b], all: [2B] (kNone only)
};
NtWeights nt_weights(const BlockState& state, const torch::Tensor& grad, c10::ScalarType dt);

/// Every row's lse in global order [lse(z1_all); lse(z2_all)] ([2B]) from this
/// rank's [2b]: one O(B) gather.
torch::Tensor gather_view_lse(const torch::Tensor& lse /* [2b] */, const EngineLayout& layout);

/// Per-row NT-Xent losses [2b] -> what the loss returns.
torch::Tensor nt_reduce(const torch::Tensor& l /* [2b] */, const BlockState& state);

// ---- shared by the materialised blocks (engine/materialised_blocks.cpp, engine/prefix_block.h)

/// Whether a known bound M of the logits (|S| <= M) can be every softmax's
/// exact shift in dtype `t`: then E = exp(S - M) >= e^(-2M) must stay a normal
/// number (fp32: down to e^-87; fp64: e^-708), with a margin.
bool bound_fits(double M, c10::ScalarType t);

/// exp(M - lse) (times w when defined): the factor that turns a buffer entry
/// E = exp(S - M) into w exp(S - lse). At most e^(2M): every lse is >= -M.
torch::Tensor shift_factors(double M, const torch::Tensor& lse, const torch::Tensor& w);

/// Rows of a label sub-panel: its [R, cols] label structure stays near 1 MiB
/// on the CPU (in cache), near 64 MiB off it (a GPU pays a launch per
/// sub-panel: 1 MiB would mean thousands of tiny launches at GPU sizes).
int64_t label_panel_rows(int64_t cols, const torch::Tensor& like);

}  // namespace contrax::detail
