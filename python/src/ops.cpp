// Contrax's losses, the gather with gradient and GradCache's gradient
// injection as PyTorch operators (namespace `contrax`, TORCH_LIBRARY), so that
// torch.compile(fullgraph=True) traces a training step through them instead
// of breaking the graph at an opaque pybind call.
//
// Each loss is two operators: `contrax::<loss>` computes the value and
// `contrax::<loss>_backward` the gradients. Their schemas (derived from the
// table of each loss's parameters, contrax/_signatures.py, whose order the
// kernels below follow), fake (meta) kernels and the autograd formula that
// joins them are registered from Python (contrax/_ops.py:
// torch.library's define, register_fake and register_autograd), where
// the shapes are plain: a loss is 0-dim (or [b] with reduction "none"), its
// gradients have the shapes of its inputs, and a gather's row count is an
// unbacked size. Neither kernel ever sees a fake tensor, and neither passes
// anything to the other but real inputs: the backward does not depend on
// buffers saved by a forward that may have run on fake tensors.
//
// The backward recomputes. For a loss L(x_1, ..., x_n) computed by one of the
// library's autograd functions F (clip_loss, ...), the vector-Jacobian product
// with the upstream gradient g (0-dim, or [b] for "none") is
//   dL/dx_i^T g = VJP_F(x; g)_i,
// which is exactly what F's own backward computes when F's output is
// backpropagated with g: F's backward already holds the derivation (e.g. the
// CLIP engine's G_r = (W/B)/2 [softmax_rows(S) - I + exp(S - lse_col) - I],
// dA = s G B_all, dB = reduce_scatter(s G^T A)), with its collectives, and
// with each rank's own g where ranks weigh their losses differently. So the
// backward operator runs F's forward again on leaves holding the saved
// inputs and F's backward with g, and returns the leaves' gradients: the
// values are bit-identical to eager mode's F (the same code on the same
// inputs; the forward is deterministic), at the cost of a second forward of
// the loss (its logits, not the encoders).
//
// Process groups travel as names (c10d's group names, as in
// torch.distributed's functional collectives): the Python layer registers
// each group's cached communicator here under its name before the first
// call; "" is a world of 1.
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "contrax/comm/collectives.h"
#include "contrax/comm/communicator.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/siglip.h"

namespace py = pybind11;

namespace {

// ---- process groups by name ---------------------------------------------------

struct GroupRegistry {
  std::mutex mutex;
  // Weak: the binding's communicator cache owns them (and frees a destroyed
  // group's communicator without the GIL); an operator called after that
  // finds the name expired.
  std::map<std::string, std::weak_ptr<contrax::Communicator>> by_name;
};
GroupRegistry& registry() {
  static auto* r = new GroupRegistry();  // never destroyed: no c10d teardown at exit
  return *r;
}

void register_group(const std::string& name, const contrax::CommunicatorPtr& comm) {
  TORCH_CHECK(!name.empty(), "contrax: a process group needs a non-empty name");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.by_name[name] = comm;
}

contrax::CommunicatorPtr group_named(const std::string& name, const char* op) {
  if (name.empty()) return nullptr;  // world 1: the single-device loss
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_name.find(name);
  contrax::CommunicatorPtr comm = it == r.by_name.end() ? nullptr : it->second.lock();
  TORCH_CHECK(comm, "contrax::", op, "(): argument 'group': process group '", name,
              "' is not registered with contrax (call the loss through contrax's Python functions, which register "
              "it), or it has been destroyed");
  return comm;
}

// ---- option words ---------------------------------------------------------------

template <typename E>
E word(const std::string& s, std::initializer_list<std::pair<const char*, E>> words, const char* op,
       const char* arg) {
  std::string known;
  for (const auto& w : words) {
    if (s == w.first) return w.second;
    known += (known.empty() ? "'" : ", '") + std::string(w.first) + "'";
  }
  TORCH_CHECK(false, "contrax::", op, "(): argument '", arg, "' must be one of ", known, ", but got '", s, "'");
}

contrax::Reduction reduction_word(const std::string& s, const char* op) {
  return word<contrax::Reduction>(
      s, {{"mean", contrax::Reduction::kMean}, {"sum", contrax::Reduction::kSum}, {"none", contrax::Reduction::kNone}},
      op, "reduction");
}

contrax::MemoryPath path_word(const std::string& s, const char* op) {
  return word<contrax::MemoryPath>(s,
                                   {{"auto", contrax::MemoryPath::kAuto},
                                    {"materialised", contrax::MemoryPath::kMaterialised},
                                    {"materialized", contrax::MemoryPath::kMaterialised},
                                    {"tiled", contrax::MemoryPath::kTiled}},
                                   op, "path");
}

contrax::LabelMode label_mode_word(const std::string& s, const char* op) {
  return word<contrax::LabelMode>(
      s, {{"multi_positive", contrax::LabelMode::kMultiPositive}, {"mask_duplicates", contrax::LabelMode::kMaskDuplicates}},
      op, "label_mode");
}

// ---- value and backward of any loss ----------------------------------------------

using Inputs = std::vector<torch::Tensor>;
// The loss as a function of its tensor inputs (the first `n_grad` of which
// are differentiable; an absent optional input is an undefined tensor).
using LossOf = std::function<torch::Tensor(const Inputs&)>;

torch::Tensor loss_value(const LossOf& loss, const Inputs& inputs) {
  torch::NoGradGuard no_grad;
  return loss(inputs);
}

// Inside an operator's kernel the dispatcher has already passed the autograd
// keys (and excluded them for everything the kernel calls): the backward
// re-enables recording for its own calls, so that the library's autograd
// function records its graph on the leaves and its backward can run.
class RecordAutograd {
 public:
  RecordAutograd()
      : keys_(c10::impl::tls_local_dispatch_key_set().included_,
              c10::impl::tls_local_dispatch_key_set().excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView) {}

