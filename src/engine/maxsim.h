// Late interaction's score, MaxSim (ColBERT, ColPali, PyLate), computed panel
// by panel: score(i, j) = sum over query i's valid tokens t of the largest
// dot product q_it . d_js over document j's valid tokens s. The token scores
// of a pair ([Lq x Ld]) exist only inside one panel of queries x documents
// whose token scores fit a byte budget, in the forward and again in the
// backward (which recomputes them): memory O(budget + b x N) whatever the
// batch. The tiled and ring routes score their steps with the same panels
// (engine/maxsim_tiles.h). Internal to the engine (src/engine/), not installed.
//
// Backward. With s*(i, j, t) the first valid s reaching the maximum (as
// torch.max returns it), dscore_ij / dq_it = m_it d_{j s*} and
// dscore_ij / dd_js = sum_t m_it [s*(i, j, t) = s] q_it (m: the query token's
// weight: its mask, divided by the query's token count with normalize_scores),
// (where a document's floor exceeds every valid token's score the maximum
// is that constant and sends nothing), so for the upstream G = dL/dscore
//   dq_it = m_it sum_j G_ij d_{j s*(i,j,t)},  dd_js = sum_i G_ij sum_t m_it [s*(i,j,t) = s] q_it,
// i.e. per panel, with a_itj = G_ij m_it (0 where the floor wins): gather
// each query token's best document token d_{j s*} and take
// dq_it = sum_j a_itj d_{j s*} (a batched [1 x pj] x [pj x d] product), and
// index-add a_itj q_it into the row of d_{j s*}: O(pi Lq pj d) work, where
// the dense [pi Lq x pj Ld] gradient of the token scores would multiply Ld
// times as much, almost all of it zeros.
#pragma once

#include <torch/torch.h>

#include "engine/prologue.h"

namespace contrax::detail {

/// One panel of MaxSim's token work: every query token's largest score
/// against each document of the panel, and where it was reached.
struct MaxSimPanel {
  torch::Tensor best;  // [pi, Lq, pj] the largest token score of each query token (at least the floor)
  torch::Tensor at;    // [pi, Lq, pj] which document token (the first maximum)
  torch::Tensor won;   // [pi, Lq, pj] whether a valid token reached it (undefined without a floor: always)
};

/// The panel of queries [pi, Lq, d] against documents [pj, Ld, d] (any
/// strides; valid tokens `document_mask`, bool [pj, Ld]); its token scores
/// ([pi Lq x pj Ld]) exist only inside this call. `floor`: [pj], or empty
/// for none.
MaxSimPanel maxsim_panel(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& document_mask,
                         const torch::Tensor& floor);

/// [pi, pj] scores of a panel: sum_t weight_it best_itj (weight [pi, Lq]: the
/// query mask, divided by the token count with normalize_scores).
torch::Tensor maxsim_panel_scores(const MaxSimPanel& p, const torch::Tensor& weight);

/// The panel's backward (derivation above) for the upstream g = dL/dscore
/// [pi, pj]: adds dq_it = sum_j a_itj d_{j s*} into `dq` ([pi, Lq, d]) and,
/// where `dd` (the documents' tokens as rows, [pj Ld, d]) is defined,
/// a_itj q_it into the row of d_{j s*}.
void maxsim_panel_backward(const MaxSimPanel& p, const torch::Tensor& g, const torch::Tensor& weight,
                           const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& dq,
                           const torch::Tensor& dd);

/// [n, m] MaxSim scores of queries [n, Lq, d] (token weights `query_weight`
/// [n, Lq]: 0 for a masked token) against documents [m, Ld, d]
/// (document_mask [m, Ld]), differentiable in both feature tensors; token
/// scores in panels of at most `panel_bytes`. `floor` (undefined, or [m]):
/// each query token's score against document j is at least floor_j (a
/// constant: where it wins, no gradient flows; a valid token that ties it
/// wins); without it every document has a valid token.
torch::Tensor maxsim_scores(const torch::Tensor& queries, const torch::Tensor& query_weight,
                            const torch::Tensor& documents, const torch::Tensor& document_mask,
                            const torch::Tensor& floor, int64_t panel_bytes, const EngineLayout& layout);

}  // namespace contrax::detail
