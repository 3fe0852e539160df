// What this build of Contrax runs with, for bug reports and `contrax env`:
// the versions and ABI it was built against, the instruction set the engine's
// fused kernels chose on this CPU, which c10d backends it was built with, and
// where its CUDA side comes from.
#pragma once

#include <cstdint>
#include <string>

namespace contrax {

/// Contrax's version ("0.1.0").
std::string version();

/// The LibTorch version Contrax was compiled against ("2.15.0").
std::string torch_version();

/// The C++ ABI of that build: "cxx11" (_GLIBCXX_USE_CXX11_ABI=1) or "pre-cxx11".
std::string cxx_abi();

/// The instruction set the fused log-sum-exp kernels run with on this CPU:
/// "avx512", "avx2" or "baseline" (CONTRAX_FUSED_KERNELS=0 turns them off).
std::string fused_kernels_isa();

/// Whether the library was built with c10d's Gloo backend.
bool built_with_gloo();

/// Whether the library can make NCCL process groups: a CUDA build of
/// LibTorch with NCCL, and the library's CUDA side (libcontrax_cuda.so: the
/// CUDA panel kernels and NCCL) present. Loads the CUDA side, and with it
/// LibTorch's CUDA libraries, in a process that has not loaded them.
bool built_with_nccl();

/// The CUDA devices this process sees, the CUDA side loaded first (as by
/// built_with_nccl): a program that links only LibTorch's CPU libraries, as
/// the `contrax` tool does, sees none through torch::cuda::device_count()
/// until then.
int64_t cuda_devices();

/// Where the CUDA side comes from: "linked in" (the Python module), the path
/// of libcontrax_cuda.so that was loaded, or why there is none.
std::string cuda_side();

}  // namespace contrax
