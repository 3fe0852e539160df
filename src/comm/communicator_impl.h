// What a Communicator holds: the c10d process group and store behind it, and
// where its rank sits. Internal to the communication layer (src/comm/, the
// only code that sees c10d), not installed.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include "contrax/communicator.h"

namespace contrax::detail {

struct CommunicatorImpl {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::string backend = "none";
  c10::intrusive_ptr<c10d::Store> store;         // null for world 1 or wrapped groups
  bool external_store = false;                   // served by torchrun's agent, not rank 0
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // null for world 1
  // NCCL moves CUDA tensors only: CPU tensors (row counts, flags, loss
  // values) are staged through this device. Set for the NCCL backend only.
  c10::optional<c10::Device> stage_device;
};

}  // namespace contrax::detail
