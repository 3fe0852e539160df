// contrax/engine/workspace.h in Python: whether the losses keep their per-thread
// workspace between calls, its size, and releasing it.
#include <torch/extension.h>

#include "bind.h"
#include "contrax/engine/workspace.h"

namespace contrax::python {

void bind_workspace(py::module& m) {
  using namespace pybind11::literals;
  m.def("set_keep_loss_workspace", &set_keep_loss_workspace, "keep"_a);
  m.def("keep_loss_workspace", &keep_loss_workspace);
  m.def("loss_workspace_bytes", &loss_workspace_bytes);
  m.def("release_loss_workspace", &release_loss_workspace);
}

}  // namespace contrax::python
