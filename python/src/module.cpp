// contrax._contrax: the C++ core of the Python binding. Thin: tensors in,
// tensors out, through the library's own autograd functions; the pure-Python
// layer (python/contrax/__init__.py) resolves `group=` and holds the
// docstrings users see. The module function installs the error and warning
// translation and calls one bind_<header> per bound public header (bind.h).
#include <torch/extension.h>

#include <string>

#include "bind.h"

namespace {

namespace py = pybind11;

// c10::Error -> ValueError for argument errors, RuntimeError otherwise, with
// the library's message (without the C++ backtrace). Module-local, so it is
// tried before torch's own translators.
void translate_errors() {
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      std::string msg = e.what_without_backtrace();
      bool value_error = dynamic_cast<const c10::ValueError*>(&e) != nullptr ||
                         msg.find("argument '") != std::string::npos || msg.find("arguments '") != std::string::npos;
      PyErr_SetString(value_error ? PyExc_ValueError : PyExc_RuntimeError, msg.c_str());
    }
  });
}

// C++ warnings (TORCH_WARN / TORCH_WARN_ONCE: the logit_scale porting check,
// deprecated option names) become Python UserWarnings, so `warnings` filters,
// pytest.warns and -W error see them instead of a line on stderr. Installed on
// the importing thread (the one that calls the losses' forwards); torch's own
// calls install their handler around themselves and restore this one.
class PyWarningForwarder : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { forward(warning.msg()); }

 private:
  static void forward(const std::string& msg) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    // With -W error the warning is an exception that cannot cross this C++
    // frame: it is reported as unraisable instead of being lost.
    if (PyErr_WarnEx(PyExc_UserWarning, msg.c_str(), 1) < 0) PyErr_WriteUnraisable(nullptr);
  }
};

void forward_warnings() {
  static auto* forwarder = new PyWarningForwarder();  // lives as long as the process
  c10::WarningUtils::set_warning_handler(forwarder);
}

}  // namespace

PYBIND11_MODULE(_contrax, m) {
  m.doc() = "C++ core of the contrax Python binding (use the `contrax` package, not this module).";
  translate_errors();
  forward_warnings();
  contrax::python::bind_losses(m);
  contrax::python::bind_collectives(m);
  contrax::python::bind_workspace(m);
  contrax::python::bind_communicator(m);
  contrax::python::bind_ops(m);
}
