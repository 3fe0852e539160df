// The c10d side of the communicator. Included only by src/ files that must hand
// a process group to c10d machinery (the data-parallel Reducer) and by the
// Python binding, which wraps a `torch.distributed` ProcessGroup. Everything
// else goes through contrax/communicator.h.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "contrax/communicator.h"

#include <unordered_map>

namespace c10d {
class Reducer;
}  // namespace c10d

namespace contrax {
namespace detail {

struct CommunicatorImpl {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::string backend = "none";
  c10::intrusive_ptr<c10d::Store> store;          // null for world 1 or wrapped groups
  bool external_store = false;                    // served by torchrun's agent, not rank 0
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

/// c10d's gradient Reducer over `comm`'s process group, with buckets of
/// [first_bucket_bytes, bucket_bytes] as PyTorch's DDP assigns them. Its
/// constructor changes between LibTorch releases; this adapts to each.
std::unique_ptr<c10d::Reducer> make_reducer(const Communicator& comm, const std::vector<at::Tensor>& params,
                                            int64_t first_bucket_bytes, int64_t bucket_bytes,
                                            bool find_unused_parameters, bool gradient_as_bucket_view,
                                            std::unordered_map<size_t, std::string> names);

}  // namespace detail
}  // namespace contrax
