// The loss engine's element-wise passes over a logits tile, fused: row and
// column log-sum-exps in two passes, the softmax gradient in one, in place.
// CPU float/double tiles with unit column stride go to vectorised kernels
// (AVX-512, AVX2 or baseline, chosen at run time; src/engine/kernels/) split
// across LibTorch's intra-op threads; CUDA float/double tiles to the CUDA panel
// kernels where built and switched on (opt-in: cuda_fused_kernels_enabled;
// engine/panel_kernels.h, which also lets a test send CPU tiles to the same
// kernels under the SIMT emulator); any other tile (a transposed view) to the
// equivalent ATen operations.
// Internal to the engine (src/engine/), not installed.
#pragma once

#include <torch/torch.h>

#include <limits>
#include <optional>
#include <string>

#include "engine/panel_kernels.h"

namespace contrax::detail {

/// +inf in double: the engine masks logits with -kInf (exact in every dtype).
inline constexpr double kInf = std::numeric_limits<double>::infinity();

/// Row and column log-sum-exps of a tile.
struct TileLse {
  torch::Tensor row;  // [R], or undefined when not asked for
  torch::Tensor col;  // [C], or undefined when not asked for
};

/// The log-sum-exp of every row (`rows`) and/or every column (`cols`) of the
/// 2-D tile `t` ([R, C]). A row or column that is -inf throughout, or empty,
/// gives -inf (not NaN); a NaN or +inf entry makes its row's and column's
/// results NaN or +inf, as `torch::logsumexp` would.
///
///   auto s = tile_lse(S, /*rows=*/true, /*cols=*/false);   // s.row: [R]
///
/// `masks` (entries masked and positives designated by index, the panel
/// kernels' way): only for a tile that panel_kernels_take.
/// `row_out` and `sums` as ColumnLse::add's.
TileLse tile_lse(const torch::Tensor& t /* [R, C] */, bool rows, bool cols, const panels::Masks* masks = nullptr,
                 const torch::Tensor& row_out = {}, const PositiveSums* sums = nullptr);

/// Whether the tile `t` goes to the panel kernels (cuda_fused_device, and
/// rows and columns the kernels can walk): where the engine may leave masks
/// and positives to them, by index.
bool panel_kernels_take(const torch::Tensor& t);

/// Column log-sum-exps of a matrix seen one tile at a time (online: a running
/// maximum and a sum of exponentials under a shift per column, rescaled only
/// where a tile raises the maximum), with each tile's row log-sum-exps from
/// the same two passes over it. This is how the engine computes a chunk's
/// statistics right after its GEMM, while the chunk is still in cache.
///
///   ColumnLse cols(N, S.options());
///   for (r0 ...) row_lse.narrow(0, r0, R).copy_(cols.add(S.narrow(0, r0, R), 0, true));
///   auto col_lse = cols.lse();   // [N]
class ColumnLse {
 public:
  ColumnLse(int64_t n_cols, const torch::TensorOptions& options);
  /// Adds the rows of `tile` ([R, C]) to columns [c0, c0 + C). Returns the
  /// tile's row log-sum-exps ([R], over its C columns) when `rows`, else undefined.
  /// `masks` as tile_lse's (the panel kernels only). `row_out` ([R],
  /// contiguous, or undefined): where the panel kernels write the rows
  /// directly (then returned); other paths return a new tensor. `sums`
  /// (multi-positive `masks` only, engine/panel_kernels.h): the positive sums
  /// the kernels add into in the same pass.
  torch::Tensor add(const torch::Tensor& tile, int64_t c0, bool rows, const panels::Masks* masks = nullptr,
                    const torch::Tensor& row_out = {}, const PositiveSums* sums = nullptr);
  /// [n_cols]; -inf for a column that only -inf (or nothing) was added to.
  torch::Tensor lse() const;

