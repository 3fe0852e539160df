// The c10d side of the communicator. Included only by src/ files that must hand
// a process group to c10d machinery (the data-parallel Reducer) and by the
// Python binding, which wraps a `torch.distributed` ProcessGroup. Everything
// else goes through contrax/communicator.h.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "contrax/communicator.h"

namespace contrax {
namespace detail {

struct CommunicatorImpl {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::string backend = "none";
  c10::intrusive_ptr<c10d::Store> store;          // null for world 1 or wrapped groups
  c10::intrusive_ptr<c10d::ProcessGroup> group;   // null for world 1
  // NCCL moves CUDA tensors only: CPU tensors (row counts, flags, loss
  // values) are staged through this device. Set for the NCCL backend only.
  c10::optional<c10::Device> stage_device;
};

/// Wraps an existing process group (e.g. one made by torch.distributed).
/// A null group, or one of size 1, gives a world-1 communicator.
std::shared_ptr<Communicator> wrap_process_group(
    c10::intrusive_ptr<c10d::ProcessGroup> group,
    std::chrono::milliseconds timeout = std::chrono::minutes(5));

/// The process group behind a communicator (null for world 1).
c10::intrusive_ptr<c10d::ProcessGroup> process_group(const Communicator& comm);

}  // namespace detail
}  // namespace contrax
