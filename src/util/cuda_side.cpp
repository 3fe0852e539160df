// The CUDA side, linked in or loaded (see util/cuda_side.h).
#include "util/cuda_side.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <dlfcn.h>
#include <torch/cuda.h>

#include <cstring>

#include "util/cuda_side_built.h"  // generated: CONTRAX_CUDA_SIDE_BUILT

// Defined where the side's objects are linked in (the Python module, the test
// programs); a weak reference is null where they are not (the tool).
extern "C" const contrax::detail::CudaSideEntry* contrax_cuda_side_entries() __attribute__((weak));

namespace contrax::detail {

namespace {

struct Side {
  const CudaSideEntry* entries = nullptr;
  std::string origin;
};

// libcontrax_cuda.so is found through the caller's run-time search path (the
// tool's: $ORIGIN in the build tree, $ORIGIN/../lib installed) and loaded
// with its CUDA libraries into the global scope, as if it had been linked:
// util/memory.cpp and comm/device_binding.cpp find the CUDA runtime's entry
// points there.
Side load() {
  Side s;
  if (&contrax_cuda_side_entries != nullptr) {
    s.entries = contrax_cuda_side_entries();
    s.origin = "linked in";
    return s;
  }
  if (!CONTRAX_CUDA_SIDE_BUILT) {
    s.origin = "none (this LibTorch is a CPU-only build)";
    return s;
  }
  void* lib = ::dlopen("libcontrax_cuda.so", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    const char* why = ::dlerror();
    s.origin = std::string("not loaded: ") + (why != nullptr ? why : "libcontrax_cuda.so: dlopen failed");
    return s;
  }
  using Entries = const CudaSideEntry* (*)();
  auto entries = reinterpret_cast<Entries>(::dlsym(lib, "contrax_cuda_side_entries"));
  if (entries == nullptr) {
    s.origin = "not loaded: libcontrax_cuda.so has no table contrax_cuda_side_entries";
    return s;
  }
  s.entries = entries();
  Dl_info info{};
  const bool named = ::dladdr(reinterpret_cast<void*>(entries), &info) != 0 && info.dli_fname != nullptr;
  s.origin = named ? info.dli_fname : "libcontrax_cuda.so";
  // ATen creates its CUDA hooks once, at the first question about CUDA:
  // asked before LibTorch's CUDA libraries were loaded, they stay the
  // CPU-only ones for the whole process, and no CUDA device is seen.
  if (!at::detail::getCUDAHooks().hasCUDART()) {
    s.origin += " (loaded after ATen had read its CUDA hooks: CUDA stays unavailable in this process)";
    TORCH_WARN("contrax: the CUDA side ", s.origin, "; load it before any use of CUDA (contrax::cuda_devices())");
  }
  return s;
}

const Side& side() {
  static const Side s = load();
  return s;
}

}  // namespace

void* cuda_side_function(const char* name) {
  for (const CudaSideEntry* e = side().entries; e != nullptr && e->name != nullptr; ++e) {
    if (std::strcmp(name, e->name) == 0) return e->function;
  }
  return nullptr;
}

std::string cuda_side_origin() { return side().origin; }

int64_t cuda_device_count() {
  side();  // LibTorch's CUDA libraries come with it and register CUDA with ATen
  return torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
}

}  // namespace contrax::detail
