// The communicator (contrax/comm/communicator.h): creation, statistics and
// collectives on the c10d process group. Differences between the supported
// LibTorch releases are named by the release that brought them.
#include "contrax/comm/communicator.h"

#include <torch/version.h>

#include <exception>

#include "comm/address.h"
#include "comm/communicator_impl.h"
#include "comm/device_binding.h"
#include "comm/environment.h"
#include "comm/failure.h"
#include "comm/gloo_binding.h"
#include "comm/process_group.h"
#include "comm/rendezvous.h"
#include "comm/sigpipe.h"
#include "util/cuda_side.h"
#include "contrax/launch/launcher.h"

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

using detail::wait_work;

int64_t row_bytes(const torch::Tensor& t) {
  int64_t n = t.element_size();
  for (int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

bool all_equal(const std::vector<int64_t>& v) {
  for (auto x : v) {
    if (x != v.front()) return false;
  }
  return true;
}

// Where `t` travels for a collective when not as it is (comm/device_binding.h).
c10::optional<torch::Device> staging(const detail::CommunicatorImpl& impl, const torch::Tensor& t) {
  return detail::staging_device(impl.backend, impl.stage_device, t.device());
}

// Runs the in-place collective `run` on a staged copy of `t` and copies the
// result back; false, running nothing, when `t` travels as it is.
template <typename Run>
bool ran_staged(const detail::CommunicatorImpl& impl, torch::Tensor& t, Run run) {
  const auto via = staging(impl, t);
  if (!via) return false;
  auto staged = t.to(*via);
  run(staged);
  t.copy_(staged);
  return true;
}

// Whether a device binding needs the CUDA devices counted: only then is the
// CUDA side loaded (util/cuda_side.h), so that a CPU job never loads
// LibTorch's CUDA libraries.
bool wants_cuda(const torch::Device& device, const std::string& backend) {
  return device.is_cuda() || backend == "nccl";
}

// The backend `create` builds: "auto" is NCCL for a CUDA device, else Gloo.
std::string checked_backend(const CommunicatorOptions& o) {
  TORCH_CHECK(o.world_size() >= 1, "Communicator::create(): argument 'world_size' must be >= 1, but got ",
              o.world_size());
  TORCH_CHECK(o.rank() >= 0 && o.rank() < o.world_size(), "Communicator::create(): argument 'rank' must be in [0, ",
              o.world_size(), "), but got ", o.rank());
  TORCH_CHECK(o.timeout().count() > 0, "Communicator::create(): argument 'timeout' must be positive, but got ",
              o.timeout().count(), " ms");
  const std::string backend = detail::backend_name(o.backend());
  TORCH_CHECK(backend == "auto" || backend == "gloo" || backend == "nccl" || backend == "mpi",
              "Communicator::create(): argument 'backend' must be one of auto, gloo, nccl, mpi, but got '",
              o.backend(), "'");
  if (o.file_store().empty()) {
    TORCH_CHECK(o.master_port() > 0 && o.master_port() < 65536,
                "Communicator::create(): argument 'master_port' must be in [1, 65535], but got ", o.master_port());
  }
  return backend == "auto" ? (o.device().is_cuda() ? "nccl" : "gloo") : backend;
}

// LibTorch 2.13 renamed ProcessGroup's alltoall_base, _reduce_scatter_base and
// _allgather_base to all_to_all_single, reduce_scatter_single and
// all_gather_single (the old names stay, deprecated).
constexpr bool kSingleNames = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13);

template <typename PG = c10d::ProcessGroup>
c10::intrusive_ptr<c10d::Work> all_to_all_single(PG& pg, at::Tensor& out, at::Tensor& in,
                                                 std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits) {
  if constexpr (kSingleNames) {
    return pg.all_to_all_single(out, in, out_splits, in_splits);
  } else {
    return pg.alltoall_base(out, in, out_splits, in_splits);
  }
}

// The two collectives from one tensor into one tensor: an all-gather (rank
// order, equal slices) and a reduce-scatter with SUM.
enum class SingleTensor { kAllGather, kReduceScatter };

template <typename PG = c10d::ProcessGroup>
c10::intrusive_ptr<c10d::Work> single_tensor(PG& pg, SingleTensor op, at::Tensor& out, at::Tensor& in) {
  const bool gather = op == SingleTensor::kAllGather;
  if constexpr (kSingleNames) {
    return gather ? pg.all_gather_single(out, in) : pg.reduce_scatter_single(out, in);
  } else {
    return gather ? pg._allgather_base(out, in) : pg._reduce_scatter_base(out, in);
  }
}

}  // namespace

// Pending ring exchange: the c10d work items (a send and a receive, or one
// all-to-all in send_work) and the receive buffer.
struct Communicator::Pending::State {
  c10::intrusive_ptr<c10d::Work> send_work, recv_work;
  torch::Tensor send_buffer;  // kept alive until the send completes
  torch::Tensor received;
  c10::optional<torch::Device> deliver_to;  // set when `received` is a host copy of a CUDA exchange
  const detail::CommunicatorImpl* impl = nullptr;
  bool done = false;
};