 private:
  bool fused_, cuda_;                // CPU kernels; CUDA panel kernels
  torch::Tensor max_, sum_, shift_;  // fused state, [n_cols] each (CUDA: max_ and sum_, the running pairs)
  torch::Tensor lse_;                // ATen state, [n_cols]
};

/// The gradient panel in one pass of the panel kernels, for a tile that
/// panel_kernels_take: out = c softmax_grad_(t) (the -Y terms from `masks`),
/// c the 0-dim `factor`, `out` ([R, C]) of t's dtype or, for fp32 tiles,
/// bf16 / fp16: the GEMMs' operand, cast and scaled in the same pass. `t` is
/// left as it was unless `out` is `t`. `counts`: multi-positive `masks`'
/// targets (engine/panel_kernels.h).
void softmax_grad_into(const torch::Tensor& t /* [R, C] */, const torch::Tensor& lse_row,
                       const torch::Tensor& w_row, const torch::Tensor& lse_col, const torch::Tensor& w_col,
                       const panels::Masks* masks, const torch::Tensor& factor /* [] */,
                       const torch::Tensor& out /* [R, C] */, const PositiveCounts& counts = {});

/// Turns the tile into softmax gradients in place:
///   t_ij <- w_row_i exp(t_ij - lse_row_i) + w_col_j exp(t_ij - lse_col_j),
/// an undefined weight meaning 1 and an undefined `lse_col` dropping the
/// column term. The vectors have t's dtype and device, and lengths R and C.
/// With `masks` (a tile that panel_kernels_take only), its masked entries
/// give 0 and its designated positives lose w_row_i [+ w_col_j]; with
/// multi-positive `masks`, each P_ij loses w_row_i / n_i [+ w_col_j / m_j]
/// (`counts`).
void softmax_grad_(torch::Tensor& t /* [R, C] */, const torch::Tensor& lse_row /* [R] */,
                   const torch::Tensor& w_row /* [R] or undefined */,
                   const torch::Tensor& lse_col /* [C] or undefined */,
                   const torch::Tensor& w_col /* [C] or undefined */, const panels::Masks* masks = nullptr,
                   const PositiveCounts& counts = {});

/// In place t_ij <- exp(t_ij - shift); returns the row sums [R] of the new t.
/// For rows known to be bounded by `shift` (e.g. cosine logits: |S| <= 1/T),
/// one pass instead of a max pass and an exp pass.
/// With `col_sum` defined ([C], t's dtype, contiguous), the column sums of the
/// new t are added to it.
torch::Tensor exp_rows_(torch::Tensor& t /* [R, C] */, double shift, const torch::Tensor& col_sum = {});

/// In place t_ij <- t_ij (a_i + b_j).
void scale_rows_plus_cols_(torch::Tensor& t /* [R, C] */, const torch::Tensor& a /* [R] */,
                           const torch::Tensor& b /* [C] */);

/// Matryoshka's shared pass (engine/prefix_block.h), over the raw products x
/// ([R, C]) of one prefix, whose logits are t_ij = a_i b_j x_ij + c: writes
/// them into `t` ([R, C], x's dtype). One pass.
void scaled_logits_out(torch::Tensor& t /* [R, C] */, const torch::Tensor& x /* [R, C] */,
                       const torch::Tensor& a /* [R] */, const torch::Tensor& b /* [C] */, double c);

/// The same logits' row sums of exp(t_ij - shift) under a bound `shift` on
/// all of them ([R], returned), and their column sums added into `col_sum`
/// ([C], contiguous) where defined: the bounded forward's statistics
/// (exp_rows_) without writing t. One pass.
torch::Tensor scaled_exp_sums(const torch::Tensor& x /* [R, C] */, const torch::Tensor& a /* [R] */,
                              const torch::Tensor& b /* [C] */, double c, double shift,
                              const torch::Tensor& col_sum = {});

/// The shared pass's backward over the raw products x ([R, C]) of one
/// prefix and the gradient `g` (G / c, [R, C]) of their logits, in one pass:
/// returned, per row, sum_j g_ij b_j x_ij (`gx`) and sum_j g_ij (`g`);
/// col_gx_j += sum_i g_ij a_i x_ij; then, in place, x_ij <- k a_i b_j g_ij
/// (the raw products' gradient, k a 0-dim factor).
struct PrefixSums {
  torch::Tensor gx, g;  // [R] each
};
PrefixSums raw_products_grad_(torch::Tensor& x /* [R, C] */, const torch::Tensor& g, const torch::Tensor& a,
                              const torch::Tensor& b, const torch::Tensor& k, torch::Tensor& col_gx /* [C] */);

/// scaled_logits_out, the bounded softmax gradient and raw_products_grad_ in
/// one pass, reading x only: under a bound `shift` on every logit t_ij,
/// g_ij = exp(t_ij - shift) (u_i + v_j) (u, v the shift's factors, [R] and
/// [C]: engine/block.h's bounded form of G / c, without its -Y terms, which
/// are the caller's), its sums returned and added into col_gx as
/// raw_products_grad_'s, and h ([R, C]; x itself allowed when !add)
/// <- [h +] k a_i b_j g_ij.
PrefixSums bounded_raw_products_grad(const torch::Tensor& x /* [R, C] */, torch::Tensor& h /* [R, C] */,
                                     const torch::Tensor& a, const torch::Tensor& b, double c, double shift,
                                     const torch::Tensor& u, const torch::Tensor& v, const torch::Tensor& k, bool add,
                                     torch::Tensor& col_gx /* [C] */);

/// Whether `tile_lse`/`softmax_grad_` use the fused CPU kernels where they
/// apply (default true; the CONTRAX_FUSED_KERNELS=0 environment variable turns
/// them off at start). Tests switch them off to check both paths agree.
bool fused_kernels_enabled();
void set_fused_kernels_enabled(bool on);

/// Whether this build has the CUDA panel kernels (src/engine/kernels/cuda_*_panel.cu;
/// CMake option CONTRAX_CUDA_KERNELS, on by default where nvcc and a CUDA
/// LibTorch are found).
bool cuda_fused_kernels_built();

/// Whether CUDA tiles of `tile_lse`, `ColumnLse` and `softmax_grad_` go to
/// the CUDA panel kernels (when built and `fused_kernels_enabled()`).
/// Opt-in until a GPU check has passed them against the ATen path: off
/// unless CONTRAX_FUSED_KERNELS=1 at start (=0 turns every fused kernel off).
/// The default is to flip to on once that check has passed.
bool cuda_fused_kernels_enabled();
void set_cuda_fused_kernels_enabled(bool on);

/// How many tiles this process has sent to the CUDA panel kernels (for the
/// GPU tests: that the kernels, not the ATen path, ran).
int64_t cuda_panel_calls();

/// The panel kernels that a float/double tile of `options` goes to while the
/// CUDA kernels are switched on (cuda_fused_kernels_enabled): CUDA tiles
/// where built, CPU tiles while emulated ones are installed; none otherwise.
/// A caller that launches one counts it with count_cuda_panel_call().
std::optional<PanelDevice> cuda_fused_device(const torch::TensorOptions& options);
void count_cuda_panel_call();

/// Whether the engine may use a known bound of the logits as the shift of its
/// softmaxes (NT-Xent on unit rows, CLIP within s max|a| max|b| + |bias|):
/// default true; CONTRAX_BOUNDED_SHIFT=0 turns it off at start. Off, every
/// loss takes the general path (maxima, then exponentials in both passes);
/// tests compare the two on the same inputs.
bool bounded_shift_enabled();
void set_bounded_shift_enabled(bool on);

/// The instruction set the fused kernels run with on this CPU: "avx512",
/// "avx2" or "baseline" (the widest the CPU runs, unless set below).
const char* fused_kernels_isa();

/// Makes the fused kernels use `isa` ("avx512", "avx2" or "baseline"); false
/// (and nothing changed) when this CPU or build cannot run it. For tests,
/// which check every instruction set the machine runs.
bool set_fused_kernels_isa(const std::string& isa);

/// exp of every element of a CPU float tensor through the fused kernels' own
/// vectorised exp (for its accuracy test).
torch::Tensor fused_exp(const torch::Tensor& x);

}  // namespace contrax::detail
