// What this build of Contrax runs with, for bug reports and `contrax env`:
// the versions and ABI it was built against, the instruction set the engine's
// fused kernels chose on this CPU, and which c10d backends it was built with.
#pragma once

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

/// Whether the library was built with c10d's Gloo / NCCL backends.
bool built_with_gloo();
bool built_with_nccl();

}  // namespace contrax
