// Which CUDA device a rank works on (src/comm/device_binding.h), without a
// GPU: every rule of the binding at made-up device counts, local ranks and
// backends, each refusal's message, LOCAL_WORLD_SIZE read from the
// environment, and what a communicator reports as its device on this machine.
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm/device_binding.h"
#include "comm/environment.h"
#include "contrax/comm/communicator.h"
#include "support/errors.h"

using contrax::detail::bind_device;
using contrax::detail::DevicePlace;

namespace {

DevicePlace place(torch::Device requested, int64_t world, int64_t local_rank, int64_t local_world, int64_t gpus,
                  const std::string& backend = "nccl") {
  DevicePlace p;
  p.requested = requested;
  p.world_size = world;
  p.local_rank = local_rank;
  p.local_world_size = local_world;
  p.cuda_devices = gpus;
  p.backend = backend;
  return p;
}

const torch::Device kCuda(torch::kCUDA);
torch::Device cuda(int k) { return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(k)); }

}  // namespace

TEST(DeviceBinding, TheCpuAndNamedGpusAreKept) {
  EXPECT_EQ(bind_device(place(torch::kCPU, 4, 3, 4, 0), "f()"), torch::Device(torch::kCPU));
  EXPECT_EQ(bind_device(place(torch::kCPU, 4, -1, -1, 8), "f()"), torch::Device(torch::kCPU));
  EXPECT_EQ(bind_device(place(cuda(2), 4, 0, 4, 4), "f()"), cuda(2));
  EXPECT_EQ(bind_device(place(cuda(0), 2, -1, -1, 1, "gloo"), "f()"), cuda(0));
}

TEST(DeviceBinding, AnUnindexedGpuIsTheLocalRankModuloTheGpus) {
  for (int64_t lr = 0; lr < 8; ++lr) {
    EXPECT_EQ(bind_device(place(kCuda, 16, lr, 8, 8), "f()"), cuda(static_cast<int>(lr))) << lr;
    // Gloo lets ranks share a GPU: 8 ranks on 3 GPUs go round-robin.
    EXPECT_EQ(bind_device(place(kCuda, 16, lr, 8, 3, "gloo"), "f()"), cuda(static_cast<int>(lr % 3))) << lr;
  }
  // LOCAL_WORLD_SIZE unset: no over-subscription check, still round-robin.
  EXPECT_EQ(bind_device(place(kCuda, 4, 5, -1, 2), "f()"), cuda(1));
  // A world of one whose local rank nobody gave: the first GPU.
  EXPECT_EQ(bind_device(place(kCuda, 1, -1, -1, 4), "f()"), cuda(0));
}

TEST(DeviceBinding, EveryRefusalSaysWhyAndWhatToDo) {
  CONTRAX_EXPECT_ERROR(bind_device(place(kCuda, 2, 0, 2, 0), "Communicator::from_env()"),
                       "Communicator::from_env(): argument 'device' is cuda, but this process sees no CUDA device "
                       "(is CUDA_VISIBLE_DEVICES empty, or is this LibTorch built without CUDA?)");
  CONTRAX_EXPECT_ERROR(bind_device(place(cuda(4), 8, 0, 8, 4), "Communicator::create()"),
                       "Communicator::create(): argument 'device' is cuda:4, but this process sees 4 CUDA "
                       "device(s), cuda:0 to cuda:3");
  CONTRAX_EXPECT_ERROR(bind_device(place(kCuda, 2, -1, -1, 2), "Communicator::create()"),
                       "Communicator::create(): argument 'device' is 'cuda' without an index for one of 2 ranks "
                       "whose local rank is unknown, so every rank would pick the same GPU; name each rank's device "
                       "(cuda:<its local rank>), or use Communicator::from_env(), which binds cuda:(LOCAL_RANK mod "
                       "the number of GPUs)");
  CONTRAX_EXPECT_ERROR(bind_device(place(kCuda, 8, 1, 4, 2), "Communicator::from_env()"),
                       "Communicator::from_env(): 4 ranks share this machine (LOCAL_WORLD_SIZE) but this process "
                       "sees 2 CUDA device(s), and NCCL cannot put two ranks on one GPU; start at most 2 processes "
                       "per machine, or use backend 'gloo'");
}

