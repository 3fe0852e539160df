// The CUDA kernels of SigLIP's forward and their launch sequence (the host
// API is cuda_siglip_panel.cu's): for a panel of logits x = s a_i.b_j (the
// bias a device scalar added here), the rows' loss sums sum_j softplus(-z x),
// the gradient panel c (-z sigmoid(-z x)) in the GEMM operand's dtype and its
// row sums (the bias gradient), all in one read of the logits, so that the
// backward only scales what the forward wrote. z = +1 on the positives
// (i, i) of this rank's own block, by index. Device code and the sequence
// over any launcher (cuda_stream_launch.cuh on a GPU; the SIMT emulator,
// tests/support/simt.h, on the CPU, which compiles this file unchanged).
// LibTorch-free.
//
// Grid (panel_grid.h, "strips", as cuda_lse_panel.cuh): blocks of 256 threads,
// grid (ceil(rows / 32) strips, splits column ranges). Warp w of a block takes
// the strip's rows w, w + 8, w + 16, w + 24; for each, lane l walks columns
// l, l + 32, ... of the range (coalesced 128-byte reads and gradient writes),
// adding each entry's loss and gradient to two partial sums, which a warp
// butterfly (__shfl_xor_sync, offsets 16 to 1) adds into the split's sums of
// that row (workspace [splits][rows], two each). A second kernel, one thread
// per row, adds the splits in order (deterministic: no atomics). Tails (rows
// past the last full strip, columns past the range) are skipped by index; no
// shared memory. (A thread per column with 32 rows' sums in registers, as the
// log-sum-exp kernel does, spills once softplus and sigmoid are inlined.)
#pragma once

#include "engine/kernels/cuda_strip_reduce.cuh"

namespace contrax::detail::panels {

// Internal linkage: the emulated build of these kernels and nvcc's host stubs
// of them may share an executable (the tests link both).
namespace {

template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads) siglip_strips(const SiglipArgs<T, Out> a, const StripGrid g) {
  const int64_t strip = blockIdx.x, split = blockIdx.y;
  warp_row_sums(
      a.rows, strip, [&](int k, int lane) { return siglip_lane(a, g, strip, split, k, lane); },
      [&](int k, MaxSum<T> p) { siglip_store_row(a, g, strip, split, k, p); });
}

template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads) siglip_finish(const SiglipArgs<T, Out> a, const StripGrid g) {
  siglip_finish_thread(a, g, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
}

/// siglip_panel's launches (cuda_panels_api.h) through `launch`: the strips
/// pass where there are strips, then the finishing pass over the rows.
/// Returns 0 or the first failed launch's error.
template <typename T, typename Out, typename Launch>
int siglip_launches(const SiglipArgs<T, Out>& a, int sm_count, const Launch& launch) {
  if (a.rows <= 0) return 0;
  const StripGrid g = strip_grid(a.rows, a.cols, sm_count);
  if (g.strips > 0 && g.splits > 0) {
    const dim3 grid(static_cast<unsigned>(g.strips), static_cast<unsigned>(g.splits));
    if (const int e = launch(siglip_strips<T, Out>, grid, dim3(kThreads), a, g)) return e;
  }
  return launch(siglip_finish<T, Out>, dim3(static_cast<unsigned>((a.rows + kThreads - 1) / kThreads)),
                dim3(kThreads), a, g);
}

}  // namespace

}  // namespace contrax::detail::panels
