// The host API of the CUDA panel kernels (cuda_lse_panel.cu,
// cuda_grad_panel.cu, cuda_siglip_panel.cu): C-style launches on raw device
// pointers, sizes, strides and a stream, with every scalar (bias, factors,
// weights) a device pointer, so that no launch reads device memory from the
// host (no synchronisation; capturable in a CUDA graph). The argument structs
// are panel_grid.h's, the same ones the kernels take under the SIMT emulator
// (tests/support/emulated_panels.h). No CUDA or LibTorch header here: the
// engine's table of the kernels (engine/panel_kernels.h) includes it; only
// builds with CONTRAX_CUDA_KERNELS define these functions.
//
// Each launch returns the CUDA error of its launches as an int (0 = success;
// cudaError_t's value otherwise), for the caller to check.
#pragma once

#include <cstdint>

#include "engine/kernels/panel_grid.h"

// CUDA's own definition (driver_types.h): repeating a typedef is valid C++.
typedef struct CUstream_st* cudaStream_t;

namespace contrax::detail::panels {

/// Storage of a bf16 / fp16 output element (at::BFloat16 and at::Half have
/// this layout; the kernels read it as __nv_bfloat16 / __half).
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

/// Row log-sum-exps and running column pairs of a panel (LseArgs), in one
/// read of its logits (multi-positive labels' sums in the same launches, their
/// rows' a second walk of each strip). `a.ws` holds
/// strip_workspace(strip_grid(rows, cols, sm_count), rows, cols, a.pos_row ||
/// a.pos_col) elements of T; `sm_count` is the device's
/// multiprocessor count (it sizes the grid only).
int lse_panel(const LseArgs<float>& a, int sm_count, cudaStream_t stream);
int lse_panel(const LseArgs<double>& a, int sm_count, cudaStream_t stream);

/// The gradient panel (GradArgs) in one read of its logits, written in the
/// output type (in place when `a.out` is `a.logits`, fp32 / fp64 only).
int grad_panel(const GradArgs<float, float>& a, cudaStream_t stream);
int grad_panel(const GradArgs<float, Bf16>& a, cudaStream_t stream);
int grad_panel(const GradArgs<float, Fp16>& a, cudaStream_t stream);
int grad_panel(const GradArgs<double, double>& a, cudaStream_t stream);

/// SigLIP over a panel (SiglipArgs): the rows' loss sums, the gradient panel
/// and its row sums, in one read of its logits. `a.ws` holds
/// strip_workspace(strip_grid(rows, cols, sm_count), rows, 0) elements of T.
int siglip_panel(const SiglipArgs<float, float>& a, int sm_count, cudaStream_t stream);
int siglip_panel(const SiglipArgs<float, Bf16>& a, int sm_count, cudaStream_t stream);
int siglip_panel(const SiglipArgs<float, Fp16>& a, int sm_count, cudaStream_t stream);
int siglip_panel(const SiglipArgs<double, double>& a, int sm_count, cudaStream_t stream);

}  // namespace contrax::detail::panels