TEST(DeviceBinding, CollectivesTravelOnTheBackendsOwnMemory) {
  using contrax::detail::staging_device;
  const c10::optional<torch::Device> gpu1 = cuda(1);
  // NCCL: CPU tensors through the rank's GPU, CUDA tensors as they are.
  EXPECT_EQ(staging_device("nccl", gpu1, torch::kCPU), gpu1);
  EXPECT_EQ(staging_device("nccl", gpu1, cuda(1)), c10::nullopt);
  // Gloo: CUDA tensors through host memory (two ranks on one GPU hung in
  // Gloo's own CUDA all-to-all), CPU tensors as they are.
  EXPECT_EQ(staging_device("gloo", c10::nullopt, cuda(0)), torch::Device(torch::kCPU));
  EXPECT_EQ(staging_device("gloo", c10::nullopt, torch::kCPU), c10::nullopt);
  // MPI (and a world of one, "none") as they are.
  EXPECT_EQ(staging_device("mpi", c10::nullopt, torch::kCPU), c10::nullopt);
  EXPECT_EQ(staging_device("none", c10::nullopt, cuda(0)), c10::nullopt);
}

TEST(DeviceBinding, TwoRanksOnOneGpuAreNamedForNccl) {
  using contrax::detail::gpu_key;
  using contrax::detail::shared_gpu_error;
  // A GPU is its host and PCI bus id: with one device per task (a cgroup, or
  // CUDA_VISIBLE_DEVICES) every rank's index is 0, yet the GPUs differ.
  const auto a0 = gpu_key("node-a", "0000:3b:00.0", cuda(0)), a1 = gpu_key("node-a", "0000:5e:00.0", cuda(0));
  const auto b0 = gpu_key("node-b", "0000:3b:00.0", cuda(0));
  EXPECT_EQ(a0, "node-a PCI 0000:3b:00.0 (cuda:0)");
  EXPECT_EQ(shared_gpu_error({a0, a1, b0}), "");  // one GPU each, on two machines
  EXPECT_EQ(shared_gpu_error({a0}), "");
  // An unknown bus id is no key, and matches nothing.
  EXPECT_EQ(gpu_key("node-a", "", cuda(0)), "");
  EXPECT_EQ(shared_gpu_error({"", "", a0}), "");
  EXPECT_EQ(shared_gpu_error({a0, a1, b0, a1}),
            "ranks 1 and 3 are both on GPU node-a PCI 0000:5e:00.0 (cuda:0), and NCCL cannot put two ranks on one "
            "GPU; give each rank its own GPU (LOCAL_RANK, or device cuda:<k>), or use backend 'gloo', which can "
            "share one");
  EXPECT_NE(shared_gpu_error({a0, a0, a0}).find("ranks 0, 1 and 2 are all on GPU node-a PCI 0000:3b:00.0"),
            std::string::npos);
  // No GPU here: no bus id to read.
  if (!torch::cuda::is_available()) EXPECT_EQ(contrax::detail::pci_bus_id(cuda(0)), "");
  EXPECT_EQ(contrax::detail::pci_bus_id(torch::kCPU), "");
}

TEST(DeviceBinding, LocalWorldSizeComesFromTheEnvironment) {
  ::unsetenv("WORLD_SIZE");
  ::setenv("LOCAL_WORLD_SIZE", "3", 1);
  EXPECT_EQ(contrax::detail::job_environment(contrax::CommunicatorOptions()).local_world_size, 3);
  ::setenv("LOCAL_WORLD_SIZE", "three", 1);
  CONTRAX_EXPECT_ERROR(contrax::detail::job_environment(contrax::CommunicatorOptions()),
                       "Communicator::from_env(): environment variable 'LOCAL_WORLD_SIZE' must be a positive "
                       "integer, but got 'three'");
  ::unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_EQ(contrax::detail::job_environment(contrax::CommunicatorOptions()).local_world_size, -1);
}

TEST(DeviceBinding, ACommunicatorReportsItsDevice) {
  EXPECT_EQ(contrax::Communicator::single()->device(), torch::Device(torch::kCPU));
  EXPECT_EQ(contrax::Communicator::create(contrax::CommunicatorOptions())->device(), torch::Device(torch::kCPU));
  ::unsetenv("WORLD_SIZE");
  if (torch::cuda::is_available()) {
    ::setenv("LOCAL_RANK", "0", 1);
    EXPECT_EQ(contrax::Communicator::from_env(contrax::CommunicatorOptions().device(kCuda))->device(), cuda(0));
    ::unsetenv("LOCAL_RANK");
    return;
  }
  // No GPU here: a CUDA device is refused by name, not left to fail later.
  CONTRAX_EXPECT_ERROR(contrax::Communicator::from_env(contrax::CommunicatorOptions().device(kCuda)),
                       "Communicator::from_env(): argument 'device' is cuda, but this process sees no CUDA device");
}
