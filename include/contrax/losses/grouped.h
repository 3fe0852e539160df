// Grouped candidates (hard negatives): the DPR / Tevatron retrieval loss.
//
// Each query comes with g candidates, its positive first and then g-1 hard
// negatives; every candidate of every rank is a negative of every other query
// (in-batch negatives across the whole global batch). Same engine, gradient
// convention and memory paths as `clip_loss` (contrax/losses/losses.h).
#pragma once

#include <torch/torch.h>

#include "contrax/comm/communicator.h"
#include "contrax/losses/losses.h"

namespace contrax {

/// Options for `grouped_loss`. Defaults: scale clamped at 100, no normalisation,
/// world 1, automatic memory path, mean reduction, no labels.
struct GroupedLossOptions : detail::WithMemoryPath<GroupedLossOptions>, detail::WithMatryoshka<GroupedLossOptions> {
  /// The scale exp(logit_scale) is clamped to at most this.
  TORCH_ARG(double, max_logit_scale) = 100.0;
  /// L2-normalise queries and candidates inside the loss.
  TORCH_ARG(bool, normalize) = false;
  /// Process group; null means single device.
  TORCH_ARG(CommunicatorPtr, comm) = nullptr;
  /// Reduction of the per-query losses (mean over the global number of queries).
  TORCH_ARG(Reduction, reduction) = Reduction::kMean;
  /// Optional int64 [b_r]: the id of each query's positive.
  TORCH_ARG(torch::Tensor, labels) = {};
  /// Optional int64 [b_r * g]: the id of each candidate (needed with `labels`
  /// when g > 1; with g == 1 it defaults to `labels`).
  TORCH_ARG(torch::Tensor, candidate_labels) = {};
  /// Meaning of a candidate whose id equals the query's label (other than the
  /// query's own positive): masked out (default) or another positive.
  TORCH_ARG(LabelMode, label_mode) = LabelMode::kMaskDuplicates;
};

/// DPR/Tevatron-style query loss.
///
/// queries: [b_r, d]; candidates: [b_r * g, d] grouped per query (rows
/// i*g .. i*g+g-1 belong to query i: its positive first, then g-1 hard
/// negatives). g is inferred, must divide exactly and be the same on every
/// rank. Logits: queries x ALL ranks' candidates, scale
/// min(exp(logit_scale), max_logit_scale), optional 0-dim bias.
/// l_i = lse_i - S_{i, pos(i)}; the mean is over the global number of queries.
///
///   auto loss = contrax::grouped_loss(q, cands, logit_scale, {},
///                                     contrax::GroupedLossOptions().comm(comm));
///   loss.backward();
torch::Tensor grouped_loss(const torch::Tensor& queries, const torch::Tensor& candidates,
                           const torch::Tensor& logit_scale,
                           const c10::optional<torch::Tensor>& logit_bias = c10::nullopt,
                           const GroupedLossOptions& options = {});

}  // namespace contrax
