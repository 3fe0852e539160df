// The device binding's rules (see comm/device_binding.h).
#include "comm/device_binding.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

namespace contrax::detail {

torch::Device bind_device(const DevicePlace& p, const std::string& caller) {
  const auto& d = p.requested;
  if (!d.is_cuda()) return d;
  TORCH_CHECK(p.cuda_devices > 0, caller, ": argument 'device' is ", d.str(),
              ", but this process sees no CUDA device (is CUDA_VISIBLE_DEVICES empty, or is this LibTorch "
              "built without CUDA?)");
  if (d.has_index()) {
    TORCH_CHECK(d.index() < p.cuda_devices, caller, ": argument 'device' is ", d.str(), ", but this process sees ",
                p.cuda_devices, " CUDA device(s), cuda:0 to cuda:", p.cuda_devices - 1);
    return d;
  }
  if (p.world_size == 1 && p.local_rank < 0) return torch::Device(torch::kCUDA, 0);
  TORCH_CHECK(p.local_rank >= 0, caller, ": argument 'device' is 'cuda' without an index for one of ",
              p.world_size, " ranks whose local rank is unknown, so every rank would pick the same GPU; "
              "name each rank's device (cuda:<its local rank>), or use Communicator::from_env(), which binds "
              "cuda:(LOCAL_RANK mod the number of GPUs)");
  TORCH_CHECK(p.backend != "nccl" || p.local_world_size <= p.cuda_devices, caller, ": ", p.local_world_size,
              " ranks share this machine (LOCAL_WORLD_SIZE) but this process sees ", p.cuda_devices,
              " CUDA device(s), and NCCL cannot put two ranks on one GPU; start at most ", p.cuda_devices,
              " processes per machine, or use backend 'gloo'");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(p.local_rank % p.cuda_devices));
}

c10::optional<torch::Device> staging_device(const std::string& backend, const c10::optional<torch::Device>& nccl_stage,
                                            const torch::Device& tensor_device) {
  if (backend == "nccl" && !tensor_device.is_cuda()) return nccl_stage;
  if (backend == "gloo" && tensor_device.is_cuda()) return torch::Device(torch::kCPU);
  return c10::nullopt;
}

std::string pci_bus_id(const torch::Device& device) {
  if (!device.is_cuda() || !device.has_index()) return "";
  // The runtime's C entry point (cudaError_t is an int; 0 is success), found
  // among the loaded libraries as available_device_memory_bytes finds its own.
  using GetPciBusId = int (*)(char*, int, int);
  auto get = reinterpret_cast<GetPciBusId>(::dlsym(RTLD_DEFAULT, "cudaDeviceGetPCIBusId"));
  char id[64] = {0};
  if (get == nullptr || get(id, sizeof(id) - 1, device.index()) != 0) return "";
  return id;
}

std::string gpu_key(const std::string& host, const std::string& bus_id, const torch::Device& device) {
  if (bus_id.empty()) return "";
  return host + " PCI " + bus_id + " (" + device.str() + ")";
}

std::string shared_gpu_error(const std::vector<std::string>& keys) {
  for (size_t r = 0; r < keys.size(); ++r) {
    if (keys[r].empty()) continue;
    std::vector<size_t> same{r};
    for (size_t s = r + 1; s < keys.size(); ++s) {
      if (keys[s] == keys[r]) same.push_back(s);
    }
    if (same.size() < 2) continue;
    std::string ranks;
    for (size_t i = 0; i < same.size(); ++i) {
      ranks += (i == 0 ? "" : i + 1 == same.size() ? " and " : ", ") + std::to_string(same[i]);
    }
    return "ranks " + ranks + (same.size() == 2 ? " are both" : " are all") + " on GPU " + keys[r] +
           ", and NCCL cannot put two ranks on one GPU; give each rank its own GPU (LOCAL_RANK, or device "
           "cuda:<k>), or use backend 'gloo', which can share one";
  }
  return "";
}

void make_current(const torch::Device& device) {
  if (!device.is_cuda()) return;
  c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(device);
}

}  // namespace contrax::detail
