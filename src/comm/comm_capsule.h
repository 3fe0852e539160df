// A communicator kept alive by an autograd graph until its backward runs: an
// autograd function's saved_data holds it as a capsule (the gathers'
// backward, src/comm/collectives.cpp; the engine's column statistics,
// src/engine/score_block.cpp). Internal (src/comm/), not installed.
#pragma once

#include <torch/torch.h>

#include <utility>

#include "contrax/comm/communicator.h"

namespace contrax::detail {

struct CommCapsule : torch::CustomClassHolder {
  explicit CommCapsule(CommunicatorPtr c) : comm(std::move(c)) {}
  CommunicatorPtr comm;
};

/// `comm` as a value saved_data can hold.
inline c10::IValue comm_capsule(CommunicatorPtr comm) {
  return c10::IValue::make_capsule(c10::make_intrusive<CommCapsule>(std::move(comm)));
}

/// The communicator a comm_capsule holds.
inline CommunicatorPtr capsule_comm(const c10::IValue& capsule) {
  return static_cast<CommCapsule*>(capsule.toCapsule().get())->comm;
}

}  // namespace contrax::detail
