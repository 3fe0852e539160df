// What verify's case files share (src/check/verify.cpp: the dot-product
// losses and the gradient cache; src/check/verify_scorer_cases.cpp: the
// scorers beyond one dot product). Internal, not installed.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "contrax/check/verify.h"

namespace contrax::detail {

/// Labels derived from the rows themselves (the signs of the first two
/// features: 4 classes, so a batch of a dozen rows has many duplicates), so
/// that every rank and the reference agree on them without sending them.
torch::Tensor labels_of(const torch::Tensor& x /* [n, d] */);

/// Appends the Matryoshka and MaxSim cases, in verify's order.
void add_scorer_cases(std::vector<VerifyCase>& cases);

}  // namespace contrax::detail
