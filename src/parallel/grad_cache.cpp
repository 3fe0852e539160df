// Gradient cache: the two-pass chunked training step (see grad_cache.h for the
// derivation). The parts that make it exact rather than approximately right:
//   * every chunk's second forward sees the random state its first forward saw
//     (dropout masks identical), and the generators are left where a single
//     pass would have left them, so later steps draw the same numbers;
//   * the loss runs once, on leaves made from the detached representations,
//     so loss-side parameters get their gradient exactly once;
//   * with DataParallel, the reducer is armed once per step, before a final
//     backward that covers the last chunk of every encoder it serves, after
//     all other chunks accumulated locally under no_sync.
#include "contrax/parallel/grad_cache.h"

#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/version.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <utility>

namespace contrax {

// ---- BatchInput

BatchInput::BatchInput(torch::Tensor tensor) : kind_(Kind::kTensor), tensor_(std::move(tensor)) {}
BatchInput::BatchInput(std::vector<torch::Tensor> tensors) : kind_(Kind::kList), list_(std::move(tensors)) {}
BatchInput::BatchInput(std::map<std::string, torch::Tensor> named) : kind_(Kind::kNamed), named_(std::move(named)) {}

BatchInput BatchInput::other(c10::IValue value) {
  BatchInput b;
  b.kind_ = Kind::kOther;
  b.other_ = std::move(value);
  return b;
}

namespace {
const char* input_kind_name(BatchInput::Kind k) {
  switch (k) {
    case BatchInput::Kind::kTensor: return "a tensor";
    case BatchInput::Kind::kList: return "a list";
    case BatchInput::Kind::kNamed: return "named tensors";
    default: return "an IValue";
  }
}
}  // namespace

const torch::Tensor& BatchInput::tensor() const {
  TORCH_CHECK(kind_ == Kind::kTensor, "BatchInput::tensor(): the input is ", input_kind_name(kind_), ", not a tensor");
  return tensor_;
}
const std::vector<torch::Tensor>& BatchInput::list() const {
  TORCH_CHECK(kind_ == Kind::kList, "BatchInput::list(): the input is ", input_kind_name(kind_), ", not a list");
  return list_;
}
const std::map<std::string, torch::Tensor>& BatchInput::named() const {
  TORCH_CHECK(kind_ == Kind::kNamed, "BatchInput::named(): the input is ", input_kind_name(kind_),
              ", not named tensors");
  return named_;
}
const c10::IValue& BatchInput::value() const {
  TORCH_CHECK(kind_ == Kind::kOther, "BatchInput::value(): the input is ", input_kind_name(kind_), ", not an IValue");
  return other_;
}
const torch::Tensor& BatchInput::operator[](size_t i) const {
  if (kind_ == Kind::kTensor && i == 0) return tensor_;
  TORCH_CHECK(kind_ == Kind::kList, "BatchInput[", i, "]: the input is ", input_kind_name(kind_), ", not a list");
  TORCH_CHECK(i < list_.size(), "BatchInput[", i, "]: the list has only ", list_.size(), " tensors");
  return list_[i];
}
const torch::Tensor& BatchInput::operator[](const std::string& name) const {
  TORCH_CHECK(kind_ == Kind::kNamed, "BatchInput[\"", name, "\"]: the input is ", input_kind_name(kind_),
              ", not named tensors");
  auto it = named_.find(name);
  if (it == named_.end()) {
    std::string keys;
    for (const auto& kv : named_) keys += (keys.empty() ? "'" : ", '") + kv.first + "'";
    TORCH_CHECK(false, "BatchInput[\"", name, "\"]: no input named '", name, "'; the inputs are ", keys);
  }
  return it->second;
}

std::vector<torch::Tensor> BatchInput::tensors() const {
  switch (kind_) {
    case Kind::kTensor: return {tensor_};
    case Kind::kList: return list_;
    case Kind::kNamed: {
      std::vector<torch::Tensor> out;
      for (const auto& kv : named_) out.push_back(kv.second);
      return out;
    }
    default: {
      std::vector<torch::Tensor> out;
      detail::collect_tensors(other_, out);
      return out;
    }
  }
}

int64_t BatchInput::rows() const {
  if (kind_ == Kind::kOther) return -1;
  int64_t n = -1;
  std::string first;
  auto visit = [&](const torch::Tensor& t, const std::string& what) {
    TORCH_CHECK(t.defined(), "BatchInput: ", what, " is undefined");
    TORCH_CHECK(t.dim() >= 1, "BatchInput: ", what, " must have a batch dimension (dim 0), but is 0-dim");
    if (n < 0) {
      n = t.size(0);
      first = what;
    } else {
      TORCH_CHECK(t.size(0) == n, "BatchInput: ", what, " has ", t.size(0), " rows but ", first, " has ", n,
                  "; all tensors of an input are split along dim 0 together");
    }
  };
  if (kind_ == Kind::kTensor) visit(tensor_, "the tensor");
  for (size_t i = 0; i < list_.size(); ++i) visit(list_[i], c10::str("tensor ", i));
  for (const auto& kv : named_) visit(kv.second, c10::str("input '", kv.first, "'"));
  TORCH_CHECK(n >= 0, "BatchInput: the input holds no tensor");
  return n;
}

BatchInput BatchInput::narrow(int64_t start, int64_t length) const {
  switch (kind_) {
    case Kind::kTensor: return BatchInput(tensor_.narrow(0, start, length));
    case Kind::kList: {
      std::vector<torch::Tensor> out;
      for (const auto& t : list_) out.push_back(t.narrow(0, start, length));
      return BatchInput(std::move(out));
    }
    case Kind::kNamed: {
      std::map<std::string, torch::Tensor> out;
      for (const auto& kv : named_) out.emplace(kv.first, kv.second.narrow(0, start, length));
      return BatchInput(std::move(out));
    }
    default:
      TORCH_CHECK(false, "BatchInput::narrow(): an IValue input cannot be split along dim 0; give the encoder a "
                  "split function");
  }
}

// ---- GradCacheEncoder

GradCacheEncoder::GradCacheEncoder(EncoderFn forward, int64_t chunk_size, std::nullptr_t)
    : chunk_size_(chunk_size), forward_(std::move(forward)) {
  TORCH_CHECK(forward_ != nullptr, "GradCacheEncoder(): argument 'forward' is empty");
}

// ---- GradCache

namespace detail {

void no_module_forward(const char* kind) {
  TORCH_CHECK(false, "GradCacheEncoder: the module has no forward() for this input: ", kind,
              "; wrap the module in an encoder callable instead");
}

// The random state a chunk's first forward started from. Not in the anonymous
// namespace: GradCache::Chunk, which has external linkage, holds one.
struct RngState {
  torch::Tensor cpu;
  std::vector<std::pair<c10::Device, torch::Tensor>> cuda;
};

// `seen`: the devices of a chunk's inputs and of its encoder's parameters
// (CPU inputs may move to the model's device inside the encoder); the current
// CUDA device is where a device-less randn or a dropout on a fresh tensor
// draws. Pure, so the CPU tests check it.
std::vector<c10::Device> rng_cuda_devices(const std::vector<c10::Device>& seen,
                                          c10::optional<c10::Device> current_cuda) {
  std::vector<c10::Device> out;
  auto add = [&](const c10::Device& d) {
    if (d.is_cuda() && std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const auto& d : seen) add(d);
  if (current_cuda) add(*current_cuda);
  return out;
}

}  // namespace detail

using detail::RngState;

namespace {

torch::Tensor get_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

c10::optional<c10::Device> current_cuda_device() {
  if (!at::globalContext().hasCUDA()) return c10::nullopt;  // no CUDA build, or no device
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
}

std::vector<c10::Device> devices_of(const BatchInput& input, const GradCacheEncoder* enc) {
  std::vector<c10::Device> d;
  for (const auto& t : input.tensors()) {
    if (t.defined()) d.push_back(t.device());
  }
  if (enc != nullptr && enc->module()) {
    for (const auto& p : enc->module()->parameters()) d.push_back(p.device());
  }
  return d;
}

// The default CPU generator always, and the CUDA generators above (what
// torch.utils.checkpoint saves). Goes through the ATen context's hooks, so
// this compiles and runs without CUDA.
RngState capture_rng(const std::vector<c10::Device>& devices) {
  RngState s;
  s.cpu = get_state(at::detail::getDefaultCPUGenerator());
  for (const auto& d : detail::rng_cuda_devices(devices, current_cuda_device())) {
    s.cuda.emplace_back(d, get_state(at::globalContext().defaultGenerator(d)));
  }
  return s;
}

void restore_rng(const RngState& s) {
  if (s.cpu.defined()) set_state(at::detail::getDefaultCPUGenerator(), s.cpu);
  for (const auto& kv : s.cuda) set_state(at::globalContext().defaultGenerator(kv.first), kv.second);
}

// The device type whose autocast the encoders run under: the encoder's
// parameters' (CUDA for a model on the GPU even with CPU inputs), else its
// inputs', else the CPU.
c10::DeviceType autocast_device_type(const std::vector<c10::Device>& devices) {
  for (const auto& d : devices) {
    if (d.is_cuda()) return c10::DeviceType::CUDA;
  }
  return c10::DeviceType::CPU;
}

// Autocast to bfloat16 on one device type for an encoder's forward,
// restoring the caller's autocast state afterwards (as torch.autocast's
// __exit__ does). Autocast's state is per device type.
class Bf16Autocast {
 public:
  Bf16Autocast(bool on, c10::DeviceType type) : on_(on), type_(type) {
    if (!on_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(type_);
    prev_dtype_ = at::autocast::get_autocast_dtype(type_);
    at::autocast::set_autocast_enabled(type_, true);
    at::autocast::set_autocast_dtype(type_, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~Bf16Autocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, prev_enabled_);
    at::autocast::set_autocast_dtype(type_, prev_dtype_);
  }
  C10_DISABLE_COPY_AND_ASSIGN(Bf16Autocast);

 private:
  bool on_;
  c10::DeviceType type_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

// Every DataParallel that takes part, once; the gradients it averages are
// final only after the last backward that reaches its module.
std::vector<DataParallel*> data_parallels_of(const std::vector<GradCacheEncoder>& encoders) {
  std::vector<DataParallel*> dps;
  for (const auto& enc : encoders) {
    DataParallel* dp = enc.data_parallel().get();
    if (dp && std::find(dps.begin(), dps.end(), dp) == dps.end()) dps.push_back(dp);
  }
  return dps;
}

void check_loss(const torch::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "GradCache: the loss must be a single value, but got shape ",
              loss.defined() ? c10::str(loss.sizes()) : std::string("(undefined)"));
  TORCH_CHECK(loss.requires_grad(), "GradCache: the loss does not depend on any representation (it does not "
              "require grad)");
}

// The one armed backward of a step: the last chunks of the synchronising
// encoders (`final_encoders`, their representations `roots`), each
// DataParallel with a reducer told which of them reach its module.
void armed_backward(const std::vector<GradCacheEncoder>& encoders, const std::vector<DataParallel*>& dps,
                    const std::vector<size_t>& final_encoders, const std::vector<torch::Tensor>& roots,
                    const std::vector<torch::Tensor>& root_grads) {
  for (DataParallel* dp : dps) {
    if (!dp->has_reducer()) continue;
    std::vector<torch::Tensor> outputs;
    for (size_t k = 0; k < final_encoders.size(); ++k) {
      if (encoders[final_encoders[k]].data_parallel().get() == dp) outputs.push_back(roots[k]);
    }
    dp->prepare_for_backward(outputs);
  }
  torch::autograd::backward(roots, root_grads);
}

std::string encoder_label(const GradCacheEncoder& enc, size_t e) {
  return enc.name().empty() ? c10::str("encoder ", e) : c10::str("encoder '", enc.name(), "'");
}

torch::Tensor representation(const GradCacheEncoder& enc, size_t e, const c10::IValue& out) {
  if (enc.get_rep()) {
    torch::Tensor rep = enc.get_rep()(out);
    TORCH_CHECK(rep.defined(), "GradCache: the representation getter of ", encoder_label(enc, e),
                " returned an undefined tensor");
    return rep;
  }
  TORCH_CHECK(out.isTensor(), "GradCache: ", encoder_label(enc, e), " returned ", out.tagKind(),
              ", not a tensor; set GradCacheEncoder::get_rep to pick the representation out of it");
  return out.toTensor();
}

}  // namespace

struct GradCache::Chunk {
  BatchInput input;
  RngState rng;
  torch::Tensor rep;             // [n, d], detached; released once copied into the loss leaf
  std::vector<int64_t> shape;    // rep's shape, checked in pass 2
};

struct GradCache::Impl {
  std::vector<std::vector<Chunk>> chunks;  // per encoder

