// The Python binding's parts: one `bind_<header>(m)` per public header it
// exposes, each in python/src/bind_<header>.cpp, and the module function
// (python/src/module.cpp) that only calls them. Python spells the
// vocabulary's enums (contrax/util/vocabulary.h) as strings; their words,
// shared by every loss's function and operator, are in
// python/src/bind_vocabulary.cpp. A loss reaches C++ as a LossCall
// (python/src/bind_losses.cpp makes one per loss from its arguments), which
// the eager function runs and the operators (python/src/ops.cpp) run or
// differentiate. Internal to the binding.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "contrax/comm/communicator.h"
#include "contrax/util/vocabulary.h"

namespace contrax::python {

namespace py = pybind11;

void bind_losses(py::module& m);        // contrax/losses/losses.h, grouped.h, siglip.h
void bind_collectives(py::module& m);   // contrax/comm/collectives.h
void bind_workspace(py::module& m);     // contrax/engine/workspace.h
void bind_communicator(py::module& m);  // contrax/comm/communicator.h and contrax/comm/detail/c10d.h
void bind_ops(py::module& m);           // python/src/ops.cpp: the torch.library operators' group registry

// "mean", "sum", "none"; another string is an argument error naming `caller`
// (ValueError in Python).
Reduction reduction_of(const std::string& s, const std::string& caller);
// "auto", "materialised" (or "materialized"), "tiled".
MemoryPath path_of(const std::string& s, const std::string& caller);
// "multi_positive", "mask_duplicates".
LabelMode label_mode_of(const std::string& s, const std::string& caller);
// The word of a value (the first, where it has two).
const char* word_of(Reduction r);
const char* word_of(MemoryPath p);
const char* word_of(LabelMode m);

using Inputs = std::vector<torch::Tensor>;

// One call of loss `name`: its tensor inputs (an absent optional one
// undefined; the differentiable ones first) and the loss as a function of
// them, its options bound, naming `caller` in its errors.
struct LossCall {
  std::string name;
  Inputs inputs;
  std::function<torch::Tensor(const Inputs&, const std::string& caller)> loss;
};

// The communicator registered under a process group's name ("" is a world of
// 1: none); an unknown or destroyed one is an error naming `caller`.
CommunicatorPtr group_named(const std::string& name, const std::string& caller);
// The operators' kernels (python/src/ops.cpp): the loss's value without
// recording, and the gradients of its first `n_grad` inputs given the
// upstream gradient.
torch::Tensor loss_value(const LossCall& call);
std::vector<torch::Tensor> loss_backward(const torch::Tensor& grad, const LossCall& call, size_t n_grad);

}  // namespace contrax::python
