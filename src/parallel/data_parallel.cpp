// DataParallel (see data_parallel.h): c10d's Reducer driven from C++ as
// PyTorch's Python DDP drives it (torch/nn/parallel/distributed.py). After the
// checks and rank 0's broadcast the Reducer gets DDP's bucket assignment
// (detail::GradientReducer in src/comm/ adapts to each release's constructor
// and owns the communication hook); a synchronised forward calls
// rebuild_buckets() (a no-op after the first time), then
// prepare_for_backward(outputs), which arms the reducer's autograd hooks; under
// no_sync they return at once and gradients accumulate locally. All of it works
// from C++: the hooks are C++ post-hooks on the parameters' AccumulateGrad
// nodes, finalize_backward is queued with the C++ autograd engine; what DDP's
// Python adds (Logger, join hooks, mixed precision, static graph) is not needed.
#include "contrax/parallel/data_parallel.h"

#include <unordered_map>

#include "comm/reducer.h"

namespace contrax {

namespace detail {
void collect_tensors(const c10::IValue& v, std::vector<torch::Tensor>& out) {
  if (v.isTensor()) {
    collect_tensors(v.toTensor(), out);
  } else if (v.isTensorList()) {
    // Indexed: iterating a c10::List yields proxies, which gcc 14 flags as
    // dangling references when bound to `const Tensor&`.
    const c10::List<at::Tensor> list = v.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) collect_tensors(list.get(i), out);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) collect_tensors(e, out);
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) collect_tensors(e, out);
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) collect_tensors(kv.value(), out);
  }
}
}  // namespace detail

namespace {

// Per-tensor description exchanged before any broadcast: kind (0 parameter,
// 1 buffer), dtype, ndim, sizes. Flattened to one int vector per rank.
struct TensorMeta {
  std::string name;
  int64_t kind = 0;
  int64_t dtype = 0;
  std::vector<int64_t> sizes;
};

std::vector<int64_t> encode(const std::vector<TensorMeta>& metas) {
  std::vector<int64_t> v;
  for (const auto& m : metas) {
    v.push_back(m.kind);
    v.push_back(m.dtype);
    v.push_back(static_cast<int64_t>(m.sizes.size()));
    v.insert(v.end(), m.sizes.begin(), m.sizes.end());
  }
  return v;
}

std::vector<TensorMeta> decode(const std::vector<int64_t>& v, size_t count) {
  std::vector<TensorMeta> out;
  size_t i = 0;
  for (size_t k = 0; k < count; ++k) {
    TensorMeta m;
    m.kind = v.at(i++);
    m.dtype = v.at(i++);
    const int64_t nd = v.at(i++);
    for (int64_t d = 0; d < nd; ++d) m.sizes.push_back(v.at(i++));
    out.push_back(std::move(m));
  }
  return out;
}

const char* tensor_kind(int64_t kind) { return kind == 0 ? "parameter" : "buffer"; }

// Every rank learns every rank's metadata and looks for the first difference
// from rank 0 (lowest rank, then lowest index), so all ranks throw the same
// error and none is left waiting in a broadcast.
void verify_across_ranks(const std::vector<TensorMeta>& local, int64_t n_params, Communicator& comm) {
  auto counts = comm.all_gather_ints({n_params, static_cast<int64_t>(local.size()) - n_params},
                                     "data_parallel_metadata");
  for (int64_t r = 1; r < comm.world_size(); ++r) {
    for (int k = 0; k < 2; ++k) {
      TORCH_CHECK(counts[r][k] == counts[0][k], "DataParallel(): the module has ", counts[r][k], " ",
                  tensor_kind(k), "s on rank ", r, " but ", counts[0][k], " on rank 0; every rank must wrap the "
                  "same architecture");
    }
  }
  // Same count everywhere; the encodings can still differ in length (ndim),
  // so pad to the longest before the fixed-length exchange.
  std::vector<int64_t> mine = encode(local);
  auto lengths = comm.all_gather_ints({static_cast<int64_t>(mine.size())}, "data_parallel_metadata");
  int64_t longest = 0;
  for (const auto& l : lengths) longest = std::max(longest, l[0]);
  mine.resize(static_cast<size_t>(longest), 0);
  auto all = comm.all_gather_ints(mine, "data_parallel_metadata");
  const auto reference = decode(all[0], local.size());
  for (int64_t r = 1; r < comm.world_size(); ++r) {
    const auto theirs = decode(all[r], local.size());
    for (size_t i = 0; i < local.size(); ++i) {
      // Names are local; print this rank's name for index i (same order is
      // part of "same architecture").
      const auto& name = local[i].name;
      TORCH_CHECK(theirs[i].kind == reference[i].kind, "DataParallel(): tensor ", i, " ('", name, "') is a ",
                  tensor_kind(theirs[i].kind), " on rank ", r, " but a ", tensor_kind(reference[i].kind),
                  " on rank 0");
      TORCH_CHECK(theirs[i].sizes == reference[i].sizes, "DataParallel(): ", tensor_kind(reference[i].kind), " '",
                  name, "' has shape ", c10::IntArrayRef(theirs[i].sizes), " on rank ", r, " but ",
                  c10::IntArrayRef(reference[i].sizes), " on rank 0");
      TORCH_CHECK(theirs[i].dtype == reference[i].dtype, "DataParallel(): ", tensor_kind(reference[i].kind), " '",
                  name, "' has dtype ", static_cast<c10::ScalarType>(theirs[i].dtype), " on rank ", r, " but ",
                  static_cast<c10::ScalarType>(reference[i].dtype), " on rank 0");
    }
  }
}

// One broadcast per (device, dtype) group of flattened tensors instead of one
// per tensor.
void broadcast_from_rank0(const std::vector<torch::Tensor>& tensors, Communicator& comm, const std::string& stat) {
  std::vector<std::vector<torch::Tensor>> groups;
  for (const auto& t : tensors) {
    bool placed = false;
    for (auto& g : groups) {
      if (g.front().scalar_type() == t.scalar_type() && g.front().device() == t.device()) {
        g.push_back(t);
        placed = true;
        break;
      }
    }
    if (!placed) groups.push_back({t});
  }
  torch::NoGradGuard no_grad;
  for (auto& g : groups) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : g) flat_parts.push_back(t.detach().reshape({-1}));
    torch::Tensor flat = torch::cat(flat_parts).contiguous();
    comm.broadcast(flat, 0, stat);
    int64_t off = 0;
    for (auto& t : g) {
      const int64_t n = t.numel();
      t.detach().copy_(flat.narrow(0, off, n).view(t.sizes()));
      off += n;
    }
  }
}

}  // namespace

