// The only translation unit that builds c10d process groups and calls their
// collectives. When c10d's API moves in a new LibTorch release, this file (and
// the data-parallel reducer) is what adapts.
#include "contrax/communicator.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
// LibTorch may be built with MPI (Debian's 2.6 defines USE_C10D_MPI) while
// the MPI headers are not installed; MPI is then simply unavailable here.
#if defined(USE_C10D_MPI) && __has_include(<mpi.h>)
#define CONTRAX_HAVE_MPI 1
#include <torch/csrc/distributed/c10d/ProcessGroupMPI.hpp>
#endif

// LibTorch 2.0 split c10d's process groups in two: a backend (Gloo, NCCL,
// MPI) is a c10d::Backend, and the c10d::ProcessGroup that collectives are
// called on wraps one backend per device type. 1.x backends are ProcessGroups.
#if TORCH_VERSION_MAJOR >= 2
#define CONTRAX_C10D_BACKENDS 1
#endif

#include <atomic>
#include <cstdlib>

#include "contrax/detail/c10d.h"

namespace contrax {

int64_t CommStats::total_bytes_sent() const {
  int64_t n = 0;
  for (const auto& kv : ops) n += kv.second.bytes_sent;
  return n;
}

int64_t CommStats::total_calls() const {
  int64_t n = 0;
  for (const auto& kv : ops) n += kv.second.calls;
  return n;
}

OpStats CommStats::op(const std::string& name) const {
  auto it = ops.find(name);
  return it == ops.end() ? OpStats{} : it->second;
}

namespace {

int64_t row_bytes(const torch::Tensor& t) {
  int64_t n = t.element_size();
  for (int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

bool all_equal(const std::vector<int64_t>& v) {
  for (auto x : v)
    if (x != v.front()) return false;
  return true;
}

// Waits for a c10d work item and turns a failure (typically a peer that never
// arrived) into an error that says which collective on which rank, and why.
void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* op, const detail::CommunicatorImpl& impl) {
  try {
    work->wait();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "contrax: collective '", op, "' failed on rank ", impl.rank, " of ", impl.world_size,
                " (backend ", impl.backend, ", timeout ", impl.timeout.count(),
                " ms); a peer may have died, hung or called a different collective: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "contrax: collective '", op, "' failed on rank ", impl.rank, " of ", impl.world_size,
                " (backend ", impl.backend, ", timeout ", impl.timeout.count(), " ms): ", e.what());
  }
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  // Honour Gloo's usual interface override; loopback jobs bind to loopback so
  // that a machine without a resolvable hostname still works.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (master_addr == "127.0.0.1" || master_addr == "localhost" || master_addr == "::1") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

#ifdef CONTRAX_C10D_BACKENDS
// The 2.x ProcessGroup around one backend, which serves CPU tensors and, for
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
#endif

// LibTorch 2.x's TCPStore defaults to a libuv server, which builds without
// libuv (Debian's 2.6) refuse at run time; the classic server is what 1.x
// always used. Set where the option exists, whatever the release.
template <typename O>
auto use_classic_store_server(O& o, int) -> decltype(o.useLibUV = false, void()) {
  o.useLibUV = false;
}
template <typename O>
void use_classic_store_server(O&, long) {}

int64_t env_int(const char* name, int64_t def, const char* expected) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0', "Communicator::from_env(): environment variable '", name, "' must be ",
              expected, ", but got '", v, "'");
  return x;
}

}  // namespace

// Pending ring exchange: the two c10d work items and the receive buffer.
struct Communicator::Pending::State {
  c10::intrusive_ptr<c10d::Work> send_work, recv_work;
  torch::Tensor send_buffer;  // kept alive until the send completes
  torch::Tensor received;
  const detail::CommunicatorImpl* impl = nullptr;
  bool done = false;
};

