// The CUDA panel kernels (src/engine/kernels/cuda_*_panel.cu) on tensors:
// pointers, strides and PyTorch's current stream for the kernels' host API,
// and their workspace from the caching allocator. Compiled only where CMake
// builds the kernels (option CONTRAX_CUDA_KERNELS; the generated
// engine/cuda_kernels_built.h says so), and reached from engine/lse_kernels.cpp
// on CUDA tensors when the fused CUDA kernels are on. Internal, not installed.
#pragma once

#include <torch/torch.h>

namespace contrax::detail {

/// Row log-sum-exps of the CUDA float/double tile `t` ([R, C], unit column
/// stride) when `rows` (else undefined), and, when `col_m` is defined, its
/// columns merged into the running pairs (col_m, col_s) ([C] each,
/// contiguous, t's dtype; log-sum-exp = col_m + log(col_s)). One kernel pass
/// over the tile and one small finishing kernel.
torch::Tensor cuda_tile_lse(const torch::Tensor& t, bool rows, const torch::Tensor& col_m, const torch::Tensor& col_s);

/// softmax_grad_ (engine/lse_kernels.h) on a CUDA float/double tile, in place:
/// t_ij <- w_row_i exp(t_ij - lse_row_i) [+ w_col_j exp(t_ij - lse_col_j)],
/// masked (-inf) entries 0. The vectors contiguous, t's dtype and device.
void cuda_softmax_grad_(torch::Tensor& t, const torch::Tensor& lse_row, const torch::Tensor& w_row,
                        const torch::Tensor& lse_col, const torch::Tensor& w_col);

}  // namespace contrax::detail
