// The engine's panel kernels (src/engine/kernels/cuda_*_panel.cuh) on
// tensors: pointers, strides and the workspace for the kernels' host API
// (kernels/cuda_panels_api.h), on the device a tensor lives on. That API is
// reached through a table (PanelKernels): the CUDA build's kernels on CUDA
// tensors (engine/cuda_panels.cpp), or, while a test installs it, the same
// kernels run on the CPU by the SIMT emulator (tests/support/emulated_panels.h),
// on CPU tensors. So the code between the engine and the kernels is the same
// on a GPU and in the CPU tests. Internal (src/engine/), not installed.
#pragma once

#include <torch/torch.h>

#include <optional>

#include "engine/kernels/cuda_panels_api.h"

namespace contrax::detail {

/// The kernels' host API as a table (one entry per overload of
/// kernels/cuda_panels_api.h), and the words for an error it returns.
struct PanelKernels {
  int (*lse_f)(const panels::LseArgs<float>&, int, cudaStream_t);
  int (*lse_d)(const panels::LseArgs<double>&, int, cudaStream_t);
  int (*grad_f)(const panels::GradArgs<float, float>&, cudaStream_t);
  int (*grad_bf16)(const panels::GradArgs<float, panels::Bf16>&, cudaStream_t);
  int (*grad_fp16)(const panels::GradArgs<float, panels::Fp16>&, cudaStream_t);
  int (*grad_d)(const panels::GradArgs<double, double>&, cudaStream_t);
  int (*siglip_f)(const panels::SiglipArgs<float, float>&, int, cudaStream_t);
  int (*siglip_bf16)(const panels::SiglipArgs<float, panels::Bf16>&, int, cudaStream_t);
  int (*siglip_fp16)(const panels::SiglipArgs<float, panels::Fp16>&, int, cudaStream_t);
  int (*siglip_d)(const panels::SiglipArgs<double, double>&, int, cudaStream_t);
  const char* (*error_string)(int);
};

/// Where a call's kernels run: their table, the device's multiprocessors
/// (they size the grids only) and the stream.
struct PanelDevice {
  const PanelKernels* kernels = nullptr;
  int sm_count = 1;
  cudaStream_t stream = nullptr;
};

/// The panel kernels of tensors like `options`: the CUDA build's for a CUDA
/// device (where built, from the CUDA side), the emulated ones for the CPU while installed;
/// nothing otherwise. No switch is consulted here (engine/lse_kernels.h's
/// cuda_fused_kernels_enabled decides whether they are used).
std::optional<PanelDevice> panel_device(const torch::TensorOptions& options);

/// Makes CPU tensors run `kernels` (null: none, the default) on a device of
/// `sm_count` multiprocessors: what the tests install to run the engine's
/// CUDA walk on the CPU with the kernels under the SIMT emulator.
void set_emulated_panel_kernels(const PanelKernels* kernels, int sm_count);
bool emulated_panel_kernels_installed();

/// The CUDA build's kernels on `device` (engine/cuda_panels.cpp; only in
/// builds with CONTRAX_CUDA_KERNELS, and in the CUDA side, util/cuda_side.h:
/// panel_device finds it there as the entry "panel_device").
PanelDevice cuda_panel_device(const c10::Device& device);
using CudaPanelDeviceFn = PanelDevice (*)(const c10::Device&);

/// Multi-positive labels' running sums (panels::Masks::multi, engine/block.h),
/// added into by the log-sum-exp kernels: each row's sum_j P_ij x_ij (`row`)
/// and n_i = sum_j P_ij (`row_n`) ([R] each), and, where defined, each
/// column's sum_i P_ij x_ij and sum_i P_ij over the tile's rows (`col`,
/// `col_n`, [C]). Contiguous, the tile's dtype and device.
struct PositiveSums {
  torch::Tensor row, row_n, col, col_n;
};

/// Multi-positive labels' targets in the gradient: 1/n_i of each row
/// (`inv_n_row`, [R]) and, with the column term, 1/m_j of each column
/// (`inv_n_col`, [C]).
struct PositiveCounts {
  torch::Tensor inv_n_row, inv_n_col;
};

/// Row log-sum-exps of the float/double tile `t` ([R, C], unit column
/// stride) when `rows` (else undefined), and, when `col_m` is defined, its
/// columns merged into the running pairs (col_m, col_s) ([C] each,
/// contiguous, t's dtype; log-sum-exp = col_m + log(col_s)). One kernel pass
/// over the tile and one small finishing kernel.
/// `masks` (or null): entries masked and positives designated by index
/// (kernels/panel_grid.h), its label pointers on t's device. `row_out`
/// ([R], contiguous, t's dtype, or undefined): where the rows are written
/// (and returned) instead of a new tensor. `sums` (with multi-positive
/// `masks` only, or null): the positive sums added into, in the same pass.
torch::Tensor panel_tile_lse(const PanelDevice& dev, const torch::Tensor& t /* [R, C] */, bool rows,
                             const torch::Tensor& col_m /* [C] or undefined */, const torch::Tensor& col_s,
                             const panels::Masks* masks = nullptr, const torch::Tensor& row_out = {},
                             const PositiveSums* sums = nullptr);

/// softmax_grad_ (engine/lse_kernels.h) on a float/double tile:
/// G_ij = c [w_row_i exp(t_ij - lse_row_i) [+ w_col_j exp(t_ij - lse_col_j)]],
/// masked (-inf) entries 0, c the 0-dim `factor` (undefined: 1), written into
/// `out` ([R, C], unit column stride; t's dtype, or bf16 / fp16 for fp32 `t`)
/// or, undefined, into `t` itself. The vectors contiguous, t's dtype and
/// device. With `masks`, its masked entries give 0 and its designated
/// positives lose c (w_row_i [+ w_col_j]) (the -Y terms); with multi-positive
/// `masks`, each P_ij loses c (w_row_i / n_i [+ w_col_j / m_j]) (`counts`).
void panel_softmax_grad_(const PanelDevice& dev, torch::Tensor& t /* [R, C] */, const torch::Tensor& lse_row,
                         const torch::Tensor& w_row, const torch::Tensor& lse_col, const torch::Tensor& w_col,
                         const panels::Masks* masks = nullptr, const torch::Tensor& factor = {},
                         const torch::Tensor& out = {}, const PositiveCounts& counts = {});

/// SigLIP's sums over a float/double tile of raw logits `t` (x = s a_i.b_j,
/// [R, C], unit column stride) with the 0-dim `bias` (t's dtype, or
/// undefined) added: returns each row's sum_j softplus(-z (x + bias)) ([R])
/// and, with `grad` defined ([R, C], unit column stride; t's dtype, or bf16 /
/// fp16 for fp32 `t`), writes d loss_i / d x_ij = -z sigmoid(-z (x + bias))
/// there and returns its row sums as `.second` (else undefined). z = +1 on
/// the entries with row0 + r == col0 + c when `own`, -1 elsewhere.
std::pair<torch::Tensor, torch::Tensor> panel_siglip(const PanelDevice& dev, const torch::Tensor& t /* [R, C] */,
                                                     const torch::Tensor& bias, int64_t row0, int64_t col0, bool own,
                                                     const torch::Tensor& grad /* [R, C] or undefined */);

}  // namespace contrax::detail