torch::Tensor Communicator::Pending::wait() {
  TORCH_CHECK(state_, "Communicator::Pending::wait(): this handle holds no transfer");
  if (!state_->done) {
    if (state_->send_work) wait_work(state_->send_work, "ring(send)", *state_->impl);
    if (state_->recv_work) wait_work(state_->recv_work, "ring(recv)", *state_->impl);
    state_->send_buffer = torch::Tensor();
    state_->done = true;
  }
  return state_->received;
}

Communicator::Communicator(std::unique_ptr<detail::CommunicatorImpl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

std::shared_ptr<Communicator> Communicator::single() {
  return std::shared_ptr<Communicator>(new Communicator(std::make_unique<detail::CommunicatorImpl>()));
}

std::shared_ptr<Communicator> Communicator::create(const CommunicatorOptions& o) {
  TORCH_CHECK(o.world_size() >= 1, "Communicator::create(): argument 'world_size' must be >= 1, but got ",
              o.world_size());
  TORCH_CHECK(o.rank() >= 0 && o.rank() < o.world_size(), "Communicator::create(): argument 'rank' must be in [0, ",
              o.world_size(), "), but got ", o.rank());
  TORCH_CHECK(o.timeout().count() > 0, "Communicator::create(): argument 'timeout' must be positive, but got ",
              o.timeout().count(), " ms");
  const std::string backend_req = lower(o.backend());
  TORCH_CHECK(backend_req == "auto" || backend_req == "gloo" || backend_req == "nccl" || backend_req == "mpi",
              "Communicator::create(): argument 'backend' must be one of auto, gloo, nccl, mpi, but got '",
              o.backend(), "'");
  if (o.file_store().empty()) {
    TORCH_CHECK(o.master_port() > 0 && o.master_port() < 65536,
                "Communicator::create(): argument 'master_port' must be in [1, 65535], but got ", o.master_port());
  }
  auto impl = std::make_unique<detail::CommunicatorImpl>();
  impl->rank = o.rank();
  impl->world_size = o.world_size();
  impl->local_rank = o.rank();
  impl->timeout = o.timeout();
  if (o.world_size() == 1) {
    return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
  }

  std::string backend = backend_req;
  if (backend == "auto") backend = o.device().is_cuda() ? "nccl" : "gloo";

  if (backend == "mpi") {
#ifdef CONTRAX_HAVE_MPI
    auto mpi = c10d::ProcessGroupMPI::createProcessGroupMPI();
#ifdef CONTRAX_C10D_BACKENDS
    auto group = c10::make_intrusive<c10d::ProcessGroup>(static_cast<int>(mpi->getRank()),
                                                         static_cast<int>(mpi->getSize()));
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::MPI);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::MPI, mpi);
    impl->group = group;
#else
    impl->group = mpi;
#endif
    impl->backend = "mpi";
    return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
#else
    TORCH_CHECK(false, "Communicator::create(): argument 'backend' is 'mpi', but this build has no MPI (LibTorch "
                "without MPI, or mpi.h not installed)");
#endif
  }

  // Rendezvous.
  c10::intrusive_ptr<c10d::Store> store;
  if (!o.file_store().empty()) {
    store = c10::make_intrusive<c10d::FileStore>(o.file_store(), static_cast<int>(o.world_size()));
  } else {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(o.master_port());
    so.isServer = o.rank() == 0;
    so.numWorkers = static_cast<size_t>(o.world_size());
    so.waitWorkers = true;
    so.timeout = o.timeout();
    use_classic_store_server(so, 0);
    try {
      store = c10::make_intrusive<c10d::TCPStore>(o.master_addr(), so);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " could not rendezvous at ", o.master_addr(), ":",
                  o.master_port(), " within ", o.timeout().count(), " ms: ", e.what());
    }
  }
  store->setTimeout(o.timeout());
  impl->store = store;

  try {
    if (backend == "gloo") {
      auto opts = c10d::ProcessGroupGloo::Options::create();
      opts->timeout = o.timeout();
      opts->devices.push_back(gloo_device(o.master_addr()));
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(o.rank()),
                                                             static_cast<int>(o.world_size()), opts);
#ifdef CONTRAX_C10D_BACKENDS
      impl->group = wrap_backend(store, o.rank(), o.world_size(), c10d::ProcessGroup::BackendType::GLOO, gloo);
#else
      impl->group = gloo;
#endif
      impl->backend = "gloo";
    } else {
#ifdef USE_C10D_NCCL
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = o.timeout();
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(o.rank()),
                                                             static_cast<int>(o.world_size()), opts);
