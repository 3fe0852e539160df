// c10d's NCCL backend, built in the CUDA side (util/cuda_side.h: the entry
// "nccl_backend"), where LibTorch is a CUDA build with NCCL: the only
// communicator code that needs LibTorch's CUDA libraries.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace contrax::detail {

/// A ProcessGroupNCCL of `world` ranks, this one `rank`, on `store`, its
/// collectives timing out after `timeout`.
c10::intrusive_ptr<c10d::Backend> nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                               std::chrono::milliseconds timeout);
using NcclBackendFn = decltype(&nccl_backend);

}  // namespace contrax::detail
