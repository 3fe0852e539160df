// The grid decomposition of the CUDA panel kernels (cuda_*_panel.cuh): what a
// thread does (`*_thread` functions, `__host__ __device__`) and the argument
// structs of their host API. How threads are combined (warp shuffles and
// shared memory) is in the kernels, which run on a GPU or, unchanged, under
// the SIMT emulator on the CPU (tests/support/simt.h), where the tests check
// them against ATen on odd shapes so that an indexing bug shows without a GPU.
//
// A panel is a [rows x cols] block of logits (row stride ld, unit column
// stride) at global row `row0` (rank-local, as the engine's tiles count rows)
// and global column `col0`. Two decompositions:
//  * Strips (log-sum-exps, SigLIP): blocks of kThreads threads over a strip of
//    kStripRows rows and one of `splits` column ranges (each a multiple of
//    kThreads wide): grid (strips, splits). Log-sum-exps: thread t walks
//    columns t, t + kThreads, ... of its range, keeping its own column's pair
//    over the strip's rows (written as that strip's partial pair: complete
//    after one visit, no atomics) and a partial per row; the block combines
//    the row partials (warp butterfly, then across warps) into one per
//    (split, row). SigLIP: warp w takes strip rows w, w + kWarps, ..., its
//    lanes every kWarp-th column of the range, and a warp butterfly adds the
//    lanes' sums into the (split, row) partial. A finishing pass (one thread
//    per row and per column) merges the splits' row partials and the strips'
//    column partials. Tails: rows past `rows` and columns past `cols` are
//    skipped by index.
//  * Tiles (gradients): blocks of kThreads threads over kGradRows rows by
//    kThreads columns, one element per thread and row: grid (column tiles,
//    row tiles), the row tiles strided when they exceed the grid's y limit.
#pragma once

#include <cstdint>

#include "engine/kernels/loss_math.h"

#if defined(__CUDACC__)
#define CONTRAX_UNROLL _Pragma("unroll")
#else
#define CONTRAX_UNROLL
#endif

namespace contrax::detail::panels {

using math::MaxSum;

constexpr int kThreads = 256;   // threads per block, every kernel
constexpr int kWarp = 32;       // lanes per warp
constexpr int kWarps = kThreads / kWarp;
constexpr int kStripRows = 32;  // rows per strip: one per lane when a warp merges the warps' row partials
constexpr int kGradRows = 8;    // rows per gradient tile
constexpr int64_t kMaxGridY = 65535;
static_assert(kStripRows == kWarp, "the cross-warp merge gives one strip row to each lane");

/// Entries of a panel that the kernels treat by index instead of by buffer:
/// the masked diagonal (i, i + diag_offset) and equal-label duplicates (set to
/// -inf), and the designated positives j = (pos_offset + i) group. i counts
/// rank-local rows (row0 + r), j global columns (col0 + c), as in
/// engine/block.h. With `multi` (multi-positive labels, BlockSpec's
/// kMultiPositive) the labels mask nothing: they and the designated positive
/// make the positive set P_ij (in_positive_set), whose sums the log-sum-exp
/// kernels add up and whose -Y terms the gradient kernel subtracts.
struct Masks {
  int64_t row0 = 0, col0 = 0;
  bool diag = false;
  int64_t diag_offset = 0;
  const int64_t* row_labels = nullptr;  // [rows] and [cols], or both null:
  const int64_t* col_labels = nullptr;  // equal labels masked except on the designated positive (unless multi)
  bool positives = false;               // whether the designated positives exist (gradient: y = 1 there)
  int64_t pos_offset = 0, group = 1;
  bool multi = false;  // multi-positive labels (row_labels and col_labels set; positives false)
};

/// Whether panel entry (r, c) belongs to the positive set of multi-positive
/// labels: P_ij = [row_label_i == col_label_j] or j the designated positive
/// of i (engine/block.h). False without Masks::multi.
CONTRAX_HD bool in_positive_set(const Masks& k, int64_t r, int64_t c) {
  return k.multi &&
         (k.row_labels[r] == k.col_labels[c] || math::is_positive(k.row0 + r, k.col0 + c, k.pos_offset, k.group));
}

/// The strip decomposition of a [rows x cols] panel.
struct StripGrid {
  int64_t strips = 0, splits = 0, split_cols = 0;
};

/// Enough blocks to fill the device twice over (`sm_count` multiprocessors):
/// columns are split only where the strips alone are too few.
inline StripGrid strip_grid(int64_t rows, int64_t cols, int sm_count) {
  StripGrid g;
  if (rows <= 0 || cols <= 0) return g;
  g.strips = (rows + kStripRows - 1) / kStripRows;
  const int64_t col_blocks = (cols + kThreads - 1) / kThreads;
  const int64_t target = 2 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);
  int64_t splits = (target + g.strips - 1) / g.strips;
  splits = splits < 1 ? 1 : (splits > col_blocks ? col_blocks : splits);
  splits = splits > kMaxGridY ? kMaxGridY : splits;
  g.split_cols = (col_blocks + splits - 1) / splits * kThreads;
  g.splits = (cols + g.split_cols - 1) / g.split_cols;
  return g;
}

