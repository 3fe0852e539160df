// GroupNorm followed by ReLU as one autograd function on the CPU, for the
// encoder of the image recipes (models.h), which keeps its activations in the
// channels-last layout.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace contrax::train {

/// relu(group_norm(x, groups, weight, bias, eps)) as one autograd function on
/// the CPU (float or double), computed per example in the channels-last layout
/// (the output is channels-last). It keeps only x and two numbers per group
/// for its backward, where torch's pair keeps x and the output; its backward
/// is two passes over x and dy instead of three, and takes a gradient that is
/// broadcast over H and W (the backward of a sum over the map) without
/// expanding it. Derivation in src/train/image/group_norm_relu.cpp.
torch::Tensor group_norm_relu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                              int64_t groups, double eps = 1e-5);

}  // namespace contrax::train
