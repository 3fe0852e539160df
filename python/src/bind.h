// The Python binding's parts: one `bind_<header>(m)` per public header it
// exposes, each in python/src/bind_<header>.cpp, and the module function
// (python/src/module.cpp) that only calls them. Python spells the
// vocabulary's enums (contrax/util/vocabulary.h) as strings; their parsers, shared
// by every loss binding, are in python/src/bind_vocabulary.cpp. Internal to
// the binding.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <string>

#include "contrax/util/vocabulary.h"

namespace contrax::python {

namespace py = pybind11;

void bind_losses(py::module& m);        // contrax/losses/losses.h
void bind_grouped(py::module& m);       // contrax/losses/grouped.h
void bind_siglip(py::module& m);        // contrax/losses/siglip.h
void bind_collectives(py::module& m);   // contrax/comm/collectives.h
void bind_workspace(py::module& m);     // contrax/engine/workspace.h
void bind_communicator(py::module& m);  // contrax/comm/communicator.h and contrax/comm/detail/c10d.h

// "mean", "sum", "none"; another string is an argument error naming `caller`
// (ValueError in Python).
Reduction reduction_of(const std::string& s, const char* caller);
// "auto", "materialised" (or "materialized"), "tiled".
MemoryPath path_of(const std::string& s, const char* caller);
// "multi_positive", "mask_duplicates".
LabelMode label_mode_of(const std::string& s, const char* caller);

// The memory path every loss binding takes the same way.
template <typename Options>
Options& set_memory_path(Options& o, const std::string& path, int64_t tile_size, bool ring, const char* caller) {
  return o.path(path_of(path, caller)).tile_size(tile_size).ring(ring);
}

}  // namespace contrax::python
