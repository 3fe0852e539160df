// contrax/comm/collectives.h in Python: gather, every rank's rows (with or without
// the gradient flowing back to their owner), their counts and this rank's
// offset.
#include <torch/extension.h>

#include "bind.h"
#include "contrax/comm/collectives.h"

namespace contrax::python {

void bind_collectives(py::module& m) {
  using namespace pybind11::literals;
  m.def(
      "gather",
      [](const torch::Tensor& x, bool with_grad, const CommunicatorPtr& comm) {
        Gathered g;
        {
          py::gil_scoped_release nogil;
          // Python's names: the errors say 'x', as its signature does.
          g = with_grad ? gather_with_grad(x, comm, "gather_with_grad", "x")
                        : gather_no_grad(x, comm, "gather_no_grad", "x");
        }
        return py::make_tuple(g.all, py::cast(g.counts), g.offset);
      },
      "x"_a, "with_grad"_a, "comm"_a);
}

}  // namespace contrax::python
