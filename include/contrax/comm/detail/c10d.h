// The c10d side of the communicator, for code outside Contrax's library that
// holds a c10d process group: the Python binding wraps a torch.distributed
// ProcessGroup with it, and tests look at the group behind a communicator.
// Inside the library only src/comm/ sees c10d; everything else goes through
// contrax/comm/communicator.h.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>

#include "contrax/comm/communicator.h"

namespace contrax::detail {

/// Wraps an existing process group (e.g. one made by torch.distributed).
/// A null group, or one of size 1, gives a world-1 communicator.
std::shared_ptr<Communicator> wrap_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                 std::chrono::milliseconds timeout = std::chrono::minutes(5));

/// The process group behind a communicator (null for world 1).
c10::intrusive_ptr<c10d::ProcessGroup> process_group(const Communicator& comm);

}  // namespace contrax::detail