  // Per encoder, a leaf holding the pass-1 representations of all its chunks
  // (the chunks' own copies released: the leaf holds the only one).
  std::vector<torch::Tensor> take_leaves() {
    std::vector<torch::Tensor> leaves;
    for (auto& enc_chunks : chunks) {
      std::vector<torch::Tensor> parts;
      for (auto& c : enc_chunks) parts.push_back(std::exchange(c.rep, torch::Tensor()));
      torch::Tensor all = parts.size() == 1 ? parts[0] : torch::cat(parts);
      parts.clear();
      leaves.push_back(all.detach().requires_grad_(true));
    }
    return leaves;
  }

  // Per encoder and chunk, its rows of the leaf's gradient. A representation
  // the loss ignores gets zero gradient (its encoder still runs pass 2 so that
  // a DataParallel sees every parameter).
  std::vector<std::vector<torch::Tensor>> chunk_grads(const std::vector<torch::Tensor>& leaves) const {
    std::vector<std::vector<torch::Tensor>> grads(chunks.size());
    for (size_t e = 0; e < chunks.size(); ++e) {
      torch::Tensor g = leaves[e].grad().defined() ? leaves[e].grad() : torch::zeros_like(leaves[e]);
      int64_t off = 0;
      for (const auto& c : chunks[e]) {
        grads[e].push_back(g.narrow(0, off, c.shape.at(0)));
        off += c.shape.at(0);
      }
    }
    return grads;
  }