 private:
  c10::impl::ForceDispatchKeyGuard keys_;
  torch::AutoGradMode grad_{true};
};

// The gradients of the first `n_grad` inputs (zeros for an input the loss
// does not reach; a 0-dim zero for an absent optional one). See the file
// comment for why recomputing gives the exact vector-Jacobian product.
std::vector<torch::Tensor> loss_backward(const torch::Tensor& grad, const LossOf& loss, const Inputs& inputs,
                                         size_t n_grad) {
  RecordAutograd record;
  Inputs leaves;
  std::vector<torch::Tensor> wrt;
  std::vector<int64_t> slot(inputs.size(), -1);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      leaves.push_back(inputs[i]);
      continue;
    }
    auto leaf = inputs[i].detach();
    if (i < n_grad) {
      leaf.requires_grad_(true);
      slot[i] = static_cast<int64_t>(wrt.size());
      wrt.push_back(leaf);
    }
    leaves.push_back(leaf);
  }
  auto out = loss(leaves);
  auto grads = torch::autograd::grad({out}, wrt, {grad.to(out.dtype())}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
  std::vector<torch::Tensor> result;
  for (size_t i = 0; i < n_grad; ++i) {
    if (slot[i] < 0) {
      result.push_back(torch::zeros({}, grad.options()));
    } else {
      auto g = grads[slot[i]];
      result.push_back(g.defined() ? g : torch::zeros_like(inputs[i]));
    }
  }
  return result;
}

c10::optional<torch::Tensor> optional_of(const torch::Tensor& t) {
  return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}
torch::Tensor tensor_of(const c10::optional<torch::Tensor>& t) { return t.has_value() ? *t : torch::Tensor(); }

// ---- the losses -------------------------------------------------------------------

// The memory path and the process group, which every loss takes as its
// schema's last four arguments.
struct MemoryArgs {
  std::string path;
  int64_t tile_size;
  bool ring;
  std::string group;

  // Sets o's nested memory options and communicator; `op` names the caller.
  template <typename Options>
  Options& place(Options& o, const char* op) const {
    return o.memory(contrax::MemoryPathOptions().path(path_word(path, op)).tile_size(tile_size).ring(ring))
        .comm(group_named(group, op));
  }
};

struct ClipArgs {
  bool symmetric;
  double max_logit_scale;
  bool normalize;
  std::string label_mode, reduction;
  MemoryArgs memory;

  // inputs: a, b, logit_scale, logit_bias, labels
  LossOf loss(const char* op) const {
    auto o = contrax::ClipLossOptions()
                 .symmetric(symmetric)
                 .max_logit_scale(max_logit_scale)
                 .normalize(normalize)
                 .label_mode(label_mode_word(label_mode, op))
                 .reduction(reduction_word(reduction, op));
    memory.place(o, op);
    return [o](const Inputs& in) mutable {
      if (in[4].defined()) o.labels(in[4]);
      return contrax::clip_loss(in[0], in[1], in[2], optional_of(in[3]), o);
    };
  }
};