/// Workspace elements of a strip pass: two per (split, row) and, for the
/// log-sum-exps' columns (`cols` 0 for SigLIP), two per (strip, col); twice
/// that with `positive_sums` (multi-positive labels: LseArgs::pos_row).
inline int64_t strip_workspace(const StripGrid& g, int64_t rows, int64_t cols, bool positive_sums = false) {
  return (positive_sums ? 4 : 2) * (g.splits * rows + g.strips * cols);
}

/// Strip row k of block (strip, split): its panel row and the split's
/// columns [begin, end).
struct SplitRow {
  int64_t r, begin, end;
};
CONTRAX_HD SplitRow split_row(int64_t cols, const StripGrid& g, int64_t strip, int64_t split, int k) {
  const int64_t begin = split * g.split_cols;
  return {strip * kStripRows + k, begin, begin + g.split_cols < cols ? begin + g.split_cols : cols};
}

/// Two sums of entry t over n parts of `len` entries each (m: the first, s:
/// the second), added in part order: the finishing passes' deterministic sums.
template <typename T>
CONTRAX_HD MaxSum<T> sum_parts(const T* pm, const T* ps, int64_t n, int64_t len, int64_t t) {
  MaxSum<T> p{T(0), T(0)};
  for (int64_t s = 0; s < n; ++s) p.m += pm[s * len + t], p.s += ps[s * len + t];
  return p;
}

/// Writes a pair as the (split, row r) partial of [splits][rows] arrays.
template <typename T>
CONTRAX_HD void store_split_row(T* m, T* s, int64_t rows, int64_t split, int64_t r, MaxSum<T> p) {
  if (r >= rows) return;
  m[split * rows + r] = p.m;
  s[split * rows + r] = p.s;
}

/// The logit at panel entry (r, c): bias added, masked entries -inf.
template <typename T>
CONTRAX_HD T masked_logit(const T* logits, int64_t ld, const T* bias, const Masks& k, int64_t r, int64_t c) {
  T x = logits[r * ld + c];
  if (bias) x += *bias;
  const int64_t i = k.row0 + r, j = k.col0 + c;
  if (k.diag && math::on_diagonal(i, j, k.diag_offset)) return -math::inf<T>();
  const bool positive = k.positives && math::is_positive(i, j, k.pos_offset, k.group);
  if (k.row_labels && !k.multi && k.row_labels[r] == k.col_labels[c] && !positive) return -math::inf<T>();
  return x;
}

// ---- log-sum-exps (strips)

template <typename T>
struct LseArgs {
  const T* logits = nullptr;  // [rows x cols], row stride ld
  int64_t rows = 0, cols = 0, ld = 0;
  const T* bias = nullptr;  // device scalar or null
  Masks masks;
  T* row_lse = nullptr;  // [rows]: over the panel's columns, or null
  T* col_m = nullptr;    // [cols] running column pairs merged into (start: -inf, 0), or null
  T* col_s = nullptr;
  // Multi-positive labels (masks.multi), or null: each row's sum_j P_ij x_ij
  // and n_i = sum_j P_ij over the panel's columns added into pos_row and
  // n_row ([rows]), each column's sum_i P_ij x_ij and sum_i P_ij over the
  // panel's rows into pos_col and n_col ([cols]); x the logit (bias added).
  T* pos_row = nullptr;
  T* n_row = nullptr;
  T* pos_col = nullptr;
  T* n_col = nullptr;
  T* ws = nullptr;  // strip_workspace(grid, rows, cols, pos_row || pos_col) elements
};

