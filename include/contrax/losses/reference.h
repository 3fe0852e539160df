// Single-device reference losses on the whole global batch, written the
// textbook way ([B x B] logits, mean reductions) and independently of the
// distributed code. `contrax verify` and the tests compare against these.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <limits>
#include <vector>

#include "contrax/losses/losses.h"

namespace contrax::reference {

/// CLIP: s = min(exp(logit_scale), max_scale); logits = s * a b^T (+ bias), [B, B];
/// mean CE over rows (and over columns when symmetric, averaged).
torch::Tensor clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias, bool symmetric = true,
                        double max_scale = 100.0, bool normalize = false);

/// SimCLR: z = [z1; z2] ([2B, d]), sim = z z^T / T with the diagonal removed,
/// positive of row i is i + B (and of i + B is i); mean CE over 2B rows.
torch::Tensor nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, double temperature,
                           bool normalize = true);

/// MoCo v3: ctr(q, k) = mean CE(q k^T / T, diag) * 2T on normalised q, k;
/// loss = ctr(q1, k2) + ctr(q2, k1); keys are constants.
torch::Tensor moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                           const torch::Tensor& k2, double temperature, bool normalize = true);

/// SigLIP: logits = exp(logit_scale) * a b^T + bias, [B, B];
/// loss = -(1/B) sum_ij log sigmoid(z_ij * logits_ij), z = +1 on the diagonal, -1 off it.
torch::Tensor siglip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                          const c10::optional<torch::Tensor>& logit_bias, bool normalize = false);

/// Per-row InfoNCE losses of a [R, C] logits matrix with the positive set
/// `positive` (bool [R, C], non-empty rows) and the entries `masked` (bool or
/// undefined) removed from the softmax: l_i = logsumexp_j(logits_ij, j not
/// masked) - mean_{j: positive_ij} logits_ij. [R].
torch::Tensor info_nce_rows(const torch::Tensor& logits, const torch::Tensor& positive, const torch::Tensor& masked);

/// CLIP / InfoNCE per-row losses ([B]) with optional labels: every pair of rows
/// with equal labels is a positive pair (kMultiPositive) or masked
/// (kMaskDuplicates); row i's own pair always stays a positive. Symmetric: the
/// mean of row i's image-to-text and text-to-image (column i) losses.
torch::Tensor clip_rows(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias, bool symmetric, double max_scale,
                        bool normalize, const torch::Tensor& labels = {},
                        LabelMode mode = LabelMode::kMultiPositive);

/// Grouped (DPR) per-query losses ([B]): queries [B, d], candidates [B g, d],
/// query i's positive is candidate i g; logits queries x all candidates.
/// labels [B] / candidate_labels [B g] (optional): candidates whose label equals
/// the query's are masked or extra positives, as `mode` says.
torch::Tensor grouped_rows(const torch::Tensor& queries, const torch::Tensor& candidates,
                           const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                           double max_scale, bool normalize, const torch::Tensor& labels = {},
                           const torch::Tensor& candidate_labels = {}, LabelMode mode = LabelMode::kMaskDuplicates);

/// Matryoshka: sum_p w_p loss(every feature set's first m_p columns, each row
/// L2-normalised), a plain loop over the prefixes m_p: `dims` (any order, with
/// `weights`, 1 each when empty) and the full width, weight 1, when `dims`
/// omits it.
torch::Tensor matryoshka(const std::vector<int64_t>& dims, const std::vector<double>& weights,
                         const std::vector<torch::Tensor>& features,
                         const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& loss);

/// MaxSim scores [n, m] the textbook way: every token score of every pair at
/// once (einsum, [n, m, Lq, Ld]), invalid document tokens at -inf, the
/// maximum over document tokens summed over valid query tokens. Masks: bool
/// [n, Lq] and [m, Ld].
/// `padding_score`: what a masked document token scores against every query
/// token (-inf: it never counts; maxsim_loss's option of the same name).
torch::Tensor maxsim_scores(const torch::Tensor& queries, const torch::Tensor& query_mask,
                            const torch::Tensor& documents, const torch::Tensor& document_mask,
                            double padding_score = -std::numeric_limits<double>::infinity());

/// Per-query InfoNCE losses ([n]) of logits [n, n g] whose designated
/// positive of row i is column i g; symmetric (g = 1): the mean with the
/// column's (column i's positive is row i).
torch::Tensor score_rows(const torch::Tensor& logits, bool symmetric);

/// Mean, sum or (kNone) the rows themselves.
torch::Tensor reduce(const torch::Tensor& rows, Reduction reduction);

}  // namespace contrax::reference
