// The c10d process group of one backend (see comm/process_group.h).
#include "comm/process_group.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
// LibTorch may be built with MPI (Debian's 2.6 defines USE_C10D_MPI) while
// the MPI headers are not installed; MPI is then simply unavailable here.
#if defined(USE_C10D_MPI) && __has_include(<mpi.h>)
#define CONTRAX_HAVE_MPI 1
#include <torch/csrc/distributed/c10d/ProcessGroupMPI.hpp>
#endif

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/address.h"
#include "comm/c10d_log.h"
#include "comm/device_binding.h"
#include "comm/gloo_binding.h"
#include "comm/sigpipe.h"
#include "contrax/util/tasks.h"
#include "util/cuda_side.h"

namespace contrax::detail {

namespace {

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  const auto b = choose_gloo_binding(master_addr);
  switch (b.kind) {
    case GlooBinding::Kind::kInterface:
      return c10d::ProcessGroupGloo::createDeviceForInterface(b.where);
    case GlooBinding::Kind::kAddress:
      return c10d::ProcessGroupGloo::createDeviceForHostname(b.where);
    case GlooBinding::Kind::kHostName:
      break;
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// The ProcessGroup around one backend, which serves CPU tensors and, for
// Gloo (which copies through host memory) and NCCL, CUDA tensors too.
c10::intrusive_ptr<c10d::ProcessGroup> wrap_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                    int64_t world, c10d::ProcessGroup::BackendType type,
                                                    const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(rank), static_cast<int>(world));
  group->setDefaultBackend(type);
  if (type == c10d::ProcessGroup::BackendType::GLOO) group->setBackend(c10::DeviceType::CPU, type, backend);
  group->setBackend(c10::DeviceType::CUDA, type, backend);
  return group;
}

void make_gloo(CommunicatorImpl& impl, const CommunicatorOptions& o, const c10::intrusive_ptr<c10d::Store>& store) {
  // Gloo's loop and worker threads inherit this thread's mask (comm/sigpipe.h).
  const SigpipeBlocked no_sigpipe;
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = o.timeout();
  opts->devices.push_back(gloo_device(o.master_addr()));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(o.rank()),
                                                         static_cast<int>(o.world_size()), opts);
  impl.group = wrap_backend(store, o.rank(), o.world_size(), c10d::ProcessGroup::BackendType::GLOO, gloo);
  impl.backend = "gloo";
}

// Refuses, on every rank, a job in which two ranks hold one GPU, before any
// NCCL communicator exists: NCCL would fail only at the first collective,
// on the ranks that share, while the others wait for them until the timeout.
// Each rank posts its GPU's key (host and PCI bus id) in the store and reads
// everyone's (bounded by the store's timeout, as the rendezvous was); a rank
// whose bus id is unknown posts an empty key, which matches nothing.
void refuse_shared_gpus(const CommunicatorOptions& o, const c10::intrusive_ptr<c10d::Store>& store,
                        const c10::Device& gpu) {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "<unknown host>");
  const std::string mine = gpu_key(host, pci_bus_id(gpu), gpu);
  const std::string prefix = "contrax/nccl_gpu/";
  store->set(prefix + std::to_string(o.rank()), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (int64_t r = 0; r < o.world_size(); ++r) {
    const auto v = store->get(prefix + std::to_string(r));
    keys.emplace_back(v.begin(), v.end());
  }
  const auto error = shared_gpu_error(keys);
  TORCH_CHECK(error.empty(), "Communicator::create(): ", error);
}

void make_nccl(CommunicatorImpl& impl, const CommunicatorOptions& o, const c10::intrusive_ptr<c10d::Store>& store) {
  auto nccl = nccl_backend_or_error()(store, static_cast<int>(o.rank()), static_cast<int>(o.world_size()), o.timeout());
  impl.group = wrap_backend(store, o.rank(), o.world_size(), c10d::ProcessGroup::BackendType::NCCL, nccl);
  impl.backend = "nccl";
  impl.stage_device = nccl_stage_device(impl.device);
}

// How long the attempt took, said as it happened: a cause that came at once
// (a thread that could not start: EAGAIN) claims no wait, and only one that
// took the whole timeout says that a peer may never have arrived.
std::string failure_context(const std::string& cause, std::chrono::steady_clock::time_point start,
                            std::chrono::milliseconds timeout) {
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  if (cause.find("Resource temporarily unavailable") != std::string::npos) {
    const TasksLimit lim = tasks_limit();
    const std::string limit =
        lim.left < 0 ? std::string("no tasks limit is visible to this process") : "the tasks limit: " + lim.what;
    return c10::str("after ", waited.count(), " ms: a thread could not be started (", limit, ")");
  }
  if (waited < timeout * 9 / 10) return c10::str("after ", waited.count(), " ms (timeout ", timeout.count(), " ms)");
  return c10::str("within ", timeout.count(), " ms (a peer may never have arrived)");
}

}  // namespace

NcclBackendFn nccl_backend_or_error() {
  const auto make = reinterpret_cast<NcclBackendFn>(cuda_side_function("nccl_backend"));
  TORCH_CHECK(make != nullptr,
              "Communicator::create(): backend 'nccl' was requested (or implied by a CUDA device), "
              "but this build has no NCCL (the CUDA side: ",
              cuda_side_origin(), "); use backend 'gloo'");
  return make;
}

void make_process_group(CommunicatorImpl& impl, const std::string& backend, const CommunicatorOptions& o,
                        const c10::intrusive_ptr<c10d::Store>& store) {
  // Outside the try below: this refusal is the user's set-up, not a peer
  // that never arrived.
  if (backend == "nccl") refuse_shared_gpus(o, store, nccl_stage_device(impl.device));
  const auto start = std::chrono::steady_clock::now();
  std::string cause;
  try {
    // A peer that fails meanwhile takes the store away: c10d would log each
    // failed store call with a backtrace before the error said below.
    const QuietC10dLog quiet;
    if (backend == "gloo") {
      make_gloo(impl, o, store);
    } else {
      make_nccl(impl, o, store);
    }
    return;
  } catch (const c10::Error& e) {
    cause = e.what_without_backtrace();
  } catch (const std::exception& e) {
    cause = e.what();
  }
  TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " of ", o.world_size(),
              " could not build the process group ", failure_context(cause, start, o.timeout()), ": ", cause);
}

void make_mpi_process_group(CommunicatorImpl& impl) {
#ifdef CONTRAX_HAVE_MPI
  auto mpi = c10d::ProcessGroupMPI::createProcessGroupMPI();
  auto group =
      c10::make_intrusive<c10d::ProcessGroup>(static_cast<int>(mpi->getRank()), static_cast<int>(mpi->getSize()));
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::MPI);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::MPI, mpi);
  impl.group = group;
  impl.backend = "mpi";
#else
  TORCH_CHECK(false, "Communicator::create(): argument 'backend' is 'mpi', but this build has no MPI (LibTorch "
              "without MPI, or mpi.h not installed)");
#endif
}

std::string backend_name(std::string name) {
  for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

c10::Device nccl_stage_device(const c10::Device& requested) {
  if (requested.is_cuda() && requested.has_index()) return requested;
  const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return c10::Device(c10::DeviceType::CUDA, guard->getDevice().index());
}

}  // namespace contrax::detail
