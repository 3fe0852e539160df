// The launcher that the kernels' launch sequences (cuda_*_panel.cuh) take on
// a GPU: `launch(kernel, grid, block, args...)` puts the kernel on a CUDA
// stream and returns the launch's error (0 = success). The sequences are
// written once, over any such launcher, so that the SIMT emulator's
// (tests/support/simt.h) runs the very launches a GPU gets. CUDA only (nvcc).
#pragma once

#include <cuda_runtime.h>

namespace contrax::detail::panels {

struct StreamLaunch {
  cudaStream_t stream;
  template <typename... P, typename... A>
  int operator()(void (*kernel)(P...), dim3 grid, dim3 block, const A&... args) const {
    kernel<<<grid, block, 0, stream>>>(args...);
    return static_cast<int>(cudaGetLastError());
  }
};

}  // namespace contrax::detail::panels
