// The host API of the gradient panel kernel (cuda_panels_api.h):
// cuda_grad_panel.cuh's launch on a CUDA stream, half-precision outputs as
// CUDA's own types. CUDA only (nvcc).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "engine/kernels/cuda_grad_panel.cuh"
#include "engine/kernels/cuda_panels_api.h"
#include "engine/kernels/cuda_stream_launch.cuh"

namespace contrax::detail::panels {

int grad_panel(const GradArgs<float, float>& a, cudaStream_t stream) { return grad_launches(a, StreamLaunch{stream}); }
int grad_panel(const GradArgs<float, Bf16>& a, cudaStream_t stream) {
  return grad_launches(with_output<__nv_bfloat16>(a), StreamLaunch{stream});
}
int grad_panel(const GradArgs<float, Fp16>& a, cudaStream_t stream) {
  return grad_launches(with_output<__half>(a), StreamLaunch{stream});
}
int grad_panel(const GradArgs<double, double>& a, cudaStream_t stream) {
  return grad_launches(a, StreamLaunch{stream});
}

}  // namespace contrax::detail::panels
