// What verify's case files share (src/check/verify.cpp: the dot-product
// losses and the gradient cache; src/check/verify_scorer_cases.cpp: the
// scorers beyond one dot product). Internal, not installed.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "contrax/check/verify.h"

namespace contrax::detail {

/// Labels derived from the rows themselves (the signs of the first two
/// features: 4 classes, so a batch of a dozen rows has many duplicates), so
/// that every rank and the reference agree on them without sending them.
torch::Tensor labels_of(const torch::Tensor& x /* [n, d] */);

/// A loss over the gradient cache's two towers' outputs ([n, 8] each) and the
/// learnt logit scale; `comm` null for the reference.
using TowerLoss = std::function<torch::Tensor(const std::vector<torch::Tensor>& towers,
                                              const torch::Tensor& logit_scale, const CommunicatorPtr& comm)>;

/// The gradient cache's case (C++ GradCache, DataParallel towers, chunks of
/// 4 and 5 rows) of two MLP towers d -> 12 -> 8 under `loss`, against
/// `reference` on the concatenated batch.
VerifyCase grad_cache_case(std::string name, const TowerLoss& loss, const TowerLoss& reference);

/// Appends the Matryoshka and MaxSim cases, in verify's order.
void add_scorer_cases(std::vector<VerifyCase>& cases);

}  // namespace contrax::detail
