// The CUDA side's table (util/cuda_side.h): compiled only into the side
// (libcontrax_cuda.so, and the objects the Python module and the test
// programs link in), with LibTorch's CUDA build and its definitions
// (USE_C10D_NCCL where it has NCCL).
#include "comm/nccl_backend.h"
#include "engine/cuda_kernels_built.h"  // generated: CONTRAX_CUDA_KERNELS_BUILT
#include "engine/panel_kernels.h"
#include "util/cuda_side.h"

extern "C" __attribute__((visibility("default"))) const contrax::detail::CudaSideEntry* contrax_cuda_side_entries() {
  using contrax::detail::CudaSideEntry;
  static const CudaSideEntry entries[] = {
#if CONTRAX_CUDA_KERNELS_BUILT
    {"panel_device", reinterpret_cast<void*>(&contrax::detail::cuda_panel_device)},
#endif
#ifdef USE_C10D_NCCL
    {"nccl_backend", reinterpret_cast<void*>(&contrax::detail::nccl_backend)},
#endif
    {nullptr, nullptr}
  };
  return entries;
}
