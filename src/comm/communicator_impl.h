// What a Communicator holds: the c10d process group and store behind it, and
// where its rank sits. Internal to the communication layer (src/comm/, the
// only code that sees c10d), not installed.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <string>

#include "contrax/comm/communicator.h"

namespace contrax::detail {

struct CommunicatorImpl {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  c10::Device device = c10::kCPU;  // the bound device (comm/device_binding.h)
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::string backend = "none";
  c10::intrusive_ptr<c10d::Store> store;         // null for world 1 or wrapped groups
  bool external_store = false;                   // served by torchrun's agent, not rank 0
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // null for world 1
  // NCCL moves CUDA tensors only: CPU tensors (row counts, flags, loss
  // values) are staged through this device, the bound one. Set for the NCCL
  // backend only.
  c10::optional<c10::Device> stage_device;
  // Ring steps as one all-to-all (RingTransport::kAllToAll) rather than a
  // send and a receive; resolved from the options and the backend.
  bool ring_all_to_all = false;
  // Communicator::static_shapes(): skip the per-call metadata exchange.
  std::atomic<bool> static_shapes{false};
};

// Whether ring steps go as one all-to-all: asked for, or left to kAuto under NCCL.
inline bool ring_as_all_to_all(RingTransport t, const std::string& backend) {
  return t == RingTransport::kAllToAll || (t == RingTransport::kAuto && backend == "nccl");
}

}  // namespace contrax::detail
