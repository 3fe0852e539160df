// The c10d side of the communicator for code that holds a process group (see
// contrax/comm/detail/c10d.h): the Python binding's torch.distributed groups.
#include "contrax/comm/detail/c10d.h"

#include "comm/communicator_impl.h"
#include "comm/process_group.h"

namespace contrax::detail {

std::shared_ptr<Communicator> wrap_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                 std::chrono::milliseconds timeout) {
  auto comm = Communicator::single();
  if (!group || group->getSize() == 1) return comm;
  auto& impl = comm->impl();
  impl.rank = group->getRank();
  impl.world_size = group->getSize();
  impl.local_rank = impl.rank;
  impl.timeout = timeout;
  impl.backend = backend_name(group->getBackendName());
  // The group's own device (torch.distributed.init_process_group's
  // device_id) where it has one; else, under NCCL, the current one.
  const auto bound = group->getBoundDeviceId();
  if (bound) impl.device = *bound;
  if (impl.backend == "nccl") impl.stage_device = bound ? *bound : nccl_stage_device(torch::kCPU);
  impl.ring_all_to_all = ring_as_all_to_all(RingTransport::kAuto, impl.backend);
  impl.group = std::move(group);
  return comm;
}

c10::intrusive_ptr<c10d::ProcessGroup> process_group(const Communicator& comm) { return comm.impl().group; }

}  // namespace contrax::detail
