// contrax/losses/grouped.h in Python: grouped_loss, queries against candidates with
// labels saying which candidates are each query's positives (arguments in the
// order of its table, python/contrax/_signatures.py).
#include <torch/extension.h>

#include "bind.h"
#include "contrax/losses/grouped.h"

namespace contrax::python {

void bind_grouped(py::module& m) {
  using namespace pybind11::literals;
  m.def(
      "grouped_loss",
      [](const torch::Tensor& queries, const torch::Tensor& candidates, const torch::Tensor& logit_scale,
         c10::optional<torch::Tensor> logit_bias, c10::optional<torch::Tensor> labels,
         c10::optional<torch::Tensor> candidate_labels, const std::string& label_mode, const std::string& reduction,
         double max_logit_scale, bool normalize, const std::string& path, int64_t tile_size, bool ring,
         const CommunicatorPtr& comm) {
        auto o = GroupedLossOptions()
                     .max_logit_scale(max_logit_scale)
                     .normalize(normalize)
                     .comm(comm)
                     .reduction(reduction_of(reduction, "grouped_loss"))
                     .label_mode(label_mode_of(label_mode, "grouped_loss"));
        set_memory_path(o, path, tile_size, ring, "grouped_loss");
        if (labels.has_value()) o.labels(*labels);
        if (candidate_labels.has_value()) o.candidate_labels(*candidate_labels);
        py::gil_scoped_release nogil;
        return grouped_loss(queries, candidates, logit_scale, logit_bias, o);
      },
      "queries"_a, "candidates"_a, "logit_scale"_a, "logit_bias"_a, "labels"_a, "candidate_labels"_a, "label_mode"_a,
      "reduction"_a, "max_logit_scale"_a, "normalize"_a, "path"_a, "tile_size"_a, "ring"_a, "comm"_a);
}

}  // namespace contrax::python
