// contrax/losses/tiled.h in Python: the tiled entry points of the CLIP, NT-Xent and
// MoCo v3 losses, which never hold a full logits matrix.
#include <torch/extension.h>

#include "bind.h"
#include "contrax/losses/tiled.h"

namespace contrax::python {

void bind_tiled(py::module& m) {
  using namespace pybind11::literals;
  m.def(
      "tiled_clip_loss",
      [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
         c10::optional<torch::Tensor> logit_bias, bool symmetric, double max_logit_scale, bool normalize,
         int64_t tile_size, bool ring, const CommunicatorPtr& comm) {
        py::gil_scoped_release nogil;
        return tiled_clip_loss(
            a, b, logit_scale, logit_bias,
            ClipLossOptions().symmetric(symmetric).max_logit_scale(max_logit_scale).normalize(normalize).comm(comm),
            TiledOptions().tile_size(tile_size).ring(ring));
      },
      "a"_a, "b"_a, "logit_scale"_a, "logit_bias"_a, "symmetric"_a, "max_logit_scale"_a, "normalize"_a, "tile_size"_a,
      "ring"_a, "comm"_a);
  m.def(
      "tiled_nt_xent_loss",
      [](const torch::Tensor& z1, const torch::Tensor& z2, double temperature, bool normalize, int64_t tile_size,
         bool ring, const CommunicatorPtr& comm) {
        py::gil_scoped_release nogil;
        return tiled_nt_xent_loss(z1, z2, NTXentLossOptions().temperature(temperature).normalize(normalize).comm(comm),
                                  TiledOptions().tile_size(tile_size).ring(ring));
      },
      "z1"_a, "z2"_a, "temperature"_a, "normalize"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def(
      "tiled_moco_v3_loss",
      [](const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1, const torch::Tensor& k2,
         double temperature, bool normalize, int64_t tile_size, bool ring, const CommunicatorPtr& comm) {
        py::gil_scoped_release nogil;
        return tiled_moco_v3_loss(q1, q2, k1, k2,
                                  MocoV3LossOptions().temperature(temperature).normalize(normalize).comm(comm),
                                  TiledOptions().tile_size(tile_size).ring(ring));
      },
      "q1"_a, "q2"_a, "k1"_a, "k2"_a, "temperature"_a, "normalize"_a, "tile_size"_a, "ring"_a, "comm"_a);
}

}  // namespace contrax::python
