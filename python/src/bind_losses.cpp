// contrax/losses/losses.h in Python: clip_loss, nt_xent_loss, moco_v3_loss and
// momentum_schedule. Tensors in, tensors out, through the library's own
// autograd functions, without the GIL while they run; the Python layer
// (python/contrax/__init__.py) resolves `group=` into `comm` and holds the
// docstrings. Each takes its arguments in the order of the loss's table
// (python/contrax/_signatures.py), `comm` in the place of `group`, and has no
// defaults: the Python layer passes them all.
#include <torch/extension.h>

#include "bind.h"
#include "contrax/losses/losses.h"

namespace contrax::python {

void bind_losses(py::module& m) {
  using namespace pybind11::literals;
  m.def(
      "clip_loss",
      [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
         c10::optional<torch::Tensor> logit_bias, bool symmetric, double max_logit_scale, bool normalize,
         c10::optional<torch::Tensor> labels, const std::string& label_mode, const std::string& reduction,
         const std::string& path, int64_t tile_size, bool ring, const CommunicatorPtr& comm) {
        auto o = ClipLossOptions()
                     .symmetric(symmetric)
                     .max_logit_scale(max_logit_scale)
                     .normalize(normalize)
                     .comm(comm)
                     .reduction(reduction_of(reduction, "clip_loss"))
                     .label_mode(label_mode_of(label_mode, "clip_loss"));
        set_memory_path(o, path, tile_size, ring, "clip_loss");
        if (labels.has_value()) o.labels(*labels);
        py::gil_scoped_release nogil;
        return clip_loss(a, b, logit_scale, logit_bias, o);
      },
      "a"_a, "b"_a, "logit_scale"_a, "logit_bias"_a, "symmetric"_a, "max_logit_scale"_a, "normalize"_a, "labels"_a,
      "label_mode"_a, "reduction"_a, "path"_a, "tile_size"_a, "ring"_a, "comm"_a);

  m.def(
      "nt_xent_loss",
      [](const torch::Tensor& z1, const torch::Tensor& z2, double temperature, bool normalize,
         const std::string& reduction, const std::string& path, int64_t tile_size, bool ring,
         const CommunicatorPtr& comm) {
        auto o = NTXentLossOptions().temperature(temperature).normalize(normalize).comm(comm).reduction(
            reduction_of(reduction, "nt_xent_loss"));
        set_memory_path(o, path, tile_size, ring, "nt_xent_loss");
        py::gil_scoped_release nogil;
        return nt_xent_loss(z1, z2, o);
      },
      "z1"_a, "z2"_a, "temperature"_a, "normalize"_a, "reduction"_a, "path"_a, "tile_size"_a, "ring"_a, "comm"_a);

  m.def(
      "moco_v3_loss",
      [](const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1, const torch::Tensor& k2,
         double temperature, bool normalize, const std::string& reduction, const std::string& path,
         int64_t tile_size, bool ring, const CommunicatorPtr& comm) {
        auto o = MocoV3LossOptions().temperature(temperature).normalize(normalize).comm(comm).reduction(
            reduction_of(reduction, "moco_v3_loss"));
        set_memory_path(o, path, tile_size, ring, "moco_v3_loss");
        py::gil_scoped_release nogil;
        return moco_v3_loss(q1, q2, k1, k2, o);
      },
      "q1"_a, "q2"_a, "k1"_a, "k2"_a, "temperature"_a, "normalize"_a, "reduction"_a, "path"_a, "tile_size"_a,
      "ring"_a, "comm"_a);

  m.def("momentum_schedule", &momentum_schedule, "base"_a, "step"_a, "total_steps"_a);
}

}  // namespace contrax::python
