// c10d's NCCL backend in the CUDA side (see comm/nccl_backend.h).
#include "comm/nccl_backend.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#ifdef USE_C10D_NCCL
namespace contrax::detail {

c10::intrusive_ptr<c10d::Backend> nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                               std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, opts);
}

}  // namespace contrax::detail
#endif