// Workspace layout: row partials [splits][rows] (m, then s), then column
// partials [strips][cols] (m, then s); with positive sums, the rows' and the
// columns' partial sums and counts after them in the same layout.
template <typename T>
struct StripWs {
  T *rm, *rs, *cm, *cs, *rp, *rn, *cp, *cn;
};
template <typename T>
CONTRAX_HD StripWs<T> strip_ws(T* ws, const StripGrid& g, int64_t rows, int64_t cols) {
  const int64_t nr = g.splits * rows, nc = g.strips * cols, half = 2 * (nr + nc);
  return {ws, ws + nr, ws + 2 * nr, ws + 2 * nr + nc, ws + half, ws + half + nr, ws + half + 2 * nr,
          ws + half + 2 * nr + nc};
}

/// Thread `tid` of block (strip, split): its columns' strip pairs (and, for
/// multi-positive labels, their positive sums and counts: two registers) into
/// the workspace, and its partial pair of each strip row into `rows_acc`.
template <typename T>
CONTRAX_HD void lse_thread(const LseArgs<T>& a, const StripGrid& g, int64_t strip, int64_t split, int tid,
                           MaxSum<T> (&rows_acc)[kStripRows]) {
  const bool want_rows = a.row_lse != nullptr, want_cols = a.col_m != nullptr, want_pos = a.pos_col != nullptr;
  const SplitRow q = split_row(a.cols, g, strip, split, 0);
  const int64_t r0 = q.r, c_begin = q.begin, c_end = q.end;
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, a.cols);
  CONTRAX_UNROLL
  for (int k = 0; k < kStripRows; ++k) rows_acc[k] = math::empty_pair<T>();
  for (int64_t c = c_begin + tid; c < c_end; c += kThreads) {
    MaxSum<T> col = math::empty_pair<T>(), pos{T(0), T(0)};  // pos: sum of P_ij x_ij (.m), of P_ij (.s)
    CONTRAX_UNROLL
    for (int k = 0; k < kStripRows; ++k) {
      if (r0 + k < a.rows) {
        const T x = masked_logit(a.logits, a.ld, a.bias, a.masks, r0 + k, c);
        if (want_cols) math::add(col, x);
        if (want_rows) math::add(rows_acc[k], x);
        if (want_pos && in_positive_set(a.masks, r0 + k, c)) pos.m += x, pos.s += T(1);
      }
    }
    if (want_cols) {
      w.cm[strip * a.cols + c] = col.m;
      w.cs[strip * a.cols + c] = col.s;
    }
    if (want_pos) {
      w.cp[strip * a.cols + c] = pos.m;
      w.cn[strip * a.cols + c] = pos.s;
    }
  }
}

/// Multi-positive labels: lane `lane` of the warp that handles strip row k of
/// block (strip, split): its partial sum of P_ij x_ij (.m) and of P_ij (.s)
/// over columns lane, lane + kWarp, ... of the split's range. The rows' sums
/// are a second walk of the block's entries (a warp per row, as SigLIP's),
/// not 64 more registers per thread beside the 32 row pairs; only labelled
/// calls take it, and it reads the strip the block has just read.
template <typename T>
CONTRAX_HD MaxSum<T> positive_lane(const LseArgs<T>& a, const StripGrid& g, int64_t strip, int64_t split, int k,
                                   int lane) {
  MaxSum<T> acc{T(0), T(0)};
  const SplitRow q = split_row(a.cols, g, strip, split, k);
  if (q.r >= a.rows) return acc;
  for (int64_t j = q.begin + lane; j < q.end; j += kWarp) {
    if (in_positive_set(a.masks, q.r, j)) {
      acc.m += masked_logit(a.logits, a.ld, a.bias, a.masks, q.r, j);
      acc.s += T(1);
    }
  }
  return acc;
}

