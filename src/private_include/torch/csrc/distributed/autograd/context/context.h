// Build shim, not part of Contrax's API (not installed).
//
// c10d's reducer.hpp includes this distributed-autograd header, which Debian's
// libtorch-dev (1.13.1) does not ship. The Reducer only needs two names from
// it: DistAutogradContext::GradCallback (for a static_assert) and ContextPtr
// (a shared_ptr member and an atomic raw pointer in Reducer::RpcContext). Both
// have the same size and layout whatever the pointee, so declaring them here
// keeps sizeof(c10d::Reducer) identical to the compiled library's. Where the
// real header exists (a full LibTorch), it is used instead.
#pragma once

#if defined(__has_include_next) && __has_include_next(<torch/csrc/distributed/autograd/context/context.h>)
#include_next <torch/csrc/distributed/autograd/context/context.h>
#else
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};
using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace autograd
}  // namespace distributed
}  // namespace torch
#endif
