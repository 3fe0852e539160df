// The host API of SigLIP's panel kernels (cuda_panels_api.h):
// cuda_siglip_panel.cuh's launches on a CUDA stream, half-precision gradients
// as CUDA's own types. CUDA only (nvcc).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "engine/kernels/cuda_panels_api.h"
#include "engine/kernels/cuda_siglip_panel.cuh"
#include "engine/kernels/cuda_stream_launch.cuh"

namespace contrax::detail::panels {

int siglip_panel(const SiglipArgs<float, float>& a, int sm_count, cudaStream_t stream) {
  return siglip_launches(a, sm_count, StreamLaunch{stream});
}
int siglip_panel(const SiglipArgs<float, Bf16>& a, int sm_count, cudaStream_t stream) {
  return siglip_launches(with_output<__nv_bfloat16>(a), sm_count, StreamLaunch{stream});
}
int siglip_panel(const SiglipArgs<float, Fp16>& a, int sm_count, cudaStream_t stream) {
  return siglip_launches(with_output<__half>(a), sm_count, StreamLaunch{stream});
}
int siglip_panel(const SiglipArgs<double, double>& a, int sm_count, cudaStream_t stream) {
  return siglip_launches(a, sm_count, StreamLaunch{stream});
}

}  // namespace contrax::detail::panels
