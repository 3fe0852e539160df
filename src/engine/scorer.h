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
// reduce-scatter of their gather.
//
// The CLIP / InfoNCE / grouped block shares one pass over the width between
// its prefixes where engine/prefix_block.h takes it (the CPU's materialised
// route, features in the compute dtype): one [b x N] buffer and about 1.2
// GEMMs' worth of width per GEMM of the single product. Elsewhere (the tiled
// and ring routes, a GPU, NT-Xent, MoCo v3, SigLIP) each prefix's block runs
// in turn, and on the materialised route keeps its own logits buffer until
// the backward, so the routing counts P blocks (`blocks()`).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

#include "engine/block.h"
#include "engine/prologue.h"
#include "util/check.h"

namespace contrax::detail {

class Scorer {
 public:
  /// Scores of checked Matryoshka options over features like `features`
  /// ([n, width]); `shared`: the loss's block is the CLIP / InfoNCE one
  /// (clip_loss below), which may share one pass between its prefixes.
  Scorer(const MatryoshkaOptions& matryoshka, const torch::Tensor& features, bool shared = false);

  /// One dot product of the whole width (no prefixes).
  bool dot() const { return prefixes_.empty(); }
  /// The prefixes, widest last; empty for dot().
  const std::vector<Prefix>& prefixes() const { return prefixes_; }
  /// How many logits blocks the loss holds per block of its own (P, or 1).
  /// (The shared pass: its one buffer.)
  int64_t blocks() const { return dot() || shared_ ? 1 : static_cast<int64_t>(prefixes_.size()); }
  /// Whether the front end normalises the whole width (`normalize` and no
  /// prefixes: each prefix normalises its own cut instead).
  bool normalize_whole(bool normalize) const { return normalize && dot(); }

  using Block = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;
  /// block(features) for dot(); otherwise sum_p w_p block(the features' first
  /// m_p columns, rows L2-normalised in the compute dtype, then in the operand
  /// dtype, as `prepare` does). Undefined features stay undefined.
  torch::Tensor loss(const Prologue& p, const std::vector<torch::Tensor>& features, const Block& block) const;

  /// The CLIP / InfoNCE block (clip_block_loss, engine/engine.h) of queries
  /// `q` against every rank's keys `keys` (the ring: this rank's), through
  /// loss() or the shared pass.
  torch::Tensor clip_loss(const Prologue& p, const torch::Tensor& q, const torch::Tensor& keys,
                          const torch::Tensor& scale, const torch::Tensor& bias, const BlockSpec& spec) const;

 private:
  std::vector<Prefix> prefixes_;
  bool shared_ = false;  // a candidate for the shared pass (prefix_pass_candidate)
};

}  // namespace contrax::detail
