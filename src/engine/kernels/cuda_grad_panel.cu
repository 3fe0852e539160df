// CUDA kernel of the CLIP / InfoNCE / NT-Xent / MoCo v3 / grouped backward:
// the gradient panel G = c [w_row (exp(S - lse_row) - Y) + w_col (exp(S -
// lse_col) - Y)] (engine/block.h) in one read of the fp32 (or fp64) logits,
// written in the GEMM operand's dtype (bf16, fp16, fp32, fp64), so that the
// cast and the factor c (a device scalar: no host read) cost no extra pass.
// Masked entries (the diagonal, equal-label duplicates) and the designated
// positives Y by index. LibTorch-free: CUDA runtime and panel_grid.h only.
//
// Grid (panel_grid.h, "tiles"): blocks of 256 threads over tiles of 8 rows by
// 256 columns, grid (ceil(cols / 256), min(ceil(rows / 8), 65535)), the row
// tiles strided by the grid's height past that. Thread t owns column
// c0 + t of its tile: it reads lse_col and w_col once and then its 8 entries
// (each warp a coalesced 128-byte row segment), and writes each entry where it
// read it, so the output may alias the logits (fp32/fp64 in place). Tails
// (columns past cols, rows past rows) are skipped by index. No reduction, no
// shared memory, no workspace.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/kernels/cuda_panels_api.h"

namespace contrax::detail::panels {

namespace {

template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads) grad_tiles(const GradArgs<T, Out> a, const TileGrid g) {
  for (int64_t row_tile = blockIdx.y; row_tile < g.row_tiles; row_tile += gridDim.y) {
    grad_thread(a, blockIdx.x, row_tile, static_cast<int>(threadIdx.x));
  }
}

// The same arguments with the output seen as CUDA's own half type.
template <typename Dev, typename T, typename Out>
GradArgs<T, Dev> as_device(const GradArgs<T, Out>& a) {
  GradArgs<T, Dev> d;
  d.logits = a.logits, d.rows = a.rows, d.cols = a.cols, d.ld = a.ld, d.bias = a.bias, d.masks = a.masks;
  d.lse_row = a.lse_row, d.w_row = a.w_row, d.lse_col = a.lse_col, d.w_col = a.w_col, d.factor = a.factor;
  d.out = reinterpret_cast<Dev*>(a.out), d.ld_out = a.ld_out;
  return d;
}

template <typename T, typename Out>
int launch(const GradArgs<T, Out>& a, cudaStream_t stream) {
  const TileGrid g = tile_grid(a.rows, a.cols);
  if (g.col_tiles == 0) return 0;
  const dim3 grid(static_cast<unsigned>(g.col_tiles), static_cast<unsigned>(g.grid_y));
  grad_tiles<T, Out><<<grid, kThreads, 0, stream>>>(a, g);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int grad_panel(const GradArgs<float, float>& a, cudaStream_t stream) { return launch(a, stream); }
int grad_panel(const GradArgs<float, Bf16>& a, cudaStream_t stream) {
  return launch(as_device<__nv_bfloat16>(a), stream);
}
int grad_panel(const GradArgs<float, Fp16>& a, cudaStream_t stream) { return launch(as_device<__half>(a), stream); }
int grad_panel(const GradArgs<double, double>& a, cudaStream_t stream) { return launch(a, stream); }

}  // namespace contrax::detail::panels
