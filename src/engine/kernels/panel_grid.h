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
/// engine/block.h.
struct Masks {
  int64_t row0 = 0, col0 = 0;
  bool diag = false;
  int64_t diag_offset = 0;
  const int64_t* row_labels = nullptr;  // [rows] and [cols], or both null:
  const int64_t* col_labels = nullptr;  // equal labels masked except on the designated positive
  bool positives = false;               // whether the designated positives exist (gradient: y = 1 there)
  int64_t pos_offset = 0, group = 1;
};

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
/// log-sum-exps' columns (`cols` 0 for SigLIP), two per (strip, col).
inline int64_t strip_workspace(const StripGrid& g, int64_t rows, int64_t cols) {
  return 2 * (g.splits * rows + g.strips * cols);
}

/// The logit at panel entry (r, c): bias added, masked entries -inf.
template <typename T>
CONTRAX_HD T masked_logit(const T* logits, int64_t ld, const T* bias, const Masks& k, int64_t r, int64_t c) {
  T x = logits[r * ld + c];
  if (bias) x += *bias;
  const int64_t i = k.row0 + r, j = k.col0 + c;
  if (k.diag && math::on_diagonal(i, j, k.diag_offset)) return -math::inf<T>();
  const bool positive = k.positives && math::is_positive(i, j, k.pos_offset, k.group);
  if (k.row_labels && k.row_labels[r] == k.col_labels[c] && !positive) return -math::inf<T>();
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
  T* ws = nullptr;  // strip_workspace(grid) elements
};

// Workspace layout: row partials [splits][rows] (m, then s), then column
// partials [strips][cols] (m, then s).
template <typename T>
struct StripWs {
  T *rm, *rs, *cm, *cs;
};
template <typename T>
CONTRAX_HD StripWs<T> strip_ws(T* ws, const StripGrid& g, int64_t rows, int64_t cols) {
  const int64_t nr = g.splits * rows, nc = g.strips * cols;
  return {ws, ws + nr, ws + 2 * nr, ws + 2 * nr + nc};
}

/// Thread `tid` of block (strip, split): its columns' strip pairs into the
/// workspace, and its partial pair of each strip row into `rows_acc`.
template <typename T>
CONTRAX_HD void lse_thread(const LseArgs<T>& a, const StripGrid& g, int64_t strip, int64_t split, int tid,
                           MaxSum<T> (&rows_acc)[kStripRows]) {
  const bool want_rows = a.row_lse != nullptr, want_cols = a.col_m != nullptr;
  const int64_t r0 = strip * kStripRows, c_begin = split * g.split_cols;
  const int64_t c_end = c_begin + g.split_cols < a.cols ? c_begin + g.split_cols : a.cols;
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, a.cols);
  CONTRAX_UNROLL
  for (int k = 0; k < kStripRows; ++k) rows_acc[k] = math::empty_pair<T>();
  for (int64_t c = c_begin + tid; c < c_end; c += kThreads) {
    MaxSum<T> col = math::empty_pair<T>();
    CONTRAX_UNROLL
    for (int k = 0; k < kStripRows; ++k) {
      if (r0 + k < a.rows) {
        const T x = masked_logit(a.logits, a.ld, a.bias, a.masks, r0 + k, c);
        if (want_cols) math::add(col, x);
        if (want_rows) math::add(rows_acc[k], x);
      }
    }
    if (want_cols) {
      w.cm[strip * a.cols + c] = col.m;
      w.cs[strip * a.cols + c] = col.s;
    }
  }
}

/// Writes the block's combined pair of strip row k (already merged over the
/// block's threads) as the split's row partial.
template <typename T>
CONTRAX_HD void lse_store_row(const LseArgs<T>& a, const StripGrid& g, int64_t strip, int64_t split, int k,
                              MaxSum<T> p) {
  const int64_t r = strip * kStripRows + k;
  if (r >= a.rows || !a.row_lse) return;
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, a.cols);
  w.rm[split * a.rows + r] = p.m;
  w.rs[split * a.rows + r] = p.s;
}

/// Finishing thread t (t < max(rows, cols)): row t's log-sum-exp over the
/// splits, and column t's strips merged into the running pair.
template <typename T>
CONTRAX_HD void lse_finish_thread(const LseArgs<T>& a, const StripGrid& g, int64_t t) {
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, a.cols);
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
template <typename T, typename Out>
CONTRAX_HD void grad_thread(const GradArgs<T, Out>& a, int64_t col_tile, int64_t row_tile, int tid) {
  const int64_t c = col_tile * kThreads + tid;
  if (c >= a.cols) return;
  const T f = a.factor ? *a.factor : T(1);
  const bool sym = a.lse_col != nullptr;
  const T lc = sym ? a.lse_col[c] : T(0), wc = a.w_col ? a.w_col[c] : T(1);
  const Masks& k = a.masks;
  CONTRAX_UNROLL
  for (int q = 0; q < kGradRows; ++q) {
    const int64_t r = row_tile * kGradRows + q;
    if (r < a.rows) {
      const T x = masked_logit(a.logits, a.ld, a.bias, k, r, c);
      const bool pos = k.positives && math::is_positive(k.row0 + r, k.col0 + c, k.pos_offset, k.group);
      const T wr = a.w_row ? a.w_row[r] : T(1);
      a.out[r * a.ld_out + c] = static_cast<Out>(f * math::contrastive_grad(x, a.lse_row[r], wr, sym, lc, wc, pos));
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
  const int64_t r = strip * kStripRows + k, c_begin = split * g.split_cols;
  if (r >= a.rows) return acc;
  const int64_t c_end = c_begin + g.split_cols < a.cols ? c_begin + g.split_cols : a.cols;
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
  const int64_t r = strip * kStripRows + k;
  if (r >= a.rows) return;
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, 0);
  w.rm[split * a.rows + r] = p.m;
  w.rs[split * a.rows + r] = p.s;
}

/// Finishing thread t < rows: row t's loss and gradient sums over the splits.
template <typename T, typename Out>
CONTRAX_HD void siglip_finish_thread(const SiglipArgs<T, Out>& a, const StripGrid& g, int64_t t) {
  if (t >= a.rows) return;
  const StripWs<T> w = strip_ws(a.ws, g, a.rows, 0);
  T loss = T(0), grad = T(0);
  for (int64_t s = 0; s < g.splits; ++s) loss += w.rm[s * a.rows + t], grad += w.rs[s * a.rows + t];
  if (a.row_loss) a.row_loss[t] = loss;
  if (a.row_grad) a.row_grad[t] = grad;
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