#ifdef CONTRAX_C10D_BACKENDS
      impl->group = wrap_backend(store, o.rank(), o.world_size(), c10d::ProcessGroup::BackendType::NCCL, nccl);
#else
      impl->group = nccl;
#endif
      impl->backend = "nccl";
#else
      TORCH_CHECK(false,
                  "Communicator::create(): backend 'nccl' was requested (or implied by a CUDA device), but this "
                  "LibTorch was built without NCCL; use backend 'gloo'");
#endif
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " of ", o.world_size(),
                " could not build the process group within ", o.timeout().count(),
                " ms (a peer may never have arrived): ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " of ", o.world_size(),
                " could not build the process group within ", o.timeout().count(), " ms: ", e.what());
  }
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
}

std::shared_ptr<Communicator> Communicator::from_env(const CommunicatorOptions& base) {
  const int64_t world = env_int("WORLD_SIZE", 1, "a positive integer");
  TORCH_CHECK(world >= 1, "Communicator::from_env(): environment variable 'WORLD_SIZE' must be a positive integer, "
              "but got ", world);
  const int64_t rank = env_int("RANK", 0, "an integer in [0, WORLD_SIZE)");
  TORCH_CHECK(rank >= 0 && rank < world, "Communicator::from_env(): environment variable 'RANK' must be in [0, ",
              world, "), but got ", rank);
  const int64_t local_rank = env_int("LOCAL_RANK", rank, "a non-negative integer");
  CommunicatorOptions o = base;
  o.rank(rank).world_size(world);
  if (world > 1) {
    const char* addr = std::getenv("MASTER_ADDR");
    TORCH_CHECK(addr != nullptr && *addr != '\0',
                "Communicator::from_env(): environment variable 'MASTER_ADDR' must be set when WORLD_SIZE > 1");
    TORCH_CHECK(std::getenv("MASTER_PORT") != nullptr,
                "Communicator::from_env(): environment variable 'MASTER_PORT' must be set when WORLD_SIZE > 1");
    o.master_addr(addr).master_port(env_int("MASTER_PORT", 0, "a port number"));
  }
  auto comm = create(o);
  comm->impl_->local_rank = local_rank;
  return comm;
}

int64_t Communicator::rank() const { return impl_->rank; }
int64_t Communicator::world_size() const { return impl_->world_size; }
int64_t Communicator::local_rank() const { return impl_->local_rank; }
std::string Communicator::backend() const { return impl_->backend; }
std::chrono::milliseconds Communicator::timeout() const { return impl_->timeout; }

void Communicator::record(const std::string& name, int64_t bytes_sent, int64_t calls) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  auto& s = stats_.ops[name];
  s.calls += calls;
  s.bytes_sent += bytes_sent;
}

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

void Communicator::reset_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_ = CommStats();
}

