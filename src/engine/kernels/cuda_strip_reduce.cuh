// The block reduction of the strip kernels (cuda_lse_panel.cuh): every
// thread holds a partial of each of a strip's kStripRows rows (panel_grid.h); a warp butterfly (__shfl_xor_sync, offsets
// 16, 8, 4, 2, 1) leaves each warp's partial of every row in its lane 0, which
// writes it to shared memory, and warp 0 merges the kWarps warps' partials of
// row `lane` in warp order. Device code: nvcc's, or the SIMT emulator's
// (tests/support/simt.h) on the CPU.
#pragma once

#include "engine/kernels/panel_grid.h"

namespace contrax::detail::panels {

// `combine(a, b)` merges two partials; `store(k, p)` receives row k's block
// partial (called by warp 0's lane k).
template <typename T, typename Combine, typename Store>
__device__ __forceinline__ void reduce_strip_rows(MaxSum<T> (&acc)[kStripRows], Combine combine, Store store) {
  __shared__ T shared_m[kWarps][kStripRows];
  __shared__ T shared_s[kWarps][kStripRows];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int k = 0; k < kStripRows; ++k) {
    MaxSum<T> p = acc[k];
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) {
      const MaxSum<T> q{__shfl_xor_sync(0xffffffffu, p.m, off), __shfl_xor_sync(0xffffffffu, p.s, off)};
      p = combine(p, q);
    }
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
