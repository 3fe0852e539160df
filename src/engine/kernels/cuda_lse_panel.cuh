// The CUDA kernels of the CLIP / InfoNCE / NT-Xent / MoCo v3 / grouped
// forward and their launch sequence (the host API is cuda_lse_panel.cu's):
// the row log-sum-exps of a panel of logits and its columns' (max, sum) pairs
// merged into running ones, in one read of the logits (online maxima, so no
// underflow at any temperature; the masked diagonal and equal-label
// duplicates by index). Device code and the sequence over any launcher
// (cuda_stream_launch.cuh on a GPU; the SIMT emulator, tests/support/simt.h,
// on the CPU, which compiles this file unchanged). LibTorch-free.
//
// Grid (panel_grid.h, "strips"): blocks of 256 threads, grid
// (ceil(rows / 32) strips, splits column ranges), splits chosen so that there
// are at least twice as many blocks as multiprocessors. Thread t of a block
// walks columns t, t + 256, ... of its range; for each column it reads the
// strip's 32 rows (coalesced: a warp reads 32 consecutive floats of a row),
// keeps the column's pair over them (stored as the strip's partial pair of
// that column: workspace [strips][cols]) and adds each entry to its own
// partial of that row (32 pairs in registers). The block merges its threads'
// row partials (warp butterfly, then the 8 warps in shared memory,
// cuda_strip_reduce.cuh) into the split's partial of each row (workspace
// [splits][rows]). A second kernel, one thread per row and per column
// (ceil(max(rows, cols) / 256) blocks), merges the splits into each row's
// log-sum-exp and the strips into each column's running pair. Tails (rows
// past the last full strip, columns past the last full 256) are skipped by
// index. Traffic: 4 bytes per logit read, 0.25 per logit of column partials.
// Multi-positive labels (LseArgs::pos_row): each column's sums of P_ij x_ij
// and P_ij over the strip in the same walk (two registers), each row's in a
// second walk of the block's strip, a warp per row as SigLIP's
// (warp_row_sums), merged by the finishing kernel like the pairs.
#pragma once

#include "engine/kernels/cuda_strip_reduce.cuh"

namespace contrax::detail::panels {

// Internal linkage: the emulated build of these kernels and nvcc's host stubs
// of them may share an executable (the tests link both).
namespace {

struct MergePairs {
  template <typename T>
  __device__ MaxSum<T> operator()(MaxSum<T> a, MaxSum<T> b) const {
    return math::merge(a, b);
  }
};

template <typename T>
struct StoreRow {
  const LseArgs<T>& a;
  const StripGrid& g;
  int64_t strip, split;
  __device__ void operator()(int k, MaxSum<T> p) const { lse_store_row(a, g, strip, split, k, p); }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) lse_strips(const LseArgs<T> a, const StripGrid g) {
  MaxSum<T> acc[kStripRows];
  const int64_t strip = blockIdx.x, split = blockIdx.y;
  lse_thread(a, g, strip, split, static_cast<int>(threadIdx.x), acc);
  // Both conditions the same for every thread of the block.
  if (a.row_lse != nullptr) reduce_strip_rows(acc, MergePairs{}, StoreRow<T>{a, g, strip, split});
  if (a.pos_row != nullptr) {  // multi-positive labels: the rows' positive sums and counts
    warp_row_sums(
        a.rows, strip, [&](int k, int lane) { return positive_lane(a, g, strip, split, k, lane); },
        [&](int k, MaxSum<T> p) { positive_store_row(a, g, strip, split, k, p); });
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) lse_finish(const LseArgs<T> a, const StripGrid g) {
  lse_finish_thread(a, g, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
}

/// lse_panel's launches (cuda_panels_api.h) through `launch`: the strips
/// pass where there are strips and something to write, then the finishing
/// pass (also with multi-positive labels' sums: no launch of their own).
/// Returns 0 or the first failed launch's error.
template <typename T, typename Launch>
int lse_launches(const LseArgs<T>& a, int sm_count, const Launch& launch) {
  if (a.rows <= 0 && a.cols <= 0) return 0;
  const StripGrid g = strip_grid(a.rows, a.cols, sm_count);
  const bool rows = a.row_lse || a.pos_row, cols = a.col_m || a.pos_col;
  if (g.strips > 0 && g.splits > 0 && (rows || cols)) {
    const dim3 grid(static_cast<unsigned>(g.strips), static_cast<unsigned>(g.splits));
    if (const int e = launch(lse_strips<T>, grid, dim3(kThreads), a, g)) return e;
  }
  const int64_t n = a.rows > a.cols ? a.rows : a.cols;
  if (rows || (cols && g.strips > 0)) {
    return launch(lse_finish<T>, dim3(static_cast<unsigned>((n + kThreads - 1) / kThreads)), dim3(kThreads), a, g);
  }
  return 0;
}

}  // namespace

}  // namespace contrax::detail::panels
