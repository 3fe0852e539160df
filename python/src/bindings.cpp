// contrax._contrax: the C++ core of the Python binding.
//
// Thin: tensors in, tensors out, through the library's own autograd functions.
// The pure-Python layer (python/contrax/__init__.py) resolves `group=` (None ->
// torch.distributed's default group when it is initialised, else world 1) and
// holds the docstrings users see; this module turns a torch.distributed
// ProcessGroup into a cached contrax::Communicator and maps c10::Error to
// ValueError (argument errors) / RuntimeError (everything else).
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "contrax/collectives.h"
#include "contrax/communicator.h"
#include "contrax/detail/c10d.h"
#include "contrax/grouped.h"
#include "contrax/losses.h"
#include "contrax/siglip.h"
#include "contrax/memory.h"
#include "contrax/tiled.h"

namespace py = pybind11;

namespace {

using PG = c10d::ProcessGroup;
using PGPtr = c10::intrusive_ptr<PG>;

// One communicator per process group, keyed by the group's address. The cache
// holds the only extra reference; an entry whose group nobody else references
// any more (torch.distributed.destroy_process_group) is dropped on the next
// lookup, so addresses cannot be reused while an entry is alive.
struct CommCache {
  std::mutex mutex;
  std::map<const PG*, contrax::CommunicatorPtr> by_group;
  contrax::CommunicatorPtr single;
};
CommCache& cache() {
  static auto* c = new CommCache();  // never destroyed: no c10d teardown at interpreter exit
  return *c;
}

// Entries whose group nobody else references any more move to `dropped`,
// which the caller frees with drop_without_gil once the mutex is released.
void purge_locked(CommCache& c, std::vector<contrax::CommunicatorPtr>& dropped) {
  for (auto it = c.by_group.begin(); it != c.by_group.end();) {
    auto pg = contrax::detail::process_group(*it->second);
    // use_count: the communicator's reference + `pg` here = 2 -> nobody else.
    if (!pg || pg.use_count() <= 2) {
      dropped.push_back(std::move(it->second));
      it = c.by_group.erase(it);
    } else {
      ++it;
    }
  }
}

// Frees communicators, and with them possibly the last reference to a process
// group, without the GIL. ~ProcessGroupGloo joins its worker threads, and a
// worker may still be dropping the last reference to a finished work item
// whose tensors own Python objects: it takes the GIL to free them. Joining
// with the GIL held deadlocks then, and a group left alive into interpreter
// finalization makes that worker's GIL request end the thread (pthread_exit
// through ~TensorImpl: "terminate called without an active exception").
void drop_without_gil(std::vector<contrax::CommunicatorPtr>& dropped) {
  if (dropped.empty()) return;
  py::gil_scoped_release no_gil;
  dropped.clear();
}

PGPtr to_group(const py::handle& group) {
  try {
    return py::cast<PGPtr>(group);
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("contrax: argument 'group' must be a torch.distributed ProcessGroup or None, "
                                     "but got ") +
                         std::string(py::str(py::type::of(group).attr("__name__"))));
  }
}

contrax::CommunicatorPtr comm_for_locked(CommCache& c, const py::object& group, double timeout_s,
                                         std::vector<contrax::CommunicatorPtr>& dropped) {
  if (group.is_none()) {
    if (!c.single) c.single = contrax::Communicator::single();
    return c.single;
  }
  PGPtr pg = to_group(group);
  purge_locked(c, dropped);
  auto it = c.by_group.find(pg.get());
  if (it != c.by_group.end()) return it->second;
  if (pg->getSize() == 1) {
    // A group of one rank: the plain single-device losses (no group is kept).
    if (!c.single) c.single = contrax::Communicator::single();
    return c.single;
  }
  auto ms = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  auto comm = contrax::detail::wrap_process_group(pg, ms);
  c.by_group.emplace(pg.get(), comm);
  return comm;
}

contrax::CommunicatorPtr comm_for(const py::object& group, double timeout_s) {
  auto& c = cache();
  std::vector<contrax::CommunicatorPtr> dropped;
  contrax::CommunicatorPtr comm;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    comm = comm_for_locked(c, group, timeout_s, dropped);
  }
  drop_without_gil(dropped);
  return comm;
}

