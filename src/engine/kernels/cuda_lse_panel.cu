// The host API of the log-sum-exp panel kernels (cuda_panels_api.h):
// cuda_lse_panel.cuh's launches on a CUDA stream. CUDA only (nvcc).
#include "engine/kernels/cuda_lse_panel.cuh"
#include "engine/kernels/cuda_panels_api.h"
#include "engine/kernels/cuda_stream_launch.cuh"

namespace contrax::detail::panels {

int lse_panel(const LseArgs<float>& a, int sm_count, cudaStream_t stream) {
  return lse_launches(a, sm_count, StreamLaunch{stream});
}
int lse_panel(const LseArgs<double>& a, int sm_count, cudaStream_t stream) {
  return lse_launches(a, sm_count, StreamLaunch{stream});
}

}  // namespace contrax::detail::panels
