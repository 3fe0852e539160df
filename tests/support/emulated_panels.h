// The engine's CUDA panel kernels (src/engine/kernels/cuda_*_panel.cuh) run on
// the CPU by the SIMT emulator (support/simt.h): their own device code and
// launch sequences, compiled here as C++, behind the same host API as the
// CUDA build's (kernels/cuda_panels_api.h; the stream ignored, CPU pointers
// instead of device ones) and as the engine's table of them
// (engine/panel_kernels.h), so that a test can run a kernel alone or the
// engine's whole CUDA walk on CPU tensors. A fault the emulator finds
// (simt::Fault) propagates out of the call. Test support.
#pragma once

#include "engine/kernels/cuda_panels_api.h"
#include "engine/panel_kernels.h"

namespace contrax::testing {

namespace panels = contrax::detail::panels;

/// The kernels' host API, emulated (`sm_count` sizes the grid, as on a GPU).
int emulated_lse_panel(const panels::LseArgs<float>& a, int sm_count);
int emulated_lse_panel(const panels::LseArgs<double>& a, int sm_count);
int emulated_grad_panel(const panels::GradArgs<float, float>& a);
int emulated_grad_panel(const panels::GradArgs<float, panels::Bf16>& a);
int emulated_grad_panel(const panels::GradArgs<float, panels::Fp16>& a);
int emulated_grad_panel(const panels::GradArgs<double, double>& a);
int emulated_siglip_panel(const panels::SiglipArgs<float, float>& a, int sm_count);
int emulated_siglip_panel(const panels::SiglipArgs<float, panels::Bf16>& a, int sm_count);
int emulated_siglip_panel(const panels::SiglipArgs<float, panels::Fp16>& a, int sm_count);
int emulated_siglip_panel(const panels::SiglipArgs<double, double>& a, int sm_count);

/// Kernel launches the emulator has run in this process (simt::launches,
/// without the emulator's CUDA names in the caller).
int64_t emulated_launches();

/// The same as the engine's table.
const detail::PanelKernels& emulated_panel_kernels();

/// For its scope, the engine runs the CUDA walk on the CPU with the
/// emulated kernels: panels on every device, the CUDA kernels' switch on and
/// CPU float/double tiles sent to the emulated kernels of a device of
/// `sm_count` multiprocessors (the CPU's own fused kernels out of the way, as
/// on a GPU), the panel budget `budget` (0: automatic).
class EmulatedCudaWalk {
 public:
  explicit EmulatedCudaWalk(int sm_count = 4, int64_t budget = 0);
  ~EmulatedCudaWalk();
  EmulatedCudaWalk(const EmulatedCudaWalk&) = delete;
  EmulatedCudaWalk& operator=(const EmulatedCudaWalk&) = delete;

 private:
  bool cuda_was_on_;
};

}  // namespace contrax::testing