torch::Tensor Communicator::Pending::wait() {
  TORCH_CHECK(state_, "Communicator::Pending::wait(): this handle holds no transfer");
  if (!state_->done) {
    if (state_->send_work) wait_work(state_->send_work, "ring(send)", *state_->impl);
    if (state_->recv_work) wait_work(state_->recv_work, "ring(recv)", *state_->impl);
    state_->send_buffer = torch::Tensor();
    if (state_->deliver_to) state_->received = state_->received.to(*state_->deliver_to);
    state_->done = true;
  }
  return state_->received;
}

Communicator::Communicator(std::unique_ptr<detail::CommunicatorImpl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() {
  // Destroyed while an exception unwinds: this rank is failing, and tearing
  // down its process group is about to make its peers' collectives fail.
  // Recorded first, so the launcher blames this rank, not the peers that
  // may exit before it.
  if (std::uncaught_exceptions() > 0 && impl_ && impl_->world_size > 1) {
    record_worker_failure(/*caused_by_peer=*/false, "failed with an exception on rank " + std::to_string(impl_->rank));
  }
}

std::shared_ptr<Communicator> Communicator::single() {
  return std::shared_ptr<Communicator>(new Communicator(std::make_unique<detail::CommunicatorImpl>()));
}

std::shared_ptr<Communicator> Communicator::create(const CommunicatorOptions& o) {
  const std::string backend = checked_backend(o);
  detail::DevicePlace place;
  place.requested = o.device();
  place.world_size = o.world_size();
  place.cuda_devices = wants_cuda(o.device(), backend) ? detail::cuda_device_count() : 0;
  place.backend = backend;
  auto impl = std::make_unique<detail::CommunicatorImpl>();
  impl->rank = o.rank();
  impl->world_size = o.world_size();
  impl->local_rank = o.rank();
  impl->timeout = o.timeout();
  impl->device = detail::bind_device(place, "Communicator::create()");
  detail::make_current(impl->device);
  if (o.world_size() > 1) {
    // Before any rendezvous: NCCL cannot start without a GPU, and its own
    // error would come only after the peers have gathered.
    if (backend == "nccl") detail::nccl_backend_or_error();
    TORCH_CHECK(backend != "nccl" || place.cuda_devices > 0, "Communicator::create(): backend 'nccl' needs a "
                "CUDA device, but this machine has none; use backend 'gloo'");
    if (backend == "mpi") {
      detail::make_mpi_process_group(*impl);
    } else {
      impl->store = detail::rendezvous(o);
      impl->external_store = o.external_store();
      detail::make_process_group(*impl, backend, o, impl->store);
    }
    impl->ring_all_to_all = detail::ring_as_all_to_all(o.ring_transport(), impl->backend);
  }
  impl->static_shapes = o.static_shapes();
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
}

std::shared_ptr<Communicator> Communicator::from_env(const CommunicatorOptions& base) {
  auto env = detail::job_environment(base);
  detail::DevicePlace place;
  place.requested = base.device();
  place.world_size = env.options.world_size();
  place.local_rank = env.local_rank;
  place.local_world_size = env.local_world_size;
  place.backend = checked_backend(env.options);
  place.cuda_devices = wants_cuda(base.device(), place.backend) ? detail::cuda_device_count() : 0;
  env.options.device(detail::bind_device(place, "Communicator::from_env()"));
  auto comm = create(env.options);
  comm->impl_->local_rank = env.local_rank;
  return comm;
}

int64_t Communicator::rank() const { return impl_->rank; }
int64_t Communicator::world_size() const { return impl_->world_size; }
int64_t Communicator::local_rank() const { return impl_->local_rank; }
torch::Device Communicator::device() const { return impl_->device; }
std::string Communicator::backend() const { return impl_->backend; }
std::chrono::milliseconds Communicator::timeout() const { return impl_->timeout; }
bool Communicator::static_shapes() const { return impl_->static_shapes.load(); }
void Communicator::set_static_shapes(bool on) { impl_->static_shapes = on; }

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
  if (const auto via = staging(*impl_, local)) {
    return all_gather_rows(local.to(*via), counts, stat_name).to(local.device());
  }
  int64_t total = 0;
  for (auto c : counts) total += c;
  auto shape = local.sizes().vec();
  shape[0] = total;
  auto out = torch::empty(shape, local.options());
  if (total == 0) return out;
  auto src = local.contiguous();
  auto& pg = *impl_->group;
  if (all_equal(counts)) {
    // One output tensor, W slices of equal rows in rank order: NCCL's
    // all-gather into one buffer (its list form adds a copy per rank), and
    // Gloo's (which has it too, in LibTorch 2.6 as in the newest).
    wait_work(single_tensor(pg, SingleTensor::kAllGather, out, src), "all_gather", *impl_);
  } else {
    // Uneven rows: an all-to-all whose input is our rows once per destination
    // moves exactly each rank's rows to every other rank, with no padding.
    auto rep_shape = local.sizes().vec();
    rep_shape.insert(rep_shape.begin(), W);
    auto input = src.unsqueeze(0).expand(rep_shape).contiguous().view(
        [&] { auto s = local.sizes().vec(); s[0] = W * local.size(0); return s; }());
    std::vector<int64_t> in_splits(W, local.size(0));
    std::vector<int64_t> out_splits(counts.begin(), counts.end());
    wait_work(all_to_all_single(pg, out, input, out_splits, in_splits), "all_gather", *impl_);
  }
  record(stat_name, (W - 1) * local.size(0) * row_bytes(local));
  return out;
}

