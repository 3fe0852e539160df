// Failure diagnosis of the collectives: a failed c10d wait becomes an error
// that names the collective, this rank, the peers that did not answer and the
// cause, and is recorded for the launcher (contrax/launch/launcher.h) as a
// consequence of a peer's failure. The public side is contrax/comm/failure.h.
// Internal to src/comm/, not installed.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>

#include "comm/communicator_impl.h"

namespace contrax::detail {

/// First line of a c10d/Gloo message, without its source-file prefix.
std::string cause_of(const std::string& raw);

/// Throws the error of the failed collective `op` (raw: c10d's message) after
/// asking the store which peers are still alive.
[[noreturn]] void fail_collective(const std::string& raw, const std::string& op, const CommunicatorImpl& impl);

/// Waits for a c10d work item; a failure becomes fail_collective's error.
void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* op, const CommunicatorImpl& impl);

}  // namespace contrax::detail
