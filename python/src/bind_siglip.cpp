// contrax/losses/siglip.h in Python: siglip_loss, the sigmoid pairwise loss
// (arguments in the order of its table, python/contrax/_signatures.py).
#include <torch/extension.h>

#include "bind.h"
#include "contrax/losses/siglip.h"

namespace contrax::python {

void bind_siglip(py::module& m) {
  using namespace pybind11::literals;
  m.def(
      "siglip_loss",
      [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
         c10::optional<torch::Tensor> logit_bias, double max_logit_scale, bool normalize, const std::string& path,
         int64_t tile_size, bool ring, const CommunicatorPtr& comm) {
        auto o = SigLipLossOptions().max_logit_scale(max_logit_scale).normalize(normalize).comm(comm);
        set_memory_path(o, path, tile_size, ring, "siglip_loss");
        py::gil_scoped_release nogil;
        return siglip_loss(a, b, logit_scale, logit_bias, o);
      },
      "a"_a, "b"_a, "logit_scale"_a, "logit_bias"_a, "max_logit_scale"_a, "normalize"_a, "path"_a, "tile_size"_a,
      "ring"_a, "comm"_a);
}

}  // namespace contrax::python
