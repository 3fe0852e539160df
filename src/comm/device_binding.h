// Which CUDA device a rank works on: the device binding behind
// Communicator::create and Communicator::from_env, apart from any GPU so that
// its rules can be tested on a machine without one. Internal to src/comm/,
// not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace contrax::detail {

/// What the binding looks at: the device the user asked for, where the rank
/// sits, and what this process can see.
struct DevicePlace {
  torch::Device requested = torch::kCPU;  ///< CommunicatorOptions::device: the CPU, `cuda` or `cuda:k`
  int64_t world_size = 1;
  /// This rank's index on its machine (LOCAL_RANK), or -1 when nothing says
  /// (a communicator built from explicit options).
  int64_t local_rank = -1;
  int64_t local_world_size = -1;  ///< how many ranks share this machine (LOCAL_WORLD_SIZE), or -1 when unknown
  int64_t cuda_devices = 0;       ///< the CUDA devices this process sees (after CUDA_VISIBLE_DEVICES)
  std::string backend;            ///< the backend the communicator will use ("nccl", "gloo", ...)
};

/// The device a rank works on, or an error naming the argument or variable
/// and what was expected:
///  * the CPU, and anything not CUDA, as asked;
///  * `cuda:k` as asked, when this process sees more than k CUDA devices;
///  * `cuda` without an index: `cuda:(LOCAL_RANK mod #devices)` where the
///    local rank is known, `cuda:0` for a world of one; refused for one of
///    several ranks whose local rank is unknown (every rank would pick the
///    same GPU), and under NCCL when more ranks share the machine than it
///    has GPUs (NCCL refuses two ranks on one GPU).
torch::Device bind_device(const DevicePlace& place, const std::string& caller);

/// Where a collective's tensor on `tensor_device` travels, when not as it is:
///  * NCCL moves CUDA tensors only: a CPU tensor goes through `nccl_stage`,
///    the rank's bound GPU;
///  * Gloo is given host memory: a CUDA tensor goes through a CPU copy. Gloo's
///    own CUDA collectives stage too, but not every one of them (its
///    reduce-scatter emulation's all-to-all hung with two ranks on one GPU),
///    and its point-to-point takes none; one rule for every collective keeps
///    a CUDA run over Gloo exactly the CPU run that the tests check.
/// nullopt: the tensor travels where it is.
c10::optional<torch::Device> staging_device(const std::string& backend, const c10::optional<torch::Device>& nccl_stage,
                                            const torch::Device& tensor_device);

/// The PCI bus id of CUDA device `device` ("0000:3b:00.0"), from the CUDA
/// runtime already loaded (LibTorch's CUDA build brings it), or "" where
/// there is none or it cannot say.
std::string pci_bus_id(const torch::Device& device);

/// What names one physical GPU across the ranks of a job: its host and PCI
/// bus id (not its index, which CUDA_VISIBLE_DEVICES or a cgroup of one
/// device per task makes 0 on every rank), shown with the rank's device; ""
/// where the bus id is unknown.
std::string gpu_key(const std::string& host, const std::string& bus_id, const torch::Device& device);

/// The refusal when two ranks hold the same non-empty `gpu_key` (NCCL cannot
/// put two ranks on one GPU, and would fail only at the first collective):
/// names the GPU and the ranks, or is empty when every known key is distinct.
/// `keys[r]` is rank r's key.
std::string shared_gpu_error(const std::vector<std::string>& keys);

/// Makes `device` the current CUDA device of this thread (a no-op for other
/// devices), so that what c10d and CUDA put on "the current device" lands on
/// the rank's own GPU.
void make_current(const torch::Device& device);

}  // namespace contrax::detail
