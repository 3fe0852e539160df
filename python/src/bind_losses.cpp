// The six losses (contrax/losses/losses.h, grouped.h, siglip.h, maxsim.h) in Python,
// each declared once here: a function of its arguments, in the order of its
// table (python/contrax/_signatures.py), that makes a LossCall (bind.h). From
// each, the eager function `_contrax.<loss>` (`comm` in the place of `group`,
// every argument passed by contrax/__init__.py; it runs the library's autograd
// function without the GIL) and the operators `contrax::<loss>` and
// `<loss>_backward` (the group by name; kernels in ops.cpp).
// `_contrax._option_defaults()` reports the C++ options' defaults in the
// table's words (python/tests/test_signatures.py compares them).
#include <torch/extension.h>
#include <torch/library.h>

#include <tuple>
#include <utility>

#include "bind.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/maxsim.h"
#include "contrax/losses/siglip.h"

namespace contrax::python {

namespace {

using torch::Tensor;
using OptTensor = c10::optional<Tensor>;

c10::optional<Tensor> optional_of(const Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }
Tensor tensor_of(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

// The eager functions are passed the communicator, the operators its name.
CommunicatorPtr comm_of(const CommunicatorPtr& comm, const std::string&) { return comm; }
CommunicatorPtr comm_of(const std::string& name, const std::string& caller) { return group_named(name, caller); }

// The Matryoshka prefixes, the memory path and the group, every loss's last
// six arguments.
using Dims = std::vector<int64_t>;
using Weights = std::vector<double>;
template <typename Options, typename Group>
void place(Options& o, const Dims& dims, const Weights& weights, const std::string& path, int64_t tile_size,
           bool ring, const Group& group, const std::string& caller) {
  o.matryoshka_dims(dims).matryoshka_weights(weights);
  o.path(path_of(path, caller)).tile_size(tile_size).ring(ring);
  o.comm(comm_of(group, caller));
}

template <typename Group>
LossCall clip_loss_call(const Tensor& a, const Tensor& b, const Tensor& logit_scale, const OptTensor& logit_bias,
                        bool symmetric, double max_logit_scale, bool normalize, const OptTensor& labels,
                        std::string label_mode, std::string reduction, Dims dims, Weights weights, std::string path, int64_t tile_size, bool ring,
                        Group group) {
  return {"clip_loss", {a, b, logit_scale, tensor_of(logit_bias), tensor_of(labels)},
          [=](const Inputs& in, const std::string& caller) {
            auto o = ClipLossOptions()
                         .symmetric(symmetric)
                         .max_logit_scale(max_logit_scale)
                         .normalize(normalize)
                         .label_mode(label_mode_of(label_mode, caller))
                         .reduction(reduction_of(reduction, caller));
            place(o, dims, weights, path, tile_size, ring, group, caller);
            if (in[4].defined()) o.labels(in[4]);
            return clip_loss(in[0], in[1], in[2], optional_of(in[3]), o);
          }};
}

template <typename Group>
LossCall grouped_loss_call(const Tensor& queries, const Tensor& candidates, const Tensor& logit_scale,
                           const OptTensor& logit_bias, const OptTensor& labels, const OptTensor& candidate_labels,
                           std::string label_mode, std::string reduction, double max_logit_scale, bool normalize,
                           Dims dims, Weights weights, std::string path, int64_t tile_size, bool ring, Group group) {
  return {"grouped_loss",
          {queries, candidates, logit_scale, tensor_of(logit_bias), tensor_of(labels), tensor_of(candidate_labels)},
          [=](const Inputs& in, const std::string& caller) {
            auto o = GroupedLossOptions()
                         .label_mode(label_mode_of(label_mode, caller))
                         .reduction(reduction_of(reduction, caller))
                         .max_logit_scale(max_logit_scale)
                         .normalize(normalize);
            place(o, dims, weights, path, tile_size, ring, group, caller);
            if (in[4].defined()) o.labels(in[4]);
            if (in[5].defined()) o.candidate_labels(in[5]);
            return grouped_loss(in[0], in[1], in[2], optional_of(in[3]), o);
          }};
}

// NT-Xent's and MoCo v3's options (their option sets have the same setters for them).
template <typename Options, typename Group>
Options temperature_options(double temperature, bool normalize, const std::string& reduction, const Dims& dims,
                            const Weights& weights, const std::string& path, int64_t tile_size, bool ring,
                            const Group& group, const std::string& caller) {
  auto o = Options().temperature(temperature).normalize(normalize).reduction(reduction_of(reduction, caller));
  place(o, dims, weights, path, tile_size, ring, group, caller);
  return o;
}

template <typename Group>
LossCall nt_xent_loss_call(const Tensor& z1, const Tensor& z2, double temperature, bool normalize,
                           std::string reduction, Dims dims, Weights weights, std::string path, int64_t tile_size, bool ring, Group group) {
  return {"nt_xent_loss", {z1, z2}, [=](const Inputs& in, const std::string& caller) {
            return nt_xent_loss(in[0], in[1], temperature_options<NTXentLossOptions>(
                                                  temperature, normalize, reduction, dims, weights, path,
                                                  tile_size, ring, group, caller));
          }};
}

// The keys k1, k2 are constants: no gradient.
template <typename Group>
LossCall moco_v3_loss_call(const Tensor& q1, const Tensor& q2, const Tensor& k1, const Tensor& k2, double temperature,
                           bool normalize, std::string reduction, Dims dims, Weights weights, std::string path, int64_t tile_size, bool ring,
                           Group group) {
  return {"moco_v3_loss", {q1, q2, k1, k2}, [=](const Inputs& in, const std::string& caller) {
            return moco_v3_loss(in[0], in[1], in[2], in[3], temperature_options<MocoV3LossOptions>(
                                                               temperature, normalize, reduction, dims, weights,
                                                               path, tile_size, ring, group, caller));
          }};
}

template <typename Group>
LossCall siglip_loss_call(const Tensor& a, const Tensor& b, const Tensor& logit_scale, const OptTensor& logit_bias,
                          double max_logit_scale, bool normalize, Dims dims, Weights weights, std::string path,
                          int64_t tile_size, bool ring, Group group) {
  return {"siglip_loss", {a, b, logit_scale, tensor_of(logit_bias)}, [=](const Inputs& in, const std::string& caller) {
            auto o = SigLipLossOptions().max_logit_scale(max_logit_scale).normalize(normalize);
            place(o, dims, weights, path, tile_size, ring, group, caller);
            return siglip_loss(in[0], in[1], in[2], optional_of(in[3]), o);
          }};
}

template <typename Group>
LossCall maxsim_loss_call(const Tensor& queries, const Tensor& documents, const OptTensor& logit_scale,
                          const OptTensor& query_mask, const OptTensor& document_mask, double temperature,
                          double max_logit_scale, bool normalize_scores, bool symmetric, std::string reduction,
                          double padding_score, int64_t panel_bytes, std::string path, int64_t tile_size, bool ring,
                          Group group) {
  return {"maxsim_loss",
          {queries, documents, tensor_of(logit_scale), tensor_of(query_mask), tensor_of(document_mask)},
          [=](const Inputs& in, const std::string& caller) {
            auto o = MaxSimLossOptions()
                         .temperature(temperature)
                         .max_logit_scale(max_logit_scale)
                         .normalize_scores(normalize_scores)
                         .symmetric(symmetric)
                         .reduction(reduction_of(reduction, caller))
                         .padding_score(padding_score)
                         .panel_bytes(panel_bytes)
                         .path(path_of(path, caller))
                         .tile_size(tile_size)
                         .ring(ring)
                         .comm(comm_of(group, caller));
            if (in[3].defined()) o.query_mask(in[3]);
            if (in[4].defined()) o.document_mask(in[4]);
            return maxsim_loss(in[0], in[1], optional_of(in[2]), o);
          }};
}

// The faces of a loss whose LossCall `Call` makes, from its arguments `A`:
// the eager function and the operator's two kernels (the backward returns
// the gradients of the first `n_grad` inputs, as its schema's tuple).
template <size_t n_grad, auto Call>
struct Faces;

template <size_t n_grad, typename... A, LossCall (*Call)(A...)>
struct Faces<n_grad, Call> {
  static Tensor eager(A... args) {
    auto call = Call(std::move(args)...);
    py::gil_scoped_release nogil;
    return call.loss(call.inputs, call.name);
  }

  static Tensor forward(A... args) {
    auto call = Call(std::move(args)...);
    call.name = "contrax::" + call.name;
    return loss_value(call);
  }

  static auto backward(const Tensor& grad, A... args) {
    auto call = Call(std::move(args)...);
    call.name = "contrax::" + call.name + "_backward";
    return tuple_of(loss_backward(grad, call, n_grad), std::make_index_sequence<n_grad>());
  }

 private:
  template <size_t... i>
  static auto tuple_of(const std::vector<Tensor>& g, std::index_sequence<i...>) {
    return std::make_tuple(g[i]...);
  }
};

using Clip = Faces<4, &clip_loss_call<CommunicatorPtr>>;
using Grouped = Faces<4, &grouped_loss_call<CommunicatorPtr>>;
using NtXent = Faces<2, &nt_xent_loss_call<CommunicatorPtr>>;
using MocoV3 = Faces<2, &moco_v3_loss_call<CommunicatorPtr>>;
using SigLip = Faces<4, &siglip_loss_call<CommunicatorPtr>>;
using MaxSim = Faces<3, &maxsim_loss_call<CommunicatorPtr>>;

template <typename F>
void impl_op(torch::Library& m, const std::string& name) {
  m.impl(name.c_str(), &F::forward);
  m.impl((name + "_backward").c_str(), &F::backward);
}

// The defaults every loss's options share: normalize, the Matryoshka
// prefixes (the table's empty tuples) and the memory path.
template <typename Options>
py::dict with_memory(const Options& o, py::dict d) {
  d["normalize"] = o.normalize();
  d["matryoshka_dims"] = py::tuple(py::cast(o.matryoshka_dims()));
  d["matryoshka_weights"] = py::tuple(py::cast(o.matryoshka_weights()));
  d["path"] = word_of(o.path());
  d["tile_size"] = o.tile_size();
  d["ring"] = o.ring();
  return d;
}

py::dict option_defaults() {
  using namespace pybind11::literals;
  ClipLossOptions c;
  GroupedLossOptions g;
  NTXentLossOptions n;
  MocoV3LossOptions mo;
  SigLipLossOptions s;
  MaxSimLossOptions x;
  return py::dict(
      "clip_loss"_a = with_memory(c, py::dict("symmetric"_a = c.symmetric(), "max_logit_scale"_a = c.max_logit_scale(),
                                              "label_mode"_a = word_of(c.label_mode()),
                                              "reduction"_a = word_of(c.reduction()))),
      "grouped_loss"_a = with_memory(g, py::dict("label_mode"_a = word_of(g.label_mode()),
                                                 "reduction"_a = word_of(g.reduction()),
                                                 "max_logit_scale"_a = g.max_logit_scale())),
      "nt_xent_loss"_a =
          with_memory(n, py::dict("temperature"_a = n.temperature(), "reduction"_a = word_of(n.reduction()))),
      "moco_v3_loss"_a =
          with_memory(mo, py::dict("temperature"_a = mo.temperature(), "reduction"_a = word_of(mo.reduction()))),
      "siglip_loss"_a = with_memory(s, py::dict("max_logit_scale"_a = s.max_logit_scale())),
      "maxsim_loss"_a = py::dict("temperature"_a = x.temperature(), "max_logit_scale"_a = x.max_logit_scale(),
                                 "normalize_scores"_a = x.normalize_scores(), "symmetric"_a = x.symmetric(),
                                 "reduction"_a = word_of(x.reduction()), "padding_score"_a = x.padding_score(),
                                 "panel_bytes"_a = x.panel_bytes(), "path"_a = word_of(x.path()),
                                 "tile_size"_a = x.tile_size(), "ring"_a = x.ring()));
}

}  // namespace

void bind_losses(py::module& m) {
  using namespace pybind11::literals;
  m.def("clip_loss", &Clip::eager, "a"_a, "b"_a, "logit_scale"_a, "logit_bias"_a, "symmetric"_a, "max_logit_scale"_a,
        "normalize"_a, "labels"_a, "label_mode"_a, "reduction"_a, "matryoshka_dims"_a, "matryoshka_weights"_a,
        "path"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def("grouped_loss", &Grouped::eager, "queries"_a, "candidates"_a, "logit_scale"_a, "logit_bias"_a, "labels"_a,
        "candidate_labels"_a, "label_mode"_a, "reduction"_a, "max_logit_scale"_a, "normalize"_a,
        "matryoshka_dims"_a, "matryoshka_weights"_a, "path"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def("nt_xent_loss", &NtXent::eager, "z1"_a, "z2"_a, "temperature"_a, "normalize"_a, "reduction"_a,
        "matryoshka_dims"_a, "matryoshka_weights"_a, "path"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def("moco_v3_loss", &MocoV3::eager, "q1"_a, "q2"_a, "k1"_a, "k2"_a, "temperature"_a, "normalize"_a,
        "reduction"_a, "matryoshka_dims"_a, "matryoshka_weights"_a, "path"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def("siglip_loss", &SigLip::eager, "a"_a, "b"_a, "logit_scale"_a, "logit_bias"_a, "max_logit_scale"_a,
        "normalize"_a, "matryoshka_dims"_a, "matryoshka_weights"_a, "path"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def("maxsim_loss", &MaxSim::eager, "queries"_a, "documents"_a, "logit_scale"_a, "query_mask"_a,
        "document_mask"_a, "temperature"_a, "max_logit_scale"_a, "normalize_scores"_a, "symmetric"_a, "reduction"_a,
        "padding_score"_a, "panel_bytes"_a, "path"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def("momentum_schedule", &momentum_schedule, "base"_a, "step"_a, "total_steps"_a);
  m.def("_option_defaults", &option_defaults, "The C++ options' defaults of each loss, in the Python table's words.");
}

}  // namespace contrax::python

// The losses' schemas are defined from their table (contrax/_ops.py); the
// dispatcher checks these kernels against them. Device-agnostic: the
// library's functions keep tensors on the caller's device.
TORCH_LIBRARY_IMPL(contrax, CompositeExplicitAutograd, m) {
  using namespace contrax::python;
  impl_op<Faces<4, &clip_loss_call<std::string>>>(m, "clip_loss");
  impl_op<Faces<4, &grouped_loss_call<std::string>>>(m, "grouped_loss");
  impl_op<Faces<2, &nt_xent_loss_call<std::string>>>(m, "nt_xent_loss");
  impl_op<Faces<2, &moco_v3_loss_call<std::string>>>(m, "moco_v3_loss");
  impl_op<Faces<4, &siglip_loss_call<std::string>>>(m, "siglip_loss");
  impl_op<Faces<3, &maxsim_loss_call<std::string>>>(m, "maxsim_loss");
}