struct DataParallel::Impl {
  std::unique_ptr<detail::GradientReducer> reducer;
  std::vector<torch::Tensor> buffers;
  int no_sync_depth = 0;
  int64_t syncs = 0;
};

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm,
                           DataParallelOptions options)
    : module_(std::move(module)),
      comm_(comm ? std::move(comm) : Communicator::single()),
      options_(std::move(options)),
      impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(module_ != nullptr, "DataParallel(): argument 'module' is null");
  TORCH_CHECK(options_.bucket_bytes() > 0, "DataParallel(): option 'bucket_bytes' must be positive, but got ",
              options_.bucket_bytes());
  TORCH_CHECK(options_.first_bucket_bytes() > 0,
              "DataParallel(): option 'first_bucket_bytes' must be positive, but got ",
              options_.first_bucket_bytes());

  auto named_params = module_->named_parameters(/*recurse=*/true);
  auto named_buffers = module_->named_buffers(/*recurse=*/true);
  for (const auto& kv : named_buffers) impl_->buffers.push_back(kv.value());
  if (comm_->world_size() == 1) return;  // nothing to agree on, nothing to reduce

  std::vector<TensorMeta> metas;
  std::vector<torch::Tensor> state;
  for (const auto& kv : named_params) {
    metas.push_back({kv.key(), 0, static_cast<int64_t>(kv.value().scalar_type()), kv.value().sizes().vec()});
    state.push_back(kv.value());
  }
  for (const auto& kv : named_buffers) {
    metas.push_back({kv.key(), 1, static_cast<int64_t>(kv.value().scalar_type()), kv.value().sizes().vec()});
    state.push_back(kv.value());
  }
  verify_across_ranks(metas, static_cast<int64_t>(named_params.size()), *comm_);
  if (!state.empty()) broadcast_from_rank0(state, *comm_, "data_parallel_broadcast");

  // DDP hands the reducer only the parameters that require grad.
  std::vector<at::Tensor> params;
  std::unordered_map<size_t, std::string> names;
  for (const auto& kv : named_params) {
    if (!kv.value().requires_grad()) continue;
    names[params.size()] = kv.key();
    params.push_back(kv.value());
  }
  if (params.empty()) return;
  for (const auto& p : params) {
    TORCH_CHECK(p.layout() == c10::kStrided, "DataParallel(): sparse parameters are not supported");
  }

  detail::ReducerOptions ro;
  ro.first_bucket_bytes = options_.first_bucket_bytes();
  ro.bucket_bytes = options_.bucket_bytes();
  ro.find_unused_parameters = options_.find_unused_parameters();
  ro.gradient_as_bucket_view = options_.gradient_as_bucket_view();
  impl_->reducer = std::make_unique<detail::GradientReducer>(*comm_, params, std::move(names), ro);
}

DataParallel::~DataParallel() = default;

bool DataParallel::will_sync() const {
  return impl_->reducer != nullptr && impl_->no_sync_depth == 0 && torch::GradMode::is_enabled();
}

bool DataParallel::in_no_sync() const { return impl_->no_sync_depth > 0; }

bool DataParallel::has_reducer() const { return impl_->reducer != nullptr; }

int64_t DataParallel::num_buckets() const {
  if (!impl_->reducer) return 0;
  return impl_->reducer->num_buckets();
}

int64_t DataParallel::sync_count() const { return impl_->syncs; }

void DataParallel::sync_buffers() {
  if (comm_->world_size() == 1 || !options_.broadcast_buffers() || impl_->buffers.empty()) return;
  broadcast_from_rank0(impl_->buffers, *comm_, "data_parallel_buffers");
}

void DataParallel::prepare_for_backward(const std::vector<torch::Tensor>& outputs) {
  if (!impl_->reducer) return;
  TORCH_CHECK(!options_.find_unused_parameters() || !outputs.empty(),
              "DataParallel::prepare_for_backward(): option 'find_unused_parameters' needs the forward's output "
              "tensors; return a Tensor, a tuple or a vector of tensors from forward(), or pass them here");
  // DDP calls this at the start of each synchronised forward; it re-buckets
  // once, after the first synchronised backward recorded the order in which
  // gradients became ready (a broadcast of the new assignment from rank 0).
  if (impl_->reducer->rebuild_buckets()) comm_->record("reducer_rebuild_buckets", 0, 1);
  impl_->reducer->prepare_for_backward(outputs);
  ++impl_->syncs;
}

DataParallel::NoSyncGuard::NoSyncGuard(DataParallel& dp) : dp_(&dp) { ++dp_->impl_->no_sync_depth; }
DataParallel::NoSyncGuard::~NoSyncGuard() {
  if (dp_) --dp_->impl_->no_sync_depth;
}
DataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept : dp_(other.dp_) { other.dp_ = nullptr; }

}  // namespace contrax