torch::Tensor clip_loss_op(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                           const c10::optional<torch::Tensor>& logit_bias, bool symmetric, double max_logit_scale,
                           bool normalize, const c10::optional<torch::Tensor>& labels, std::string label_mode,
                           std::string reduction, std::string path, int64_t tile_size, bool ring, std::string group) {
  ClipArgs args{symmetric, max_logit_scale, normalize, label_mode, reduction, {path, tile_size, ring, group}};
  return loss_value(args.loss("clip_loss"), {a, b, logit_scale, tensor_of(logit_bias), tensor_of(labels)});
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> clip_loss_backward_op(
    const torch::Tensor& grad, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
    const c10::optional<torch::Tensor>& logit_bias, bool symmetric, double max_logit_scale, bool normalize,
    const c10::optional<torch::Tensor>& labels, std::string label_mode, std::string reduction, std::string path,
    int64_t tile_size, bool ring, std::string group) {
  ClipArgs args{symmetric, max_logit_scale, normalize, label_mode, reduction, {path, tile_size, ring, group}};
  auto g = loss_backward(grad, args.loss("clip_loss_backward"),
                         {a, b, logit_scale, tensor_of(logit_bias), tensor_of(labels)}, 4);
  return {g[0], g[1], g[2], g[3]};
}

struct GroupedArgs {
  std::string label_mode, reduction;
  double max_logit_scale;
  bool normalize;
  MemoryArgs memory;

  // inputs: queries, candidates, logit_scale, logit_bias, labels, candidate_labels
  LossOf loss(const char* op) const {
    auto o = contrax::GroupedLossOptions()
                 .label_mode(label_mode_word(label_mode, op))
                 .reduction(reduction_word(reduction, op))
                 .max_logit_scale(max_logit_scale)
                 .normalize(normalize);
    memory.place(o, op);
    return [o](const Inputs& in) mutable {
      if (in[4].defined()) o.labels(in[4]);
      if (in[5].defined()) o.candidate_labels(in[5]);
      return contrax::grouped_loss(in[0], in[1], in[2], optional_of(in[3]), o);
    };
  }
};

torch::Tensor grouped_loss_op(const torch::Tensor& queries, const torch::Tensor& candidates,
                              const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                              const c10::optional<torch::Tensor>& labels,
                              const c10::optional<torch::Tensor>& candidate_labels, std::string label_mode,
                              std::string reduction, double max_logit_scale, bool normalize, std::string path,
                              int64_t tile_size, bool ring, std::string group) {
  GroupedArgs args{label_mode, reduction, max_logit_scale, normalize, {path, tile_size, ring, group}};
  return loss_value(args.loss("grouped_loss"), {queries, candidates, logit_scale, tensor_of(logit_bias),
                                                tensor_of(labels), tensor_of(candidate_labels)});
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> grouped_loss_backward_op(
    const torch::Tensor& grad, const torch::Tensor& queries, const torch::Tensor& candidates,
    const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
    const c10::optional<torch::Tensor>& labels, const c10::optional<torch::Tensor>& candidate_labels,
    std::string label_mode, std::string reduction, double max_logit_scale, bool normalize, std::string path,
    int64_t tile_size, bool ring, std::string group) {
  GroupedArgs args{label_mode, reduction, max_logit_scale, normalize, {path, tile_size, ring, group}};
  auto g = loss_backward(grad, args.loss("grouped_loss_backward"),
                         {queries, candidates, logit_scale, tensor_of(logit_bias), tensor_of(labels),
                          tensor_of(candidate_labels)},
                         4);
  return {g[0], g[1], g[2], g[3]};
}

// The options NT-Xent and MoCo v3 share (their option structs have the same
// setters for them).
struct TemperatureArgs {
  double temperature;
  bool normalize;
  std::string reduction;
  MemoryArgs memory;

  template <typename Options>
  Options options(const char* op) const {
    auto o = Options().temperature(temperature).normalize(normalize).reduction(reduction_word(reduction, op));
    memory.place(o, op);
    return o;
  }
};

// inputs: z1, z2
LossOf nt_xent_of(const TemperatureArgs& args, const char* op) {
  auto o = args.options<contrax::NTXentLossOptions>(op);
  return [o](const Inputs& in) { return contrax::nt_xent_loss(in[0], in[1], o); };
}

torch::Tensor nt_xent_loss_op(const torch::Tensor& z1, const torch::Tensor& z2, double temperature, bool normalize,
                              std::string reduction, std::string path, int64_t tile_size, bool ring,
                              std::string group) {
  TemperatureArgs args{temperature, normalize, reduction, {path, tile_size, ring, group}};
  return loss_value(nt_xent_of(args, "nt_xent_loss"), {z1, z2});
}

std::tuple<torch::Tensor, torch::Tensor> nt_xent_loss_backward_op(const torch::Tensor& grad, const torch::Tensor& z1,
                                                                  const torch::Tensor& z2, double temperature,
                                                                  bool normalize, std::string reduction,
                                                                  std::string path, int64_t tile_size, bool ring,
                                                                  std::string group) {
  TemperatureArgs args{temperature, normalize, reduction, {path, tile_size, ring, group}};
  auto g = loss_backward(grad, nt_xent_of(args, "nt_xent_loss_backward"), {z1, z2}, 2);
  return {g[0], g[1]};
}

// inputs: q1, q2, k1, k2 (the keys are constants: no gradient)
LossOf moco_v3_of(const TemperatureArgs& args, const char* op) {
  auto o = args.options<contrax::MocoV3LossOptions>(op);
  return [o](const Inputs& in) { return contrax::moco_v3_loss(in[0], in[1], in[2], in[3], o); };
}

torch::Tensor moco_v3_loss_op(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                              const torch::Tensor& k2, double temperature, bool normalize, std::string reduction,
                              std::string path, int64_t tile_size, bool ring, std::string group) {
  TemperatureArgs args{temperature, normalize, reduction, {path, tile_size, ring, group}};
  return loss_value(moco_v3_of(args, "moco_v3_loss"), {q1, q2, k1, k2});
}

std::tuple<torch::Tensor, torch::Tensor> moco_v3_loss_backward_op(
    const torch::Tensor& grad, const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
    const torch::Tensor& k2, double temperature, bool normalize, std::string reduction, std::string path,
    int64_t tile_size, bool ring, std::string group) {
  TemperatureArgs args{temperature, normalize, reduction, {path, tile_size, ring, group}};
  auto g = loss_backward(grad, moco_v3_of(args, "moco_v3_loss_backward"), {q1, q2, k1, k2}, 2);
  return {g[0], g[1]};
}

struct SigLipArgs {
  double max_logit_scale;
  bool normalize;
  MemoryArgs memory;

  // inputs: a, b, logit_scale, logit_bias
  LossOf loss(const char* op) const {
    auto o = contrax::SigLipLossOptions().max_logit_scale(max_logit_scale).normalize(normalize);
    memory.place(o, op);
    return [o](const Inputs& in) { return contrax::siglip_loss(in[0], in[1], in[2], optional_of(in[3]), o); };
  }
};

torch::Tensor siglip_loss_op(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                             const c10::optional<torch::Tensor>& logit_bias, double max_logit_scale, bool normalize,
                             std::string path, int64_t tile_size, bool ring, std::string group) {
  SigLipArgs args{max_logit_scale, normalize, {path, tile_size, ring, group}};
  return loss_value(args.loss("siglip_loss"), {a, b, logit_scale, tensor_of(logit_bias)});
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> siglip_loss_backward_op(
    const torch::Tensor& grad, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
    const c10::optional<torch::Tensor>& logit_bias, double max_logit_scale, bool normalize, std::string path,
    int64_t tile_size, bool ring, std::string group) {
  SigLipArgs args{max_logit_scale, normalize, {path, tile_size, ring, group}};
  auto g = loss_backward(grad, args.loss("siglip_loss_backward"), {a, b, logit_scale, tensor_of(logit_bias)}, 4);
  return {g[0], g[1], g[2], g[3]};
}

// ---- gather with gradient ---------------------------------------------------------

// Forward: the rows of every rank in rank order, and the per-rank row counts
// (int64 [W]) that the backward needs to cut its gradient. `equal_rows`
// promises W * b_r rows (a shape the compiler knows: no unbacked size, so no
// graph break where capture_dynamic_output_shape_ops is off); a rank whose
// count differs fails on every rank, naming the switch that lifts the promise.
std::tuple<torch::Tensor, torch::Tensor> gather_with_grad_op(const torch::Tensor& x, std::string group,
                                                             bool equal_rows) {
  auto g = contrax::gather_no_grad(x, group_named(group, "gather_with_grad"), "gather_with_grad");
  if (equal_rows) {
    for (auto c : g.counts) {
      TORCH_CHECK(c == x.size(0), "contrax::gather_with_grad(): argument 'x': the ranks' row counts ", g.counts,
                  " differ; under torch.compile, uneven batches need "
                  "torch._dynamo.config.capture_dynamic_output_shape_ops = True");
    }
  }
  auto counts = torch::tensor(g.counts, torch::dtype(torch::kLong));
  // An operator's output may not alias its input (world 1 returns x itself).
  return {g.all.is_alias_of(x) ? g.all.clone() : g.all.contiguous(), counts};
}

// Backward of all = [x_0; ...; x_{W-1}]: rank r's rows appear in every rank's
// `all`, so dL/dx_r = sum_s (grad on rank s)[off_r : off_r + b_r], a
// reduce-scatter with SUM over rows (the communicator's, which moves
// reduce-scatter's volume also where the backend lacks one).
// `rows` (this rank's b_r) is the output's shape for the fake kernel.
torch::Tensor gather_with_grad_backward_op(const torch::Tensor& grad, const torch::Tensor& counts, c10::SymInt rows,
                                           std::string group) {
  auto comm = group_named(group, "gather_with_grad_backward");
  if (!comm || comm->world_size() == 1) return grad.clone();
  auto c = counts.to(torch::kCPU).contiguous();
  std::vector<int64_t> per_rank(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  auto out = comm->reduce_scatter_rows(grad.contiguous(), per_rank);
  TORCH_INTERNAL_ASSERT(out.size(0) == rows.guard_int(__FILE__, __LINE__));
  return out;
}

// ---- GradCache: the cached gradient into a representation --------------------------

// Pass 2 of GradCache backpropagates a cached gradient G into a re-computed
// representation r. As an operator: y = inject(r, G) is a 0-dim zero whose
// backward is dy/dr^T g = g G (the surrogate y = <r, G> would have the same
// backward but costs a reduction and a value nobody reads).
torch::Tensor grad_cache_inject_op(const torch::Tensor& rep, const torch::Tensor& grad) {
  TORCH_CHECK(rep.sizes() == grad.sizes(), "contrax::grad_cache_inject(): argument 'grad' must have the shape of "
              "'rep' ", rep.sizes(), ", but got ", grad.sizes());
  return torch::zeros({}, rep.options().dtype(c10::promoteTypes(rep.scalar_type(), torch::kFloat)));
}

}  // namespace

// The losses' schemas are defined from their table (contrax/_signatures.py,
// by contrax/_ops.py); the dispatcher checks the kernels below against them.
TORCH_LIBRARY(contrax, m) {
  m.set_python_module("contrax._ops");
  m.def("gather_with_grad(Tensor x, str group, bool equal_rows) -> (Tensor, Tensor)");
  m.def("gather_with_grad_backward(Tensor grad, Tensor counts, SymInt rows, str group) -> Tensor");
  m.def("grad_cache_inject(Tensor rep, Tensor grad) -> Tensor");
}

// Device-agnostic: the library's functions keep tensors on the caller's device.
TORCH_LIBRARY_IMPL(contrax, CompositeExplicitAutograd, m) {
  m.impl("clip_loss", &clip_loss_op);
  m.impl("clip_loss_backward", &clip_loss_backward_op);
  m.impl("grouped_loss", &grouped_loss_op);
  m.impl("grouped_loss_backward", &grouped_loss_backward_op);
  m.impl("nt_xent_loss", &nt_xent_loss_op);
  m.impl("nt_xent_loss_backward", &nt_xent_loss_backward_op);
  m.impl("moco_v3_loss", &moco_v3_loss_op);
  m.impl("moco_v3_loss_backward", &moco_v3_loss_backward_op);
  m.impl("siglip_loss", &siglip_loss_op);
  m.impl("siglip_loss_backward", &siglip_loss_backward_op);
  m.impl("gather_with_grad", &gather_with_grad_op);
  m.impl("gather_with_grad_backward", &gather_with_grad_backward_op);
  m.impl("grad_cache_inject", &grad_cache_inject_op);
}

// The registry's entry point for the Python layer (contrax/_ops.py).
void bind_ops(py::module_& m) {
  m.def("_register_op_group", &register_group, py::arg("name"), py::arg("comm"),
        "Registers a communicator under its process group's name for the contrax operators.");
}
