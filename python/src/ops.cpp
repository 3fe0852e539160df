// Contrax's losses, the gather with gradient and GradCache's gradient
// injection as PyTorch operators (namespace `contrax`, TORCH_LIBRARY), so that
// torch.compile(fullgraph=True) traces a training step through them instead
// of breaking the graph at an opaque pybind call.
//
// Each loss is two operators, `contrax::<loss>` (the value) and
// `contrax::<loss>_backward` (the gradients), both computed here from the
// loss's LossCall (python/src/bind_losses.cpp registers them). Their schemas,
// fake kernels and autograd formula are registered from Python
// (contrax/_ops.py), so neither kernel ever sees a fake tensor, and the
// backward gets nothing from the forward but real inputs (no buffers saved by
// a forward that may have run on fake tensors).
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

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bind.h"
#include "contrax/comm/collectives.h"

namespace contrax::python {

namespace {

// ---- process groups by name ---------------------------------------------------

struct GroupRegistry {
  std::mutex mutex;
  // Weak: the binding's communicator cache owns them (and frees a destroyed
  // group's communicator without the GIL); an operator called after that
  // finds the name expired.
  std::map<std::string, std::weak_ptr<Communicator>> by_name;
};
GroupRegistry& registry() {
  static auto* r = new GroupRegistry();  // never destroyed: no c10d teardown at exit
  return *r;
}

void register_group(const std::string& name, const CommunicatorPtr& comm) {
  TORCH_CHECK(!name.empty(), "contrax: a process group needs a non-empty name");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.by_name[name] = comm;
}

// ---- value and backward of any loss ----------------------------------------------

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

// ---- gather with gradient ---------------------------------------------------------

// Forward: the rows of every rank in rank order, and the per-rank row counts
// (int64 [W]) that the backward needs to cut its gradient. `equal_rows`
// promises W * b_r rows (a shape the compiler knows: no unbacked size, so no
// graph break where capture_dynamic_output_shape_ops is off); a rank whose
// count differs fails on every rank, naming the switch that lifts the promise.
std::tuple<torch::Tensor, torch::Tensor> gather_with_grad_op(const torch::Tensor& x, std::string group,
                                                             bool equal_rows) {
  auto g = contrax::gather_no_grad(x, group_named(group, "contrax::gather_with_grad"), "gather_with_grad", "x");
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
  auto comm = group_named(group, "contrax::gather_with_grad_backward");
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

CommunicatorPtr group_named(const std::string& name, const std::string& caller) {
  if (name.empty()) return nullptr;  // world 1: the single-device loss
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_name.find(name);
  CommunicatorPtr comm = it == r.by_name.end() ? nullptr : it->second.lock();
  TORCH_CHECK(comm, caller, "(): argument 'group': process group '", name,
              "' is not registered with contrax (call the loss through contrax's Python functions, which register "
              "it), or it has been destroyed");
  return comm;
}

// ---- value and backward of any loss ------------------------------------------------

// Kernels see no fake tensors, so the value is the loss's own, unrecorded.
torch::Tensor loss_value(const LossCall& call) {
  torch::NoGradGuard no_grad;
  return call.loss(call.inputs, call.name);
}

// The gradients of the first `n_grad` inputs (zeros for an input the loss
// does not reach; a 0-dim zero for an absent optional one). See the file
// comment for why recomputing gives the exact vector-Jacobian product.
std::vector<torch::Tensor> loss_backward(const torch::Tensor& grad, const LossCall& call, size_t n_grad) {
  RecordAutograd record;
  const auto& inputs = call.inputs;
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
  auto out = call.loss(leaves, call.name);
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

// The registry's entry point for the Python layer (contrax/_ops.py).
void bind_ops(py::module& m) {
  m.def("_register_op_group", &register_group, py::arg("name"), py::arg("comm"),
        "Registers a communicator under its process group's name for the contrax operators.");
}

}  // namespace contrax::python

// The losses' schemas are defined by contrax/_ops.py (see the file comment).
TORCH_LIBRARY(contrax, m) {
  m.set_python_module("contrax._ops");
  m.def("gather_with_grad(Tensor x, str group, bool equal_rows) -> (Tensor, Tensor)");
  m.def("gather_with_grad_backward(Tensor grad, Tensor counts, SymInt rows, str group) -> Tensor");
  m.def("grad_cache_inject(Tensor rep, Tensor grad) -> Tensor");
}

// Device-agnostic: the library's functions keep tensors on the caller's device.
TORCH_LIBRARY_IMPL(contrax, CompositeExplicitAutograd, m) {
  using namespace contrax::python;
  m.impl("gather_with_grad", &gather_with_grad_op);
  m.impl("gather_with_grad_backward", &gather_with_grad_backward_op);
  m.impl("grad_cache_inject", &grad_cache_inject_op);
}