/// The warp's positive sums of strip row k (its lanes' added) as the split's partial.
template <typename T>
CONTRAX_HD void positive_store_row(const LseArgs<T>& a, const StripGrid& g, int64_t strip, int64_t split, int k,
                                   MaxSum<T> p) {
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, a.cols);
  store_split_row(w.rp, w.rn, a.rows, split, strip * kStripRows + k, p);
}

/// Writes the block's combined pair of strip row k (already merged over the
/// block's threads) as the split's row partial.
template <typename T>
CONTRAX_HD void lse_store_row(const LseArgs<T>& a, const StripGrid& g, int64_t strip, int64_t split, int k,
                              MaxSum<T> p) {
  if (!a.row_lse) return;
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, a.cols);
  store_split_row(w.rm, w.rs, a.rows, split, strip * kStripRows + k, p);
}

/// Finishing thread t (t < max(rows, cols)): row t's log-sum-exp over the
/// splits, and column t's strips merged into the running pair; positive sums
/// and counts added into theirs (splits and strips in order).
template <typename T>
CONTRAX_HD void lse_finish_thread(const LseArgs<T>& a, const StripGrid& g, int64_t t) {
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, a.cols);
  if (a.pos_row && t < a.rows) {
    const MaxSum<T> p = sum_parts(w.rp, w.rn, g.splits, a.rows, t);
    a.pos_row[t] += p.m;
    a.n_row[t] += p.s;
  }
  if (a.pos_col && t < a.cols) {
    const MaxSum<T> p = sum_parts(w.cp, w.cn, g.strips, a.cols, t);
    a.pos_col[t] += p.m;
    a.n_col[t] += p.s;
  }
  if (a.row_lse && t < a.rows) {
    MaxSum<T> p = math::empty_pair<T>();
    for (int64_t s = 0; s < g.splits; ++s) p = math::merge(p, MaxSum<T>{w.rm[s * a.rows + t], w.rs[s * a.rows + t]});
    a.row_lse[t] = math::finish(p);
  }
  if (a.col_m && t < a.cols) {
    MaxSum<T> p{a.col_m[t], a.col_s[t]};
    for (int64_t s = 0; s < g.strips; ++s) p = math::merge(p, MaxSum<T>{w.cm[s * a.cols + t], w.cs[s * a.cols + t]});
    a.col_m[t] = p.m;
    a.col_s[t] = p.s;
  }
}

// ---- CLIP / InfoNCE gradient (tiles)

template <typename T, typename Out>
struct GradArgs {
  const T* logits = nullptr;  // [rows x cols], row stride ld
  int64_t rows = 0, cols = 0, ld = 0;
  const T* bias = nullptr;  // device scalar or null
  Masks masks;
  const T* lse_row = nullptr;  // [rows]
  const T* w_row = nullptr;    // [rows] or null (1)
  const T* lse_col = nullptr;  // [cols], or null: no column term (one-directional)
  const T* w_col = nullptr;    // [cols] or null (1)
  const T* factor = nullptr;   // device scalar c multiplying every entry, or null (1)
  Out* out = nullptr;          // [rows x cols], row stride ld_out; may be `logits` itself when Out is T
  int64_t ld_out = 0;
  const T* inv_n_row = nullptr;  // multi-positive labels (masks.multi): [rows] 1/n_i
  const T* inv_n_col = nullptr;  // and [cols] 1/m_j (with lse_col), else null
};

/// Gradient tiles: (column tiles, row tiles), row tiles strided past kMaxGridY.
struct TileGrid {
  int64_t col_tiles = 0, row_tiles = 0, grid_y = 0;
};
inline TileGrid tile_grid(int64_t rows, int64_t cols) {
  TileGrid g;
  if (rows <= 0 || cols <= 0) return g;
  g.col_tiles = (cols + kThreads - 1) / kThreads;
  g.row_tiles = (rows + kGradRows - 1) / kGradRows;
  g.grid_y = g.row_tiles < kMaxGridY ? g.row_tiles : kMaxGridY;
  return g;
}