  // The random state of every device the chunks ran on.
  RngState capture(const std::vector<GradCacheEncoder>& encoders) const {
    std::vector<c10::Device> devices;
    for (size_t e = 0; e < chunks.size(); ++e) {
      for (const auto& c : chunks[e]) {
        const auto d = devices_of(c.input, &encoders[e]);
        devices.insert(devices.end(), d.begin(), d.end());
      }
    }
    return capture_rng(devices);
  }
  // The loss, once, on leaves holding the pass-1 representations; its value,
  // and in `grads` its gradient per encoder and chunk.
  torch::Tensor loss_and_grads(const RepresentationLossFn& loss_fn, const GradCacheOptions& options,
                               std::vector<std::vector<torch::Tensor>>& grads) {
    std::vector<torch::Tensor> leaves = take_leaves();
    torch::AutoGradMode enable_grad(true);
    if (options.loss_data_parallel() && options.loss_data_parallel()->will_sync()) {
      options.loss_data_parallel()->prepare_for_backward({});
    }
    torch::Tensor loss = loss_fn(leaves);
    check_loss(loss);
    torch::Tensor to_backward = options.scale_loss() ? options.scale_loss()(loss) : loss;
    to_backward.reshape({}).backward();
    grads = chunk_grads(leaves);
    return loss.detach().reshape({});
  }
};

GradCache::GradCache(std::vector<GradCacheEncoder> encoders, RepresentationLossFn loss, GradCacheOptions options)
    : encoders_(std::move(encoders)), loss_(std::move(loss)), options_(std::move(options)),
      impl_(std::make_shared<Impl>()) {
  TORCH_CHECK(!encoders_.empty(), "GradCache(): argument 'encoders' is empty");
  TORCH_CHECK(loss_ != nullptr, "GradCache(): argument 'loss' is empty");
  for (size_t e = 0; e < encoders_.size(); ++e) {
    const auto& enc = encoders_[e];
    TORCH_CHECK(enc.chunk_size() > 0, "GradCache(): encoder ", e,
                enc.name().empty() ? "" : c10::str(" ('", enc.name(), "')"), " has chunk_size ", enc.chunk_size(),
                "; it must be positive");
    if (!enc.name().empty()) {
      for (size_t f = 0; f < e; ++f) {
        TORCH_CHECK(encoders_[f].name() != enc.name(), "GradCache(): encoders ", f, " and ", e,
                    " are both named '", enc.name(), "'");
      }
    }
  }
  impl_->chunks.resize(encoders_.size());
}

torch::Tensor GradCache::cache(size_t e, const BatchInput& input) {
  TORCH_CHECK(e < encoders_.size(), "GradCache::cache(): encoder index ", e, " out of range; there are ",
              encoders_.size(), " encoders");
  const auto& chunks = impl_->chunks[e];
  const size_t added = run_pass1(e, input);
  std::vector<torch::Tensor> reps;
  for (size_t i = chunks.size() - added; i < chunks.size(); ++i) reps.push_back(chunks[i].rep);
  return reps.size() == 1 ? reps[0] : torch::cat(reps);
}

size_t GradCache::run_pass1(size_t e, const BatchInput& input) {
  const auto& enc = encoders_[e];
  std::vector<BatchInput> pieces;
  if (enc.split()) {
    pieces = enc.split()(input, enc.chunk_size());
  } else {
    TORCH_CHECK(input.kind() != BatchInput::Kind::kOther, "GradCache::cache(): ", encoder_label(enc, e),
                " got an IValue input, which cannot be split along dim 0; give the encoder a split function");
    const int64_t n = input.rows();
    for (int64_t start = 0; start < n; start += enc.chunk_size()) {
      pieces.push_back(input.narrow(start, std::min(enc.chunk_size(), n - start)));
    }
  }
  // No rows (a rank's share of a short last batch): still one 0-row chunk.
  // Its [0, d] representation takes this rank through the loss's
  // collectives, and its pass 2 gives every parameter a (zero) gradient, so
  // the reducer joins the all-reduces the other ranks start.
  if (pieces.empty()) pieces.push_back(input);
  for (auto& piece : pieces) {
    Chunk chunk;
    chunk.input = std::move(piece);
    const auto devices = devices_of(chunk.input, &enc);
    if (options_.replay_rng()) chunk.rng = capture_rng(devices);
    {
      torch::NoGradGuard no_grad;
      Bf16Autocast autocast(options_.bf16_autocast(), autocast_device_type(devices));
      chunk.rep = representation(enc, e, enc.forward()(chunk.input)).detach();
    }
    TORCH_CHECK(chunk.rep.dim() >= 1, "GradCache: the representation of ", encoder_label(enc, e),
                " must have the batch along dim 0, but is 0-dim");
    chunk.shape = chunk.rep.sizes().vec();
    impl_->chunks[e].push_back(std::move(chunk));
  }
  return pieces.size();
}

torch::Tensor GradCache::cache(const std::string& name, const BatchInput& input) {
  for (size_t e = 0; e < encoders_.size(); ++e) {
    if (encoders_[e].name() == name) return cache(e, input);
  }
  std::string names;
  for (const auto& enc : encoders_) {
    if (!enc.name().empty()) names += (names.empty() ? "'" : ", '") + enc.name() + "'";
  }
  TORCH_CHECK(false, "GradCache::cache(): no encoder named '", name, "'; the named encoders are ",
              names.empty() ? std::string("(none)") : names);
}

int64_t GradCache::cached_rows(size_t e) const {
  TORCH_CHECK(e < encoders_.size(), "GradCache::cached_rows(): encoder index ", e, " out of range");
  int64_t n = 0;
  for (const auto& c : impl_->chunks[e]) n += c.shape.at(0);
  return n;
}

void GradCache::clear() {
  for (auto& v : impl_->chunks) v.clear();
}

torch::Tensor GradCache::step(const std::vector<BatchInput>& inputs) {
  TORCH_CHECK(inputs.size() == encoders_.size(), "GradCache::step(): got ", inputs.size(),
              " inputs for ", encoders_.size(), " encoders");
  clear();
  try {
    // Not cache(): nobody looks at its concatenated rows here.
    for (size_t e = 0; e < encoders_.size(); ++e) run_pass1(e, inputs[e]);
  } catch (...) {
    clear();
    throw;
  }
  return finish();
}

torch::Tensor GradCache::finish() { return finish(loss_); }

torch::Tensor GradCache::finish(const RepresentationLossFn& loss_fn) {
  TORCH_CHECK(loss_fn != nullptr, "GradCache::finish(): argument 'loss' is empty");
  // Whatever happens below, the cache is consumed: a failed step must not
  // leak its chunks into the next one.
  struct ClearOnExit {
    GradCache* gc;
    ~ClearOnExit() { gc->clear(); }
  } clear_on_exit{this};
  const size_t n_enc = encoders_.size();
  for (size_t e = 0; e < n_enc; ++e) {
    TORCH_CHECK(!impl_->chunks[e].empty(), "GradCache::finish(): nothing cached for ", encoder_label(encoders_[e], e),
                "; call cache() for every encoder before finish(), with 0 rows on a rank that has none");
  }
  const auto dps = data_parallels_of(encoders_);
  for (DataParallel* dp : dps) dp->sync_buffers();

  std::vector<std::vector<torch::Tensor>> grads;  // per encoder, per chunk
  torch::Tensor loss_value = impl_->loss_and_grads(loss_fn, options_, grads);

  // Where the random state would be had each chunk run once: restored at the
  // end so that the steps after this one draw what they would have drawn.
  RngState after;
  if (options_.replay_rng()) after = impl_->capture(encoders_);

  // ---- pass 2.
  torch::AutoGradMode enable_grad(true);
  auto rerun = [&](size_t e, const Chunk& c) {
    if (options_.replay_rng()) restore_rng(c.rng);
    Bf16Autocast autocast(options_.bf16_autocast(), autocast_device_type(devices_of(c.input, &encoders_[e])));
    torch::Tensor rep = representation(encoders_[e], e, encoders_[e].forward()(c.input));
    TORCH_CHECK(rep.sizes() == c.shape, "GradCache: ", encoder_label(encoders_[e], e),
                " gave a representation of shape ", rep.sizes(), " in the second pass but ", c10::IntArrayRef(c.shape),
                " in the first; the encoder must be deterministic given its input and random state");
    return rep;
  };
  // Chunks whose backward is synchronised at the end: the last chunk of each
  // encoder with a DataParallel that synchronises. Exactly one armed backward
  // per step and reducer, whatever the number of chunks, so ranks with
  // different row counts (hence chunk counts) still issue the same
  // collectives; synchronising per chunk would hang them.
  auto syncs = [&](size_t e) {
    DataParallel* dp = encoders_[e].data_parallel().get();
    return dp != nullptr && dp->has_reducer();
  };
  {
    // Users' encoder callables may call dp->forward(); no_sync keeps them
    // from arming the reducer behind our back.
    std::vector<DataParallel::NoSyncGuard> guards;
    for (DataParallel* dp : dps) guards.push_back(dp->no_sync());
    for (size_t e = 0; e < n_enc; ++e) {
      const auto& chunks = impl_->chunks[e];
      const size_t local_until = syncs(e) ? chunks.size() - 1 : chunks.size();
      for (size_t i = 0; i < local_until; ++i) {
        torch::Tensor rep = rerun(e, chunks[i]);
        torch::autograd::backward({rep}, {grads[e][i]});
      }
    }
    // The final backward: last chunks of all synchronising encoders together,
    // so that a DataParallel shared by several encoders (tied towers, or one
    // wrapper around both) sees all its parameters in one armed backward.
    std::vector<torch::Tensor> roots, root_grads;
    std::vector<size_t> final_encoders;
    for (size_t e = 0; e < n_enc; ++e) {
      if (!syncs(e)) continue;
      roots.push_back(rerun(e, impl_->chunks[e].back()));
      root_grads.push_back(grads[e].back());
      final_encoders.push_back(e);
    }
    if (!roots.empty()) armed_backward(encoders_, dps, final_encoders, roots, root_grads);
  }
  if (options_.replay_rng()) restore_rng(after);
  return loss_value;
}

}  // namespace contrax
