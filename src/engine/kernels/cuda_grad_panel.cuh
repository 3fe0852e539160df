// The CUDA kernel of the CLIP / InfoNCE / NT-Xent / MoCo v3 / grouped
// backward and its launch (the host API is cuda_grad_panel.cu's): the
// gradient panel G = c [w_row (exp(S - lse_row) - Y) + w_col (exp(S -
// lse_col) - Y)] (engine/block.h) in one read of the fp32 (or fp64) logits,
// written in the GEMM operand's dtype (bf16, fp16, fp32, fp64), so that the
// cast and the factor c (a device scalar: no host read) cost no extra pass.
// Masked entries (the diagonal, equal-label duplicates) and the designated
// positives Y by index. Device code and the launch over any launcher
// (cuda_stream_launch.cuh on a GPU; the SIMT emulator, tests/support/simt.h,
// on the CPU, which compiles this file unchanged). LibTorch-free.
//
// Grid (panel_grid.h, "tiles"): blocks of 256 threads over tiles of 8 rows by
// 256 columns, grid (ceil(cols / 256), min(ceil(rows / 8), 65535)), the row
// tiles strided by the grid's height past that. Thread t owns column
// c0 + t of its tile: it reads lse_col and w_col once and then its 8 entries
// (each warp a coalesced 128-byte row segment), and writes each entry where it
// read it, so the output may alias the logits (fp32/fp64 in place). Tails
// (columns past cols, rows past rows) are skipped by index. No reduction, no
// shared memory, no workspace.
#pragma once

#include "engine/kernels/panel_grid.h"

namespace contrax::detail::panels {

// Internal linkage: the emulated build of this kernel and nvcc's host stub of
// it may share an executable (the tests link both).
namespace {

template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads) grad_tiles(const GradArgs<T, Out> a, const TileGrid g) {
  for (int64_t row_tile = blockIdx.y; row_tile < g.row_tiles; row_tile += gridDim.y) {
    grad_thread(a, blockIdx.x, row_tile, static_cast<int>(threadIdx.x));
  }
}

/// grad_panel's launch (cuda_panels_api.h) through `launch`: none for an
/// empty panel. Returns 0 or the launch's error.
template <typename T, typename Out, typename Launch>
int grad_launches(const GradArgs<T, Out>& a, const Launch& launch) {
  const TileGrid g = tile_grid(a.rows, a.cols);
  if (g.col_tiles == 0) return 0;
  const dim3 grid(static_cast<unsigned>(g.col_tiles), static_cast<unsigned>(g.grid_y));
  return launch(grad_tiles<T, Out>, grid, dim3(kThreads), a, g);
}

}  // namespace

}  // namespace contrax::detail::panels
