// The Scorer (engine/scorer.h): a loss's block over one dot product of the
// whole width or over each Matryoshka prefix.
#include "engine/scorer.h"

namespace contrax::detail {

torch::Tensor Scorer::loss(const Prologue& p, const std::vector<torch::Tensor>& features, const Block& block) const {
  if (dot()) return block(features);
  torch::Tensor total;
  std::vector<torch::Tensor> cut(features.size());
  for (const auto& prefix : prefixes_) {
    for (size_t f = 0; f < features.size(); ++f) {
      cut[f] = features[f].defined() ? prepare(features[f].narrow(1, 0, prefix.dim), p, /*normalize=*/true)
                                     : torch::Tensor();
    }
    auto l = block(cut);
    if (prefix.weight != 1.0) l = l * prefix.weight;
    total = total.defined() ? total + l : l;
  }
  return total;
}

}  // namespace contrax::detail
