// CUDA kernels of SigLIP's forward: for a panel of logits x = s a_i.b_j (the
// bias a device scalar added here), the rows' loss sums sum_j softplus(-z x),
// the gradient panel c (-z sigmoid(-z x)) in the GEMM operand's dtype and its
// row sums (the bias gradient), all in one read of the logits, so that the
// backward only scales what the forward wrote. z = +1 on the positives
// (i, i) of this rank's own block, by index. LibTorch-free: CUDA runtime and
// panel_grid.h only.
//
// Grid (panel_grid.h, "strips", as cuda_lse_panel.cu): blocks of 256 threads,
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
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/kernels/cuda_panels_api.h"

namespace contrax::detail::panels {

namespace {

template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads) siglip_strips(const SiglipArgs<T, Out> a, const StripGrid g) {
  const int64_t strip = blockIdx.x, split = blockIdx.y;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int k = warp; k < kStripRows && strip * kStripRows + k < a.rows; k += kWarps) {  // uniform per warp
    MaxSum<T> p = siglip_lane(a, g, strip, split, k, lane);
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) {
      p = add_sums(p, MaxSum<T>{__shfl_xor_sync(0xffffffffu, p.m, off), __shfl_xor_sync(0xffffffffu, p.s, off)});
    }
    if (lane == 0) siglip_store_row(a, g, strip, split, k, p);
  }
}

template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads) siglip_finish(const SiglipArgs<T, Out> a, const StripGrid g) {
  siglip_finish_thread(a, g, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
}

template <typename Dev, typename T, typename Out>
SiglipArgs<T, Dev> as_device(const SiglipArgs<T, Out>& a) {
  SiglipArgs<T, Dev> d;
  d.logits = a.logits, d.rows = a.rows, d.cols = a.cols, d.ld = a.ld, d.bias = a.bias;
  d.row0 = a.row0, d.col0 = a.col0, d.own = a.own, d.factor = a.factor;
  d.grad = reinterpret_cast<Dev*>(a.grad), d.ld_grad = a.ld_grad;
  d.row_loss = a.row_loss, d.row_grad = a.row_grad, d.ws = a.ws;
  return d;
}

template <typename T, typename Out>
int launch(const SiglipArgs<T, Out>& a, int sm_count, cudaStream_t stream) {
  if (a.rows <= 0) return 0;
  const StripGrid g = strip_grid(a.rows, a.cols, sm_count);
  if (g.strips > 0 && g.splits > 0) {
    const dim3 grid(static_cast<unsigned>(g.strips), static_cast<unsigned>(g.splits));
    siglip_strips<T, Out><<<grid, kThreads, 0, stream>>>(a, g);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  }
  siglip_finish<T, Out><<<static_cast<unsigned>((a.rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(a, g);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int siglip_panel(const SiglipArgs<float, float>& a, int sm_count, cudaStream_t stream) {
  return launch(a, sm_count, stream);
}
int siglip_panel(const SiglipArgs<float, Bf16>& a, int sm_count, cudaStream_t stream) {
  return launch(as_device<__nv_bfloat16>(a), sm_count, stream);
}
int siglip_panel(const SiglipArgs<float, Fp16>& a, int sm_count, cudaStream_t stream) {
  return launch(as_device<__half>(a), sm_count, stream);
}
int siglip_panel(const SiglipArgs<double, double>& a, int sm_count, cudaStream_t stream) {
  return launch(a, sm_count, stream);
}

}  // namespace contrax::detail::panels
