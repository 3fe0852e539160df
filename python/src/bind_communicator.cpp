// contrax/comm/communicator.h in Python: the Communicator (rank, world size,
// backend, traffic statistics) and one cached communicator per
// torch.distributed ProcessGroup, made with contrax/comm/detail/c10d.h.
#include <torch/extension.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "bind.h"
#include "contrax/comm/communicator.h"
#include "contrax/comm/detail/c10d.h"

namespace contrax::python {

namespace {

using PG = c10d::ProcessGroup;
using PGPtr = c10::intrusive_ptr<PG>;

// One communicator per process group, keyed by the group's address. The cache
// holds the only extra reference; an entry whose group nobody else references
// any more (torch.distributed.destroy_process_group) is dropped on the next
// lookup, so addresses cannot be reused while an entry is alive.
struct CommCache {
  std::mutex mutex;
  std::map<const PG*, CommunicatorPtr> by_group;
  CommunicatorPtr single;
};
CommCache& cache() {
  static auto* c = new CommCache();  // never destroyed: no c10d teardown at interpreter exit
  return *c;
}

// Entries whose group nobody else references any more move to `dropped`,
// which the caller frees with drop_without_gil once the mutex is released.
void purge_locked(CommCache& c, std::vector<CommunicatorPtr>& dropped) {
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
void drop_without_gil(std::vector<CommunicatorPtr>& dropped) {
  if (dropped.empty()) return;
  py::gil_scoped_release no_gil;
  dropped.clear();
}

// f(cache, dropped) under the cache's mutex; then what it dropped is freed
// without the GIL.
template <typename F>
auto with_cache(F f) {
  auto& c = cache();
  std::vector<CommunicatorPtr> dropped;
  std::unique_lock<std::mutex> lock(c.mutex);
  auto result = f(c, dropped);
  lock.unlock();
  drop_without_gil(dropped);
  return result;
}

CommunicatorPtr single_locked(CommCache& c) {
  if (!c.single) c.single = Communicator::single();
  return c.single;
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

CommunicatorPtr comm_for_locked(CommCache& c, const py::object& group, double timeout_s,
                                std::vector<CommunicatorPtr>& dropped) {
  if (group.is_none()) return single_locked(c);
  PGPtr pg = to_group(group);
  purge_locked(c, dropped);
  auto it = c.by_group.find(pg.get());
  if (it != c.by_group.end()) return it->second;
  // A group of one rank: the plain single-device losses (no group is kept).
  if (pg->getSize() == 1) return single_locked(c);
  auto ms = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  auto comm = contrax::detail::wrap_process_group(pg, ms);
  c.by_group.emplace(pg.get(), comm);
  return comm;
}

CommunicatorPtr comm_for(const py::object& group, double timeout_s) {
  return with_cache([&](CommCache& c, std::vector<CommunicatorPtr>& dropped) {
    return comm_for_locked(c, group, timeout_s, dropped);
  });
}

py::dict stats_dict(const CommStats& s) {
  py::dict out;
  for (const auto& kv : s.ops) {
    py::dict op;
    op["calls"] = kv.second.calls;
    op["bytes_sent"] = kv.second.bytes_sent;
    out[py::str(kv.first)] = op;
  }
  return out;
}

}  // namespace

void bind_communicator(py::module& m) {
  using namespace pybind11::literals;
  py::class_<Communicator, CommunicatorPtr>(m, "Communicator", "A cached contrax communicator over a process group.")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def_property_readonly("backend", &Communicator::backend)
      .def_property("static_shapes", &Communicator::static_shapes, &Communicator::set_static_shapes,
                    "Every rank passes equal shapes to every loss: the per-call row-count exchange is skipped "
                    "(set it alike on every rank; see contrax/comm/communicator.h)")
      .def("stats", [](const Communicator& c) { return stats_dict(c.stats()); })
      .def("reset_stats", &Communicator::reset_stats);

  m.def("communicator", &comm_for, "group"_a, "timeout_s"_a = 1800.0,
        "The cached communicator for a ProcessGroup (None: world 1).");
  m.def(
      "clear_cache",
      [] {
        with_cache([](CommCache& c, std::vector<CommunicatorPtr>& dropped) {
          for (auto& kv : c.by_group) dropped.push_back(std::move(kv.second));
          c.by_group.clear();
          return true;
        });
      },
      "Drops every cached communicator (and its reference to the process group).");
  m.def("_cache_size", [] {
    return with_cache([](CommCache& c, std::vector<CommunicatorPtr>& dropped) {
      purge_locked(c, dropped);
      return c.by_group.size();
    });
  });
}

}  // namespace contrax::python
