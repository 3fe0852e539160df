// Late-interaction contrastive loss (ColBERT, ColPali, PyLate): multi-vector
// queries and documents scored by MaxSim, InfoNCE over the global batch.
//
// score(i, j) = sum over query i's valid tokens of the largest dot product
// with document j's valid tokens (divided by query i's valid-token count
// with `normalize_scores`); logits = score * exp(logit_scale) (clamped at
// max_logit_scale) or score / temperature. Documents are grouped per query
// (its positive first, then g - 1 hard negatives; g = 1 for in-batch
// negatives only), and every document of every rank is a negative of every
// other query. Exact across ranks with uneven batches: rank r returns
// L_r = (W/B) sum_{i in r} l_i as every Contrax loss does. Memory: the token
// scores exist only in panels of at most `panel_bytes`, never per pair of the
// batch. The memory path (`memory()`, as every loss's) decides the rest:
// materialised, every rank's documents are gathered and the [b x B g] scores
// held; tiled, the documents are gathered but the scores are walked in steps
// (online log-sum-exps, recomputed in the backward); ring, the documents
// (tokens, masks, floors) travel between neighbours with their gradients
// instead of being gathered, so a rank holds one or two ranks' documents.
#pragma once

#include <torch/torch.h>

#include <limits>

#include "contrax/comm/communicator.h"
#include "contrax/util/vocabulary.h"

namespace contrax {

/// Options for `maxsim_loss`. Defaults: temperature 1, sum over query tokens,
/// one direction, mean, world 1, token-score panels of 16 MiB, the automatic
/// memory path (materialised while the [b x B g] scores of the largest rank
/// take at most `max_logits_bytes`, else tiled; `ring(true)` for the ring).
struct MaxSimLossOptions : detail::WithMemoryPath<MaxSimLossOptions> {
  /// Logits are score / temperature when no logit_scale is passed; > 0.
  TORCH_ARG(double, temperature) = 1.0;
  /// With a logit_scale: the scale exp(logit_scale) is clamped to at most this.
  TORCH_ARG(double, max_logit_scale) = 100.0;
  /// Divide each query's score by its number of valid tokens (the mean over
  /// its tokens rather than the sum).
  TORCH_ARG(bool, normalize_scores) = false;
  /// (CE(query -> document) + CE(document -> query)) / 2; needs g = 1.
  TORCH_ARG(bool, symmetric) = false;
  /// Reduction of the per-query losses (mean over the global number of queries).
  TORCH_ARG(Reduction, reduction) = Reduction::kMean;
  /// Optional bool [b_r, Lq]: the queries' valid tokens (default all).
  TORCH_ARG(torch::Tensor, query_mask) = {};
  /// Optional bool [b_r g, Ld]: the documents' valid tokens (default all);
  /// every document needs one while padding_score is -inf. Ranks may pad to
  /// different Ld.
  TORCH_ARG(torch::Tensor, document_mask) = {};
  /// What a masked document token scores against every query token: -inf
  /// (default: it never counts), or a number, e.g. 0 as PyLate and
  /// colpali-engine score padding (their masks zero the token scores, so a
  /// query token's score is at least 0 against a padded document).
  TORCH_ARG(double, padding_score) = -std::numeric_limits<double>::infinity();
  /// Budget in bytes of one panel of token scores (forward and backward).
  TORCH_ARG(int64_t, panel_bytes) = int64_t{16} << 20;
  /// Process group; null means single device.
  TORCH_ARG(CommunicatorPtr, comm) = nullptr;
};

/// queries: [b_r, Lq, d]; documents: [b_r g, Ld, d] grouped per query;
/// logit_scale: optional 0-dim log of the scale (learnable), else 1/temperature.
///
///   auto loss = contrax::maxsim_loss(q_tokens, d_tokens, c10::nullopt,
///       contrax::MaxSimLossOptions().temperature(0.02).query_mask(qm).document_mask(dm).comm(comm));
///   // documents around the ring instead of gathered:
///   auto ring = contrax::maxsim_loss(q_tokens, d_tokens, c10::nullopt,
///       contrax::MaxSimLossOptions().document_mask(dm).ring(true).comm(comm));
torch::Tensor maxsim_loss(const torch::Tensor& queries, const torch::Tensor& documents,
                          const c10::optional<torch::Tensor>& logit_scale = c10::nullopt,
                          const MaxSimLossOptions& options = {});

}  // namespace contrax
