// Dropout whose mask is a fixed function of (example id, feature, salt): any
// chunking of the batch and any partition over ranks sees the masks of the
// full batch, and no generator is shared between rank threads. What the data
// parallel and gradient-cache tests train through to stay exact with dropout.
#pragma once

#include <torch/torch.h>

namespace contrax::testing {

/// h [B, d] with each entry kept where a hash of (ids[i], j, salt) >= p, scaled
/// by 1 / (1 - p). The hash runs in fp64 whatever h's dtype (bf16 under
/// autocast would change the mask).
inline torch::Tensor hashed_dropout(const torch::Tensor& h, const torch::Tensor& ids, double p, double salt) {
  auto j = torch::arange(h.size(1), torch::kDouble);
  auto u = torch::frac(torch::sin(ids.to(torch::kDouble).unsqueeze(1) * 12.9898 + j.unsqueeze(0) * 78.233 + salt) *
                       43758.5453)
               .abs();
  return h * ((u >= p).to(h.scalar_type()) / (1.0 - p));
}

}  // namespace contrax::testing
