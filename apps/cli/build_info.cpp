// What the `contrax` tool was built with and runs on (build_info.h).
#include "cli/build_info.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/version.h>

#include <fstream>
#include <sstream>
#include <thread>

namespace contrax::cli {

std::string blas_library() {
  // The CPU BLAS LibTorch was built with (its build settings' BLAS_INFO:
  // "mkl", linked into libtorch_cpu in PyPI's wheels; "open" or "flexi" in
  // Debian's) and, where it is a shared library, the one loaded. CUDA's
  // cuBLAS is not the CPU BLAS.
  const std::string config = at::show_config(), key = "BLAS_INFO=";
  std::string kind = "unknown";
  if (auto p = config.find(key); p != std::string::npos) {
    p += key.size();
    kind = config.substr(p, config.find_first_of(", \n", p) - p);
  }
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    auto pos = line.find('/');
    if (pos == std::string::npos) continue;
    std::string path = line.substr(pos);
    const auto name = path.substr(path.rfind('/') + 1);
    if ((name.find("blas") != std::string::npos || name.find("mkl") != std::string::npos) &&
        name.find("cublas") == std::string::npos) {
      return kind + " (" + path + ")";
    }
  }
  return kind == "mkl" ? "mkl (linked into LibTorch)" : kind;
}

std::string version_string() {
  std::ostringstream o;
  o << "contrax " << CONTRAX_VERSION << ", LibTorch " << TORCH_VERSION << ", BLAS " << blas_library() << ", "
    << at::get_num_threads() << " intra-op thread" << (at::get_num_threads() == 1 ? "" : "s") << " by default, "
    << std::thread::hardware_concurrency() << " cores";
  return o.str();
}

}  // namespace contrax::cli
