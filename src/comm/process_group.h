// The c10d process group of one backend over a rendezvous store: Gloo (bound
// where the route to rank 0 leaves this machine), NCCL, or MPI where the build
// has it; and the CUDA device NCCL stages CPU tensors through. Internal to
// src/comm/, not installed.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

#include "comm/communicator_impl.h"
#include "comm/nccl_backend.h"

namespace contrax::detail {

/// Fills `impl`'s group and backend name with a "gloo" or "nccl" group over
/// `store` (errors name the backend that cannot be built and why).
void make_process_group(CommunicatorImpl& impl, const std::string& backend, const CommunicatorOptions& o,
                        const c10::intrusive_ptr<c10d::Store>& store);

/// The CUDA side's NCCL backend (comm/nccl_backend.h); an error naming the
/// reason where there is none (a CPU-only LibTorch, one without NCCL, the
/// CUDA side not found).
NcclBackendFn nccl_backend_or_error();

/// Fills `impl`'s group with MPI's own (no store: MPI has its own launcher);
/// an error where the build has no MPI.
void make_mpi_process_group(CommunicatorImpl& impl);

/// A backend's name as Contrax spells it ("gloo", "nccl", "mpi", "auto"):
/// lower case, whatever c10d or the caller wrote.
std::string backend_name(std::string name);

/// The CUDA device an NCCL group stages CPU tensors through: `requested` when
/// it is a CUDA device with an index, else the calling thread's current device
/// (the one NCCL itself uses when a collective names no device).
c10::Device nccl_stage_device(const c10::Device& requested);

}  // namespace contrax::detail
