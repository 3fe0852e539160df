// What the `contrax` tool was built with and runs on, as `--version`, the
// benchmarks' headers and `contrax env` print it: the BLAS, LibTorch, the
// threads and the cores.
#pragma once

#include <string>

namespace contrax::cli {

/// The BLAS library this process actually mapped (Debian picks it through
/// alternatives; benchmarks print it because it changes GEMM speed ~30x).
std::string blas_library();

/// "contrax 0.1.0, LibTorch 1.13.1, BLAS /usr/lib/..., N threads".
std::string version_string();

}  // namespace contrax::cli
