// The Scorer (engine/scorer.h): a loss's block over one dot product of the
// whole width or over each Matryoshka prefix.
#include "engine/scorer.h"

#include "engine/engine.h"
#include "engine/prefix_block.h"

namespace contrax::detail {

Scorer::Scorer(const MatryoshkaOptions& matryoshka, const torch::Tensor& features, bool shared)
    : prefixes_(matryoshka_prefixes(matryoshka, features.size(1))),
      shared_(shared && !prefixes_.empty() && prefix_pass_candidate(features)) {}

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


torch::Tensor Scorer::clip_loss(const Prologue& p, const torch::Tensor& q, const torch::Tensor& keys,
                                const torch::Tensor& scale, const torch::Tensor& bias, const BlockSpec& spec) const {
  if (shared_ && prefix_pass_takes(p, q)) return prefix_clip_block(q, keys, scale, bias, p.layout, spec, prefixes_);
  return loss(p, {q, keys}, [&](const auto& f) { return clip_block_loss(f[0], f[1], scale, bias, p, spec); });
}

}  // namespace contrax::detail