torch::Tensor Communicator::reduce_scatter_rows(const torch::Tensor& full, const std::vector<int64_t>& counts,
                                                const std::string& stat_name) {
  const int64_t W = world_size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W);
  if (W == 1) return full;
  if (const auto via = staging(*impl_, full)) {
    return reduce_scatter_rows(full.to(*via), counts, stat_name).to(full.device());
  }
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
    wait_work(single_tensor(pg, SingleTensor::kReduceScatter, result, src), "reduce_scatter", *impl_);
  } else {
    // Gloo has no true reduce-scatter: its reduce_scatter_tensor sends an all-reduce's bytes, twice the volume
    // (measured: python/bench/gloo_reduce_scatter_bytes.py). So every rank
    // sends slice s to rank s (all-to-all) and sums the W contributions it
    // received. Volume: total - mine rows sent, the reduce-scatter's.
    auto recv_shape = full.sizes().vec();
    recv_shape[0] = W * mine;
    auto recv = torch::empty(recv_shape, full.options());
    std::vector<int64_t> out_splits(W, mine);
    std::vector<int64_t> in_splits(counts.begin(), counts.end());
    wait_work(all_to_all_single(pg, recv, src, out_splits, in_splits), "reduce_scatter", *impl_);
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
  if (ran_staged(*impl_, tensor, [&](torch::Tensor& staged) { all_reduce_sum(staged, stat_name); })) return;
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_work(impl_->group->allreduce(ts, opts), "all_reduce", *impl_);
  record(stat_name, 2 * (W - 1) * tensor.numel() * tensor.element_size() / W);
}

std::vector<std::vector<int64_t>> Communicator::all_gather_ints(const std::vector<int64_t>& values,
                                                                const std::string& stat_name,
                                                                const c10::optional<torch::Device>& via) {
  const int64_t W = world_size();
  if (W == 1) return {values};
  const int64_t n = static_cast<int64_t>(values.size());
  auto local = torch::tensor(values, torch::kInt64);
  // A length mismatch would corrupt the gather; lead every vector by its length
  // so that a caller bug shows up as an internal assert, not garbage.
  auto framed = torch::cat({torch::tensor({n}, torch::kInt64), local});
  std::vector<int64_t> counts(W, 1);
  if (via && via->is_cuda()) framed = framed.to(*via);
  auto all = all_gather_rows(framed.unsqueeze(0), counts, stat_name).cpu();
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
  if (ran_staged(*impl_, tensor, [&](torch::Tensor& staged) { broadcast(staged, root, stat_name); })) return;
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
  // Gloo's send/recv hand the tensor's pointer to its TCP transport as host
  // memory: a CUDA exchange over Gloo goes through host copies both ways, as
  // every collective does (staging).
  const auto via = staging(*impl_, send);
  const bool via_host = via && via->is_cpu();
  p.state_->send_buffer = via_host ? send.to(torch::kCPU).contiguous() : send.contiguous();
  p.state_->received = torch::empty(recv_shape, send.options().device(via_host ? torch::Device(torch::kCPU)
                                                                                : send.device()));
  if (via_host) p.state_->deliver_to = send.device();
  if (impl_->ring_all_to_all) {
    // One collective over flat views (the two blocks may differ in shape):
    // our elements go to dst only, elements arrive from src only.
    auto in = p.state_->send_buffer.view({-1});
    auto out = p.state_->received.view({-1});
    std::vector<int64_t> in_splits(W, 0), out_splits(W, 0);
    in_splits[dst] = in.numel();
    out_splits[src] = out.numel();
    p.state_->send_work = all_to_all_single(*impl_->group, out, in, out_splits, in_splits);
  } else {
    std::vector<at::Tensor> sv{p.state_->send_buffer}, rv{p.state_->received};
    if (p.state_->send_buffer.numel() > 0) {
      const detail::SigpipeBlocked no_sigpipe;  // Gloo's send writes on this thread first (comm/sigpipe.h)
      p.state_->send_work = impl_->group->send(sv, dst, tag);
    }
    if (p.state_->received.numel() > 0) p.state_->recv_work = impl_->group->recv(rv, src, tag);
  }
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

std::string gloo_binding(const std::string& master_addr) {
  const auto b = detail::choose_gloo_binding(master_addr);
  switch (b.kind) {
    case detail::GlooBinding::Kind::kInterface:
      return "interface " + b.where + ": " + b.why;
    case detail::GlooBinding::Kind::kAddress: {
      const auto ifname = detail::interface_of(b.where);
      return b.where + (ifname.empty() ? "" : " (" + ifname + ")") + ": " + b.why;
    }
    case detail::GlooBinding::Kind::kHostName:
      break;
  }
  return "the address of this machine's host name (Gloo's default): " + b.why;
}

}  // namespace contrax
