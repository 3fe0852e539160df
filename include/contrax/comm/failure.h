// Failures that involve more than one rank, told with context.
//
// A collective that Contrax waits on itself (Communicator's methods) already
// fails with a message naming the collective, the rank and the peers that did
// not answer. Some waits happen inside c10d code — the DataParallel reducer's
// gradient all-reduce runs in autograd's backward — and would surface as raw
// Gloo text ("unbound_buffer.cc:81 Timed out ..."). `with_collective_context`
// wraps such a region so that its errors read like the others.
#pragma once

#include <functional>
#include <string>

#include "contrax/comm/communicator.h"

namespace contrax {

/// Runs `fn`. A c10d/Gloo failure escaping it (timeout, closed or reset
/// connection) is rethrown as "contrax: collective '<op>' timed out on rank R
/// of W (...); rank S did not answer ...; cause: ...". Any other error passes
/// through unchanged, as does a world of size 1.
///
///   contrax::with_collective_context(*comm, "gradient all_reduce (DataParallel)",
///                                    [&] { loss.backward(); });
void with_collective_context(const Communicator& comm, const std::string& op, const std::function<void()>& fn);

}  // namespace contrax