/// Thread `tid` of tile (col_tile, row_tile): its column of the tile's rows.
/// Every entry is read once and written once by the same thread, so the
/// output may alias the logits.
///
/// The -Y terms. The gradient of sum_u w_u l_u with respect to S_ij
/// (engine/block.h) is, before the factor c,
///   w_i (exp(S_ij - lse_row_i) - Y_ij) + w_j (exp(S_ij - lse_col_j) - Yc_ij),
/// the second term when symmetric, because l^row_i = lse_row_i - sum_j Y_ij
/// S_ij with the targets Y constant: d lse_row_i / d S_ij is the softmax
/// entry and d (sum_j Y_ij S_ij) / d S_ij is Y_ij (and so for the columns,
/// l^col_j = lse_col_j - sum_i Yc_ij S_ij). Designated positives: Y = Yc =
/// 1 on (i, pos(i)), 0 elsewhere. Multi-positive labels: Y_ij = P_ij / n_i
/// and Yc_ij = P_ij / m_j, so the thread subtracts w_i P_ij / n_i and w_j
/// P_ij / m_j, P_ij by index from the labels (in_positive_set) and 1/n_i,
/// 1/m_j from the forward's counts (inv_n_row, inv_n_col).
template <typename T, typename Out>
CONTRAX_HD void grad_thread(const GradArgs<T, Out>& a, int64_t col_tile, int64_t row_tile, int tid) {
  const int64_t c = col_tile * kThreads + tid;
  if (c >= a.cols) return;
  const T f = a.factor ? *a.factor : T(1);
  const bool sym = a.lse_col != nullptr;
  const Masks& k = a.masks;
  const T lc = sym ? a.lse_col[c] : T(0), wc = a.w_col ? a.w_col[c] : T(1);
  const T inv_m = sym && k.multi ? a.inv_n_col[c] : T(0);
  CONTRAX_UNROLL
  for (int q = 0; q < kGradRows; ++q) {
    const int64_t r = row_tile * kGradRows + q;
    if (r < a.rows) {
      const T x = masked_logit(a.logits, a.ld, a.bias, k, r, c);
      const bool pos = k.positives && math::is_positive(k.row0 + r, k.col0 + c, k.pos_offset, k.group);
      const bool in_p = in_positive_set(k, r, c);
      const T y_row = in_p ? a.inv_n_row[r] : T(pos), y_col = in_p ? inv_m : T(pos);
      const T wr = a.w_row ? a.w_row[r] : T(1);
      a.out[r * a.ld_out + c] =
          static_cast<Out>(f * math::contrastive_grad_y(x, a.lse_row[r], wr, y_row, sym, lc, wc, y_col));
    }
  }
}

/// The same arguments with the output seen as `Dev`, a type of the same
/// storage (the API's Bf16 / Fp16 as CUDA's __nv_bfloat16 / __half, or the
/// emulator's c10 types).
template <typename Dev, typename T, typename Out>
GradArgs<T, Dev> with_output(const GradArgs<T, Out>& a) {
  static_assert(sizeof(Dev) == sizeof(Out), "an output type of the same storage");
  GradArgs<T, Dev> d;
  d.logits = a.logits, d.rows = a.rows, d.cols = a.cols, d.ld = a.ld, d.bias = a.bias, d.masks = a.masks;
  d.lse_row = a.lse_row, d.w_row = a.w_row, d.lse_col = a.lse_col, d.w_col = a.w_col, d.factor = a.factor;
  d.out = reinterpret_cast<Dev*>(a.out), d.ld_out = a.ld_out;
  d.inv_n_row = a.inv_n_row, d.inv_n_col = a.inv_n_col;
  return d;
}

// ---- SigLIP (strips)

