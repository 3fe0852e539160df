// How the engine scores a loss's rows against its keys: one dot product of
// the whole width, or Matryoshka's nested prefixes (MatryoshkaOptions in
// contrax/util/vocabulary.h). Every front end passes its block call through
// the one Scorer, so no loss walks its prefixes itself. Internal to the engine
// (src/engine/), not installed.
//
// Prefixes. With widths m_1 < ... < m_P = d and weights w_p, the loss is
//   L = sum_p w_p L_p,  L_p = the loss's block on x[:, :m_p] / ||x[:, :m_p]||
// for every feature set x (queries, keys, gathered or not). L2 normalisation
// is row-wise, so normalising a prefix of the gathered rows equals gathering
// the normalised prefixes: the full-width features are gathered once and
// every prefix is cut and normalised from them on each rank. The gradient is
// autograd's through the cut and the normalisation: each block returns its
// exact (gradient-convention) L_p, the weighted sum is linear, and the
// gathered keys' gradients from every prefix add up before the one
// reduce-scatter of their gather. Each prefix's block keeps its own logits
// buffer until the backward (materialised path), so the routing counts P
// blocks (`blocks()`).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

#include "engine/prologue.h"
#include "util/check.h"

namespace contrax::detail {

class Scorer {
 public:
  /// Scores of checked Matryoshka options over features `width` wide.
  Scorer(const MatryoshkaOptions& matryoshka, int64_t width) : prefixes_(matryoshka_prefixes(matryoshka, width)) {}

  /// One dot product of the whole width (no prefixes).
  bool dot() const { return prefixes_.empty(); }
  /// The prefixes, widest last; empty for dot().
  const std::vector<Prefix>& prefixes() const { return prefixes_; }
  /// How many logits blocks the loss holds per block of its own (P, or 1).
  int64_t blocks() const { return dot() ? 1 : static_cast<int64_t>(prefixes_.size()); }
  /// Whether the front end normalises the whole width (`normalize` and no
  /// prefixes: each prefix normalises its own cut instead).
  bool normalize_whole(bool normalize) const { return normalize && dot(); }

  using Block = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;
  /// block(features) for dot(); otherwise sum_p w_p block(the features' first
  /// m_p columns, rows L2-normalised in the compute dtype, then in the operand
  /// dtype, as `prepare` does). Undefined features stay undefined.
  torch::Tensor loss(const Prologue& p, const std::vector<torch::Tensor>& features, const Block& block) const;

 private:
  std::vector<Prefix> prefixes_;
};

}  // namespace contrax::detail