py::dict stats_dict(const contrax::CommStats& s) {
  py::dict out;
  for (const auto& kv : s.ops) {
    py::dict op;
    op["calls"] = kv.second.calls;
    op["bytes_sent"] = kv.second.bytes_sent;
    out[py::str(kv.first)] = op;
  }
  return out;
}

// Python spells the enums as strings; a bad one is an argument error (ValueError).
contrax::Reduction reduction_of(const std::string& s, const char* caller) {
  if (s == "mean") return contrax::Reduction::kMean;
  if (s == "sum") return contrax::Reduction::kSum;
  if (s == "none") return contrax::Reduction::kNone;
  TORCH_CHECK(false, caller, "(): argument 'reduction' must be 'mean', 'sum' or 'none', but got '", s, "'");
}

contrax::MemoryPath path_of(const std::string& s, const char* caller) {
  if (s == "auto") return contrax::MemoryPath::kAuto;
  if (s == "materialised" || s == "materialized") return contrax::MemoryPath::kMaterialised;
  if (s == "tiled") return contrax::MemoryPath::kTiled;
  TORCH_CHECK(false, caller, "(): argument 'path' must be 'auto', 'materialised' or 'tiled', but got '", s, "'");
}

// The memory path every loss binding takes the same way.
template <typename Options>
Options& set_memory_path(Options& o, const std::string& path, int64_t tile_size, bool ring, const char* caller) {
  return o.path(path_of(path, caller)).tile_size(tile_size).ring(ring);
}

contrax::LabelMode label_mode_of(const std::string& s, const char* caller) {
  if (s == "multi_positive") return contrax::LabelMode::kMultiPositive;
  if (s == "mask_duplicates") return contrax::LabelMode::kMaskDuplicates;
  TORCH_CHECK(false, caller, "(): argument 'label_mode' must be 'multi_positive' or 'mask_duplicates', but got '", s,
              "'");
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

}  // namespace

void bind_ops(pybind11::module_& m);  // python/src/ops.cpp: the torch.library operators' group registry

