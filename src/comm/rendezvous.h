// The rendezvous: the store every rank of a job meets in (a shared file, rank
// 0's TCP store on MASTER_ADDR, or torchrun's agent's), and Contrax's own
// arrival check on it, so that a missing rank, a WORLD_SIZE that differs
// between ranks or a rank started twice is an error that says so, within one
// deadline. Internal to src/comm/, not installed.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "contrax/comm/communicator.h"

namespace contrax::detail {

/// The store of `o` (world size > 1) once every rank has arrived, all of it
/// within `o.timeout()`; keys under `o.store_prefix()` when set.
c10::intrusive_ptr<c10d::Store> rendezvous(const CommunicatorOptions& o);

}  // namespace contrax::detail
