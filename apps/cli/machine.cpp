// What this machine lets a subcommand's flags ask for (machine.h).
#include "cli/machine.h"

#include <ATen/Context.h>

#include <algorithm>
#include <thread>

#include "contrax/check/build_info.h"
#include "contrax/launch/launcher.h"

namespace contrax::cli {

std::string cuda_unavailable_reason() {
  if (contrax::cuda_devices() > 0) return "";  // loads the CUDA side (util/cuda_side.h)
  if (!at::Context::hasCUDART()) return "this LibTorch was built without CUDA (a CPU-only build)";
  return "no CUDA device is visible (torch::cuda::is_available() is false: no GPU, no driver, or "
         "CUDA_VISIBLE_DEVICES hides them)";
}

void check_cuda_device(const std::string& device, int64_t nproc, const std::string& one_gpu_per_rank,
                       const std::string& hint) {
  if (device == "cuda") {
    const std::string why = cuda_unavailable_reason();
    usage_check(why.empty(), "flag '--device' is 'cuda', but ", why, "; use --device cpu");
  }
  if (!one_gpu_per_rank.empty() && !in_launched_worker()) {
    // NCCL refuses two ranks on one GPU; say so before any process starts.
    const auto gpus = contrax::cuda_devices();
    usage_check(nproc <= gpus, one_gpu_per_rank, ", which needs one GPU per rank, but --nproc is ", nproc,
                " and this machine has ", gpus, " GPU", gpus == 1 ? "" : "s", hint);
  }
}

int64_t max_procs() { return kMaxProcsPerCore * std::max<int64_t>(1, std::thread::hardware_concurrency()); }

CLI::Option* add_force(CLI::App& app, bool& force) {
  return app.add_flag("--force", force, "allow --nproc above " + std::to_string(max_procs()) + " (" +
                                            std::to_string(kMaxProcsPerCore) + " per core)");
}

void check_procs(const std::string& flag, int64_t n, bool force) {
  usage_check(force || n <= max_procs(), "flag '", flag, "' must be <= ", max_procs(), " (", kMaxProcsPerCore,
              " per core; --force allows more), but got ", n);
}

int64_t max_threads() { return kMaxThreadsPerCore * std::max<int64_t>(1, std::thread::hardware_concurrency()); }

}  // namespace contrax::cli