torch::Tensor Communicator::all_gather_rows(const torch::Tensor& local, const std::vector<int64_t>& counts,
                                            const std::string& stat_name) {
  const int64_t W = world_size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W, "all_gather_rows: counts has ", counts.size(),
                        " entries for world size ", W);
  TORCH_INTERNAL_ASSERT(local.dim() >= 1 && local.size(0) == counts[rank()]);
  if (W == 1) return local;
  int64_t total = 0;
  for (auto c : counts) total += c;
  auto shape = local.sizes().vec();
  shape[0] = total;
  auto out = torch::empty(shape, local.options());
  if (total == 0) return out;
  auto src = local.contiguous();
  auto& pg = *impl_->group;
  if (all_equal(counts)) {
    // Gloo copies into the output list; views into one buffer avoid a cat.
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int64_t s = 0; s < W; ++s) outputs[0].push_back(out.narrow(0, s * counts[0], counts[0]));
    std::vector<at::Tensor> inputs{src};
    wait_work(pg.allgather(outputs, inputs), "all_gather", *impl_);
  } else {
    // Uneven rows: an all-to-all whose input is our rows once per destination
    // moves exactly each rank's rows to every other rank, with no padding.
    auto rep_shape = local.sizes().vec();
    rep_shape.insert(rep_shape.begin(), W);
    auto input = src.unsqueeze(0).expand(rep_shape).contiguous().view(
        [&] { auto s = local.sizes().vec(); s[0] = W * local.size(0); return s; }());
    std::vector<int64_t> in_splits(W, local.size(0));
    std::vector<int64_t> out_splits(counts.begin(), counts.end());
    wait_work(pg.alltoall_base(out, input, out_splits, in_splits), "all_gather", *impl_);
  }
  record(stat_name, (W - 1) * local.size(0) * row_bytes(local));
  return out;
}

torch::Tensor Communicator::reduce_scatter_rows(const torch::Tensor& full, const std::vector<int64_t>& counts,
                                                const std::string& stat_name) {
  const int64_t W = world_size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W);
  if (W == 1) return full;
  const int64_t mine = counts[rank()];
  int64_t total = 0;
  for (auto c : counts) total += c;
  TORCH_INTERNAL_ASSERT(full.size(0) == total, "reduce_scatter_rows: ", full.size(0), " rows, expected ", total);
  auto shape = full.sizes().vec();
  shape[0] = mine;
  if (total == 0) return torch::zeros(shape, full.options());
  auto src = full.contiguous();
  auto& pg = *impl_->group;
  torch::Tensor result;
  if (impl_->backend == "nccl" && all_equal(counts)) {
    result = torch::empty(shape, full.options());
    wait_work(pg._reduce_scatter_base(result, src), "reduce_scatter", *impl_);
  } else {
    // Gloo has no true reduce-scatter: 1.13 has none, and 2.x's
    // reduce_scatter_tensor sends an all-reduce's bytes, twice the volume
    // (measured: python/bench/gloo_reduce_scatter_bytes.py). So every rank
    // sends slice s to rank s (all-to-all) and sums the W contributions it
    // received. Volume: total - mine rows sent, the reduce-scatter's.
    auto recv_shape = full.sizes().vec();
    recv_shape[0] = W * mine;
    auto recv = torch::empty(recv_shape, full.options());
    std::vector<int64_t> out_splits(W, mine);
    std::vector<int64_t> in_splits(counts.begin(), counts.end());
    wait_work(pg.alltoall_base(recv, src, out_splits, in_splits), "reduce_scatter", *impl_);
    auto parts = recv.view([&] {
      auto s = full.sizes().vec();
      s[0] = mine;
      s.insert(s.begin(), W);
      return s;
    }());
    result = parts.sum(0);
  }
  record(stat_name, (total - mine) * row_bytes(full));
  return result;
}

void Communicator::all_reduce_sum(torch::Tensor& tensor, const std::string& stat_name) {
  const int64_t W = world_size();
  if (W == 1) return;
  TORCH_CHECK(tensor.is_contiguous(), "Communicator::all_reduce_sum(): argument 'tensor' must be contiguous");
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_work(impl_->group->allreduce(ts, opts), "all_reduce", *impl_);
  record(stat_name, 2 * (W - 1) * tensor.numel() * tensor.element_size() / W);
}

