// The CUDA panel kernels (src/engine/kernels/cuda_*_panel.cu) run on the CPU:
// the same grid (blocks, threads, strips, splits, tiles, tails), the same
// per-thread code (kernels/panel_grid.h) and the same order of the warp
// butterflies and cross-warp merges, as plain loops over plain memory. The
// tests (tests/panel_emulation_test.cpp) check it against ATen on odd shapes,
// so that an indexing bug of the kernels shows on a machine without a GPU.
// Test support (the engine ships none of it); LibTorch-free.
#pragma once

#include "engine/kernels/panel_grid.h"

namespace contrax::detail::panels {

/// lse_panel (kernels/cuda_panels_api.h) on CPU memory: `a.ws` holds
/// strip_workspace(strip_grid(a.rows, a.cols, sm_count), a.rows, a.cols) elements.
template <typename T>
void emulate_lse_panel(const LseArgs<T>& a, int sm_count);

/// grad_panel on CPU memory (fp32 or fp64 output).
template <typename T, typename Out>
void emulate_grad_panel(const GradArgs<T, Out>& a);

/// siglip_panel on CPU memory: `a.ws` holds
/// strip_workspace(strip_grid(a.rows, a.cols, sm_count), a.rows, 0) elements.
template <typename T, typename Out>
void emulate_siglip_panel(const SiglipArgs<T, Out>& a, int sm_count);

}  // namespace contrax::detail::panels
