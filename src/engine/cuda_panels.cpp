// The CUDA build's panel kernels as the engine's table (engine/panel_kernels.h):
// the kernels' host API, PyTorch's current stream of the tensor's device and
// its multiprocessor count (ATen caches the properties: no device call per
// launch). Compiled only where CMake builds the kernels (CONTRAX_CUDA_KERNELS).
#include <ATen/cuda/CUDAContext.h>

#include "engine/kernels/cuda_panels_api.h"
#include "engine/panel_kernels.h"

namespace contrax::detail {

namespace {

const char* cuda_error_words(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

const PanelKernels kCudaKernels{&panels::lse_panel,    &panels::lse_panel,    &panels::grad_panel,
                                &panels::grad_panel,   &panels::grad_panel,   &panels::grad_panel,
                                &panels::siglip_panel, &panels::siglip_panel, &panels::siglip_panel,
                                &panels::siglip_panel, &cuda_error_words};

}  // namespace

PanelDevice cuda_panel_device(const c10::Device& device) {
  const c10::DeviceIndex index = device.has_index() ? device.index() : at::cuda::current_device();
  return PanelDevice{&kCudaKernels, at::cuda::getDeviceProperties(index)->multiProcessorCount,
                     at::cuda::getCurrentCUDAStream(index).stream()};
}

}  // namespace contrax::detail
