// The block and warp reductions of the strip kernels (cuda_lse_panel.cuh,
// cuda_siglip_panel.cuh). A warp butterfly (__shfl_xor_sync, offsets 16, 8,
// 4, 2, 1: warp_combine) leaves the warp's combined pair in every lane.
// reduce_strip_rows: every thread holds a partial of each of a strip's
// kStripRows rows (panel_grid.h); each warp's partial of every row goes from
// its lane 0 to shared memory, and warp 0 merges the kWarps warps' partials
// of row `lane` in warp order. warp_row_sums: warp w takes strip rows w, w +
// kWarps, ..., each lane a partial sum of the row, added by the butterfly.
// Device code: nvcc's, or the SIMT emulator's (tests/support/simt.h) on the
// CPU.
#pragma once

#include "engine/kernels/panel_grid.h"

namespace contrax::detail::panels {

/// Plain sums in both members of a pair (SigLIP's loss and gradient sums,
/// multi-positive labels' positive sums and counts).
struct AddSums {
  template <typename T>
  __device__ MaxSum<T> operator()(MaxSum<T> a, MaxSum<T> b) const {
    return add_sums(a, b);
  }
};

/// The warp's lanes' pairs combined, in every lane. Every lane of the warp
/// must call it (a full-warp shuffle).
template <typename T, typename Combine>
__device__ __forceinline__ MaxSum<T> warp_combine(MaxSum<T> p, Combine combine) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) {
    const MaxSum<T> q{__shfl_xor_sync(0xffffffffu, p.m, off), __shfl_xor_sync(0xffffffffu, p.s, off)};
    p = combine(p, q);
  }
  return p;
}

/// Warp w of the block takes the strip's rows w, w + kWarps, ... below
/// `rows`: `lane_sums(k, lane)` is the lane's partial of strip row k, and
/// `store(k, p)` (lane 0) receives the warp's sum. The loop's bound is the
/// same for every lane of a warp, so the butterfly never diverges.
template <typename Lane, typename Store>
__device__ __forceinline__ void warp_row_sums(int64_t rows, int64_t strip, Lane lane_sums, Store store) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int k = warp; k < kStripRows && strip * kStripRows + k < rows; k += kWarps) {
    const auto p = warp_combine(lane_sums(k, lane), AddSums{});
    if (lane == 0) store(k, p);
  }
}

// `combine(a, b)` merges two partials; `store(k, p)` receives row k's block
// partial (called by warp 0's lane k).
template <typename T, typename Combine, typename Store>
__device__ __forceinline__ void reduce_strip_rows(MaxSum<T> (&acc)[kStripRows], Combine combine, Store store) {
  __shared__ T shared_m[kWarps][kStripRows];
  __shared__ T shared_s[kWarps][kStripRows];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int k = 0; k < kStripRows; ++k) {
    const MaxSum<T> p = warp_combine(acc[k], combine);
    if (lane == 0) {
      shared_m[warp][k] = p.m;
      shared_s[warp][k] = p.s;
    }
  }
  __syncthreads();
  if (warp == 0) {
    MaxSum<T> p{shared_m[0][lane], shared_s[0][lane]};
#pragma unroll
    for (int w = 1; w < kWarps; ++w) p = combine(p, MaxSum<T>{shared_m[w][lane], shared_s[w][lane]});
    store(lane, p);
  }
}

}  // namespace contrax::detail::panels