std::vector<std::vector<int64_t>> Communicator::all_gather_ints(const std::vector<int64_t>& values,
                                                                const std::string& stat_name) {
  const int64_t W = world_size();
  if (W == 1) return {values};
  const int64_t n = static_cast<int64_t>(values.size());
  auto local = torch::tensor(values, torch::kInt64);
  // A length mismatch would corrupt the gather; lead every vector by its length
  // so that a caller bug shows up as an internal assert, not garbage.
  auto framed = torch::cat({torch::tensor({n}, torch::kInt64), local});
  std::vector<int64_t> counts(W, 1);
  auto all = all_gather_rows(framed.unsqueeze(0), counts, stat_name);
  std::vector<std::vector<int64_t>> out(W);
  auto acc = all.accessor<int64_t, 2>();
  for (int64_t s = 0; s < W; ++s) {
    TORCH_INTERNAL_ASSERT(acc[s][0] == n, "all_gather_ints: rank ", s, " sent ", acc[s][0], " values, expected ", n);
    for (int64_t i = 0; i < n; ++i) out[s].push_back(acc[s][i + 1]);
  }
  return out;
}

void Communicator::broadcast(torch::Tensor& tensor, int64_t root, const std::string& stat_name) {
  if (world_size() == 1) return;
  TORCH_CHECK(root >= 0 && root < world_size(), "Communicator::broadcast(): argument 'root' must be in [0, ",
              world_size(), "), but got ", root);
  TORCH_CHECK(tensor.is_contiguous(), "Communicator::broadcast(): argument 'tensor' must be contiguous");
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  wait_work(impl_->group->broadcast(ts, opts), "broadcast", *impl_);
  record(stat_name, rank() == root ? tensor.numel() * tensor.element_size() : 0);
}

Communicator::Pending Communicator::ring_exchange_async(const torch::Tensor& send, at::IntArrayRef recv_shape,
                                                        int64_t shift, const std::string& stat_name) {
  const int64_t W = world_size();
  Pending p;
  p.state_ = std::make_shared<Pending::State>();
  p.state_->impl = impl_.get();
  const int64_t s = ((shift % W) + W) % W;
  if (W == 1 || s == 0) {
    TORCH_INTERNAL_ASSERT(send.sizes() == recv_shape, "ring_exchange: a self-exchange must keep the shape");
    p.state_->received = send;
    p.state_->done = true;
    return p;
  }
  const int dst = static_cast<int>((rank() + s) % W);
  const int src = static_cast<int>((rank() - s + W) % W);
  // Every rank calls ring exchanges in the same order, so a per-communicator
  // counter gives matching tags without any negotiation.
  static_assert(sizeof(int) >= 4, "");
  const int tag = static_cast<int>(ring_tag_++ & 0x3fffffff);
  p.state_->send_buffer = send.contiguous();
  p.state_->received = torch::empty(recv_shape, send.options());
  std::vector<at::Tensor> sv{p.state_->send_buffer}, rv{p.state_->received};
  if (p.state_->send_buffer.numel() > 0) p.state_->send_work = impl_->group->send(sv, dst, tag);
  if (p.state_->received.numel() > 0) p.state_->recv_work = impl_->group->recv(rv, src, tag);
  record(stat_name, send.numel() * send.element_size());
  return p;
}

torch::Tensor Communicator::ring_exchange(const torch::Tensor& send, at::IntArrayRef recv_shape, int64_t shift,
                                          const std::string& stat_name) {
  return ring_exchange_async(send, recv_shape, shift, stat_name).wait();
}

void Communicator::barrier() {
  if (world_size() == 1) return;
  wait_work(impl_->group->barrier(), "barrier", *impl_);
}

namespace detail {

std::shared_ptr<Communicator> wrap_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                 std::chrono::milliseconds timeout) {
  auto comm = Communicator::single();
  if (!group || group->getSize() == 1) return comm;
  auto& impl = comm->impl();
  impl.rank = group->getRank();
  impl.world_size = group->getSize();
  impl.local_rank = impl.rank;
  impl.timeout = timeout;
  impl.backend = lower(group->getBackendName());
  impl.group = std::move(group);
  return comm;
}

c10::intrusive_ptr<c10d::ProcessGroup> process_group(const Communicator& comm) { return comm.impl().group; }

}  // namespace detail
}  // namespace contrax
