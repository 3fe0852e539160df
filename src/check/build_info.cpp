// What this build of Contrax runs with (see contrax/check/build_info.h).
#include "contrax/check/build_info.h"

#include <torch/version.h>

#include "engine/lse_kernels.h"
#include "util/cuda_side.h"

#ifndef CONTRAX_VERSION
#define CONTRAX_VERSION "unknown"
#endif

namespace contrax {

std::string version() { return CONTRAX_VERSION; }

std::string torch_version() { return TORCH_VERSION; }

std::string cxx_abi() {
#if defined(_GLIBCXX_USE_CXX11_ABI) && _GLIBCXX_USE_CXX11_ABI
  return "cxx11";
#else
  return "pre-cxx11";
#endif
}

std::string fused_kernels_isa() { return detail::fused_kernels_isa(); }

bool built_with_gloo() {
#ifdef USE_C10D_GLOO
  return true;
#else
  return false;
#endif
}

bool built_with_nccl() { return detail::cuda_side_function("nccl_backend") != nullptr; }

int64_t cuda_devices() { return detail::cuda_device_count(); }

std::string cuda_side() { return detail::cuda_side_origin(); }

}  // namespace contrax
