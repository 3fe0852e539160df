// `contrax env`: what a bug report needs, as text or JSON (as PyTorch's
// `python -m torch.utils.collect_env` does for PyTorch): Contrax's and
// LibTorch's versions and build ABI, the CPU BLAS, the CPU model and the
// instruction set the fused kernels chose, CUDA devices, the c10d backends,
// the interface Gloo would bind to, and the launcher variables that are set.
//
//   contrax env
//   contrax env --json
#include <ATen/Context.h>
#include <unistd.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <fstream>
#include <iostream>
#include <thread>

#include "cli/build_info.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "contrax/check/build_info.h"
#include "contrax/comm/communicator.h"
#include "cli/json_util.h"

namespace {

namespace cli = contrax::cli;

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown";
}

// The environment variables of launchers and collectives that change how a
// run starts or communicates: torchrun's, SLURM's, Gloo's and NCCL's,
// CUDA's device list, the thread counts and Contrax's own switches.
bool reported_variable(const std::string& name) {
  static const char* exact[] = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                                "MKL_NUM_THREADS"};
  for (const char* e : exact) {
    if (name == e) return true;
  }
  for (const char* prefix : {"TORCHELASTIC_", "SLURM_", "GLOO_", "NCCL_", "CONTRAX_", "TORCH_DISTRIBUTED_"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

cli::Json collect() {
  // First: the CUDA side loads LibTorch's CUDA libraries, which must come
  // before anything asks ATen for its CUDA hooks (blas_library's
  // at::show_config does; src/util/cuda_side.h).
  const auto devices = contrax::cuda_devices();
  cli::Json j;
  j["contrax"] = contrax::version();
  j["libtorch"] = contrax::torch_version();
  j["cxx_abi"] = contrax::cxx_abi();
  j["blas"] = cli::blas_library();
  j["cpu"] = cpu_model();
  j["cores"] = std::thread::hardware_concurrency();
  j["intra_op_threads"] = at::get_num_threads();
  j["fused_kernels_isa"] = contrax::fused_kernels_isa();
  const bool cuda_built = at::detail::getCUDAHooks().hasCUDART() || at::globalContext().hasCUDA();
  j["cuda_build"] = cuda_built;
  j["cuda_runtime"] = cuda_built ? at::detail::getCUDAHooks().versionCUDART() : 0;
  j["cuda_devices"] = devices;
  j["gloo"] = contrax::built_with_gloo();
  j["nccl"] = contrax::built_with_nccl();
  j["cuda_side"] = contrax::cuda_side();
  const char* master = std::getenv("MASTER_ADDR");
  j["gloo_interface"] = contrax::gloo_binding(master != nullptr && *master != '\0' ? master : "127.0.0.1");
  cli::Json vars = cli::Json::object();
  for (char** e = ::environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos && reported_variable(kv.substr(0, eq))) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  j["launcher_variables"] = vars;
  return j;
}

int run_env(const std::vector<std::string>& args) {
  CLI::App app{"what a bug report needs: versions, build, CPU, GPUs, backends, network, launcher variables",
               "env"};
  cli::setup_app(app);
  bool json = false;
  app.add_flag("--json", json, "one JSON object instead of text");
  if (int st = cli::parse(app, args); st >= 0) return st;
  const auto j = collect();
  if (json) {
    std::cout << j.dump() << "\n";
    return 0;
  }
  auto yes = [](bool b) { return b ? "yes" : "no"; };
  std::cout << "Contrax            " << j["contrax"].get<std::string>() << "\n"
            << "LibTorch           " << j["libtorch"].get<std::string>() << " (C++ ABI "
            << j["cxx_abi"].get<std::string>() << ")\n"
            << "BLAS               " << j["blas"].get<std::string>() << "\n"
            << "CPU                " << j["cpu"].get<std::string>() << ", " << j["cores"].get<unsigned>()
            << " cores, " << j["intra_op_threads"].get<int>() << " intra-op threads\n"
            << "fused kernels      " << j["fused_kernels_isa"].get<std::string>() << "\n"
            << "CUDA               "
            << (j["cuda_build"].get<bool>()
                    ? "built with runtime " + std::to_string(j["cuda_runtime"].get<long>() / 1000) + "." +
                          std::to_string(j["cuda_runtime"].get<long>() % 1000 / 10) + ", " +
                          std::to_string(j["cuda_devices"].get<int64_t>()) + " device(s) visible"
                    : std::string("not built in"))
            << "\n"
            << "CUDA side          " << j["cuda_side"].get<std::string>() << "\n"
            << "c10d backends      gloo " << yes(j["gloo"].get<bool>()) << ", nccl " << yes(j["nccl"].get<bool>())
            << "\n"
            << "Gloo binds to      " << j["gloo_interface"].get<std::string>() << "\n"
            << "launcher variables";
  if (j["launcher_variables"].empty()) std::cout << " none set";
  std::cout << "\n";
  for (const auto& [k, v] : j["launcher_variables"].items()) std::cout << "  " << k << "=" << v.get<std::string>() << "\n";
  std::cout << std::flush;
  return 0;
}

contrax::cli::Command env_cmd("env",
                              "what a bug report needs: versions, build, CPU, GPUs, backends, network, launcher "
                              "variables (--json)",
                              run_env);

}  // namespace
