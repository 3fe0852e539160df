// The CUDA side of Contrax: the engine's CUDA panel kernels and the NCCL
// process group, the only code that needs LibTorch's CUDA libraries
// (libtorch_cuda and the CUDA stack under it, some 2 GB whose loading took
// half of each start of the tool: 0.34 of 0.67 s on 2026-11-30). It is a
// shared library of its own, libcontrax_cuda.so, that the tool loads only when
// a CUDA device or NCCL is asked for; the Python module and the test programs
// link it in (the Python process has loaded LibTorch's CUDA libraries with
// torch anyway). Loading it loads those libraries, which register CUDA with
// ATen: before that, torch::cuda::is_available() is false in the tool.
//
// The side is a table of named entries (CudaSideEntry) that the layers look
// up by name, each casting the entry to the function type its header gives
// (engine/panel_kernels.h, comm/nccl_backend.h): util, the lowest layer, knows
// no engine or communicator type.
#pragma once

#include <cstdint>
#include <string>

namespace contrax::detail {

/// One function of the CUDA side: its name and address.
struct CudaSideEntry {
  const char* name;
  void* function;
};

/// The CUDA side's function `name`, or nullptr when the side is absent (a
/// CPU-only LibTorch, libcontrax_cuda.so not found: cuda_side_origin() says
/// which) or has no such entry (the panel kernels where nvcc was missing,
/// NCCL where LibTorch lacks it). Loads the side on first use, once per
/// process, thread-safe.
void* cuda_side_function(const char* name);

/// Where the CUDA side came from ("linked in", or the path of the library
/// loaded) or why there is none; loads it as cuda_side_function does.
std::string cuda_side_origin();

/// torch::cuda::device_count() once the CUDA side is loaded; 0 without it.
int64_t cuda_device_count();

}  // namespace contrax::detail

/// The CUDA side's table, ended by an entry whose name is null
/// (engine/cuda_side_entries.cpp).
extern "C" const contrax::detail::CudaSideEntry* contrax_cuda_side_entries();