PYBIND11_MODULE(_contrax, m) {
  m.doc() = "C++ core of the contrax Python binding (use the `contrax` package, not this module).";

  // c10::Error -> ValueError for argument errors, RuntimeError otherwise, with
  // the library's message (without the C++ backtrace). Module-local, so it is
  // tried before torch's own translators.
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

  static auto* forwarder = new PyWarningForwarder();  // lives as long as the process
  c10::WarningUtils::set_warning_handler(forwarder);
  bind_ops(m);

  using namespace pybind11::literals;
  m.def(
      "clip_loss",
      [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
         c10::optional<torch::Tensor> logit_bias, bool symmetric, double max_logit_scale, bool normalize,
         const contrax::CommunicatorPtr& comm, c10::optional<torch::Tensor> labels, const std::string& label_mode,
         const std::string& reduction, const std::string& path, int64_t tile_size, bool ring) {
        auto o = contrax::ClipLossOptions()
                     .symmetric(symmetric)
                     .max_logit_scale(max_logit_scale)
                     .normalize(normalize)
                     .comm(comm)
                     .reduction(reduction_of(reduction, "clip_loss"))
                     .label_mode(label_mode_of(label_mode, "clip_loss"));
        set_memory_path(o, path, tile_size, ring, "clip_loss");
        if (labels.has_value()) o.labels(*labels);
        py::gil_scoped_release nogil;
        return contrax::clip_loss(a, b, logit_scale, logit_bias, o);
      },
      "a"_a, "b"_a, "logit_scale"_a, "logit_bias"_a, "symmetric"_a, "max_logit_scale"_a, "normalize"_a, "comm"_a,
      "labels"_a = py::none(), "label_mode"_a = "multi_positive", "reduction"_a = "mean", "path"_a = "auto",
      "tile_size"_a = 0, "ring"_a = false);

  m.def(
      "grouped_loss",
      [](const torch::Tensor& queries, const torch::Tensor& candidates, const torch::Tensor& logit_scale,
         c10::optional<torch::Tensor> logit_bias, c10::optional<torch::Tensor> labels,
         c10::optional<torch::Tensor> candidate_labels, const std::string& label_mode, const std::string& reduction,
         double max_logit_scale, bool normalize, int64_t tile_size, bool ring, const contrax::CommunicatorPtr& comm,
         const std::string& path) {
        auto o = contrax::GroupedLossOptions()
                     .max_logit_scale(max_logit_scale)
                     .normalize(normalize)
                     .comm(comm)
                     .reduction(reduction_of(reduction, "grouped_loss"))
                     .label_mode(label_mode_of(label_mode, "grouped_loss"));
        set_memory_path(o, path, tile_size, ring, "grouped_loss");
        if (labels.has_value()) o.labels(*labels);
        if (candidate_labels.has_value()) o.candidate_labels(*candidate_labels);
        py::gil_scoped_release nogil;
        return contrax::grouped_loss(queries, candidates, logit_scale, logit_bias, o);
      },
      "queries"_a, "candidates"_a, "logit_scale"_a, "logit_bias"_a, "labels"_a, "candidate_labels"_a, "label_mode"_a,
      "reduction"_a, "max_logit_scale"_a, "normalize"_a, "tile_size"_a, "ring"_a, "comm"_a, "path"_a = "auto");

  m.def(
      "nt_xent_loss",
      [](const torch::Tensor& z1, const torch::Tensor& z2, double temperature, bool normalize,
         const contrax::CommunicatorPtr& comm, const std::string& reduction, const std::string& path, int64_t tile_size,
         bool ring) {
        auto o = contrax::NTXentLossOptions().temperature(temperature).normalize(normalize).comm(comm).reduction(
            reduction_of(reduction, "nt_xent_loss"));
        set_memory_path(o, path, tile_size, ring, "nt_xent_loss");
        py::gil_scoped_release nogil;
        return contrax::nt_xent_loss(z1, z2, o);
      },
      "z1"_a, "z2"_a, "temperature"_a, "normalize"_a, "comm"_a, "reduction"_a = "mean", "path"_a = "auto",
      "tile_size"_a = 0, "ring"_a = false);

  m.def(
      "moco_v3_loss",
      [](const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1, const torch::Tensor& k2,
         double temperature, bool normalize, const contrax::CommunicatorPtr& comm, const std::string& reduction,
         const std::string& path, int64_t tile_size, bool ring) {
        auto o = contrax::MocoV3LossOptions().temperature(temperature).normalize(normalize).comm(comm).reduction(
            reduction_of(reduction, "moco_v3_loss"));
        set_memory_path(o, path, tile_size, ring, "moco_v3_loss");
        py::gil_scoped_release nogil;
        return contrax::moco_v3_loss(q1, q2, k1, k2, o);
      },
      "q1"_a, "q2"_a, "k1"_a, "k2"_a, "temperature"_a, "normalize"_a, "comm"_a, "reduction"_a = "mean",
      "path"_a = "auto", "tile_size"_a = 0, "ring"_a = false);

  m.def(
      "gather",
      [](const torch::Tensor& x, bool with_grad, const contrax::CommunicatorPtr& comm) {
        contrax::Gathered g;
        {
          py::gil_scoped_release nogil;
          g = with_grad ? contrax::gather_with_grad(x, comm) : contrax::gather_no_grad(x, comm);
        }
        return py::make_tuple(g.all, py::cast(g.counts), g.offset);
      },
      "x"_a, "with_grad"_a, "comm"_a);

  m.def(
      "tiled_clip_loss",
      [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
         c10::optional<torch::Tensor> logit_bias, bool symmetric, double max_logit_scale, bool normalize,
         int64_t tile_size, bool ring, const contrax::CommunicatorPtr& comm) {
        py::gil_scoped_release nogil;
        return contrax::tiled_clip_loss(a, b, logit_scale, logit_bias,
                                        contrax::ClipLossOptions()
                                            .symmetric(symmetric)
                                            .max_logit_scale(max_logit_scale)
                                            .normalize(normalize)
                                            .comm(comm),
                                        contrax::TiledOptions().tile_size(tile_size).ring(ring));
      },
      "a"_a, "b"_a, "logit_scale"_a, "logit_bias"_a, "symmetric"_a, "max_logit_scale"_a, "normalize"_a, "tile_size"_a,
      "ring"_a, "comm"_a);
  m.def(
      "tiled_nt_xent_loss",
      [](const torch::Tensor& z1, const torch::Tensor& z2, double temperature, bool normalize, int64_t tile_size,
         bool ring, const contrax::CommunicatorPtr& comm) {
        py::gil_scoped_release nogil;
        return contrax::tiled_nt_xent_loss(
            z1, z2, contrax::NTXentLossOptions().temperature(temperature).normalize(normalize).comm(comm),
            contrax::TiledOptions().tile_size(tile_size).ring(ring));
      },
      "z1"_a, "z2"_a, "temperature"_a, "normalize"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def(
      "tiled_moco_v3_loss",
      [](const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1, const torch::Tensor& k2,
         double temperature, bool normalize, int64_t tile_size, bool ring, const contrax::CommunicatorPtr& comm) {
        py::gil_scoped_release nogil;
        return contrax::tiled_moco_v3_loss(
            q1, q2, k1, k2, contrax::MocoV3LossOptions().temperature(temperature).normalize(normalize).comm(comm),
            contrax::TiledOptions().tile_size(tile_size).ring(ring));
      },
      "q1"_a, "q2"_a, "k1"_a, "k2"_a, "temperature"_a, "normalize"_a, "tile_size"_a, "ring"_a, "comm"_a);
  m.def(
      "siglip_loss",
      [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
         c10::optional<torch::Tensor> logit_bias, double max_logit_scale, bool normalize, int64_t chunk_size,
         const contrax::CommunicatorPtr& comm) {
        py::gil_scoped_release nogil;
        return contrax::siglip_loss(a, b, logit_scale, logit_bias,
                                    contrax::SigLipLossOptions()
                                        .max_logit_scale(max_logit_scale)
                                        .normalize(normalize)
                                        .tile_size(chunk_size)
                                        .comm(comm));
      },
      "a"_a, "b"_a, "logit_scale"_a, "logit_bias"_a, "max_logit_scale"_a, "normalize"_a, "chunk_size"_a, "comm"_a);

  m.def("momentum_schedule", &contrax::momentum_schedule, "base"_a, "step"_a, "total_steps"_a);

  // ---- the loss workspace (contrax/memory.h)
  m.def("set_keep_loss_workspace", &contrax::set_keep_loss_workspace, "keep"_a);
  m.def("keep_loss_workspace", &contrax::keep_loss_workspace);
  m.def("loss_workspace_bytes", &contrax::loss_workspace_bytes);
  m.def("release_loss_workspace", &contrax::release_loss_workspace);

  // ---- communicators
  py::class_<contrax::Communicator, contrax::CommunicatorPtr>(m, "Communicator",
                                                              "A cached contrax communicator over a process group.")
      .def_property_readonly("rank", &contrax::Communicator::rank)
      .def_property_readonly("world_size", &contrax::Communicator::world_size)
      .def_property_readonly("backend", &contrax::Communicator::backend)
      .def("stats", [](const contrax::Communicator& c) { return stats_dict(c.stats()); })
      .def("reset_stats", &contrax::Communicator::reset_stats);

  m.def("communicator", &comm_for, "group"_a, "timeout_s"_a = 1800.0,
        "The cached communicator for a ProcessGroup (None: world 1).");
  m.def(
      "clear_cache",
      [] {
        auto& c = cache();
        std::vector<contrax::CommunicatorPtr> dropped;
        {
          std::lock_guard<std::mutex> lock(c.mutex);
          for (auto& kv : c.by_group) dropped.push_back(std::move(kv.second));
          c.by_group.clear();
        }
        drop_without_gil(dropped);
      },
      "Drops every cached communicator (and its reference to the process group).");
  m.def("_cache_size", [] {
    auto& c = cache();
    std::vector<contrax::CommunicatorPtr> dropped;
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lock(c.mutex);
      purge_locked(c, dropped);
      n = c.by_group.size();
    }
    drop_without_gil(dropped);
    return n;
  });
}