template <typename T, typename Out>
struct SiglipArgs {
  const T* logits = nullptr;  // [rows x cols] of s a_i.b_j, row stride ld
  int64_t rows = 0, cols = 0, ld = 0;
  const T* bias = nullptr;  // device scalar or null
  int64_t row0 = 0, col0 = 0;
  bool own = false;  // the block holds the positives (i, i): this rank's own keys
  const T* factor = nullptr;  // device scalar multiplying the gradient, or null (1)
  Out* grad = nullptr;        // [rows x cols] (row stride ld_grad): factor d loss/d x, or null
  int64_t ld_grad = 0;
  T* row_loss = nullptr;  // [rows]: sum over the panel's columns of softplus(-z x)
  T* row_grad = nullptr;  // [rows]: sum of the gradient entries as written (before rounding), or null
  T* ws = nullptr;        // strip_workspace(grid, rows, 0) elements
};

/// Lane `lane` of the warp that handles strip row k of block (strip, split):
/// writes its entries of that row's gradient (columns lane, lane + kWarp, ...
/// of the split's range) and returns its partial sums (loss in .m, gradient
/// in .s; plain sums, not pairs). A warp per row rather than a thread per
/// column (as lse_thread): no per-row registers, so the inlined softplus and
/// sigmoid fit without spills.
template <typename T, typename Out>
CONTRAX_HD MaxSum<T> siglip_lane(const SiglipArgs<T, Out>& a, const StripGrid& g, int64_t strip, int64_t split, int k,
                                 int lane) {
  MaxSum<T> acc{T(0), T(0)};
  const SplitRow q = split_row(a.cols, g, strip, split, k);
  const int64_t r = q.r, c_begin = q.begin, c_end = q.end;
  if (r >= a.rows) return acc;
  const T f = a.factor ? *a.factor : T(1);
  const T bias = a.bias ? *a.bias : T(0);
  for (int64_t c = c_begin + lane; c < c_end; c += kWarp) {
    const T x = a.logits[r * a.ld + c] + bias;
    const bool pos = a.own && a.row0 + r == a.col0 + c;
    const math::SigmoidPair<T> e = math::siglip_pair(x, pos);
    const T gx = f * e.grad;
    if (a.grad) a.grad[r * a.ld_grad + c] = static_cast<Out>(gx);
    acc.m += e.loss;
    acc.s += gx;
  }
  return acc;
}

/// The warp's sums of strip row k (its lanes' added) as the split's partial.
template <typename T, typename Out>
CONTRAX_HD void siglip_store_row(const SiglipArgs<T, Out>& a, const StripGrid& g, int64_t strip, int64_t split,
                                 int k, MaxSum<T> p) {
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, 0);
  store_split_row(w.rm, w.rs, a.rows, split, strip * kStripRows + k, p);
}

/// Finishing thread t < rows: row t's loss and gradient sums over the splits.
template <typename T, typename Out>
CONTRAX_HD void siglip_finish_thread(const SiglipArgs<T, Out>& a, const StripGrid& g, int64_t t) {
  if (t >= a.rows) return;
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, 0);
  const MaxSum<T> p = sum_parts(w.rm, w.rs, g.splits, a.rows, t);  // loss in .m, gradient in .s
  if (a.row_loss) a.row_loss[t] = p.m;
  if (a.row_grad) a.row_grad[t] = p.s;
}

/// The same arguments with the gradient seen as `Dev` (as GradArgs' with_output).
template <typename Dev, typename T, typename Out>
SiglipArgs<T, Dev> with_output(const SiglipArgs<T, Out>& a) {
  static_assert(sizeof(Dev) == sizeof(Out), "an output type of the same storage");
  SiglipArgs<T, Dev> d;
  d.logits = a.logits, d.rows = a.rows, d.cols = a.cols, d.ld = a.ld, d.bias = a.bias;
  d.row0 = a.row0, d.col0 = a.col0, d.own = a.own, d.factor = a.factor;
  d.grad = reinterpret_cast<Dev*>(a.grad), d.ld_grad = a.ld_grad;
  d.row_loss = a.row_loss, d.row_grad = a.row_grad, d.ws = a.ws;
  return d;
}

/// Combines two partial sums of SigLIP rows (the warp reduction's step).
template <typename T>
CONTRAX_HD MaxSum<T> add_sums(MaxSum<T> a, MaxSum<T> b) {
  return {a.m + b.m, a.s + b.s};
}

}  // namespace contrax::detail::panels
