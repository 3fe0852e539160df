// MaxSim on the engine's tiled walk (engine/tiled_blocks.h): the tiled and
// ring routes of maxsim_loss. A TileScorer scores each step of queries x
// documents by MaxSim in one panel of token work (engine/maxsim.h); the walk,
// the online log-sum-exps, the softmax gradient and the ring are the tiled
// CLIP / InfoNCE / grouped block's. Internal to the engine (src/engine/), not
// installed.
//
// Packing. The walk moves key blocks as rows of a 2-D tensor (gathered with
// gradient, or around the ring with their gradient accumulators), so each
// document travels as one row [its Ld d token entries | Ld mask entries (1
// valid, 0 padding) | its floor, with a finite padding_score] in the compute
// dtype: its mask and floor go where its tokens go, for about 1/d more bytes,
// and their gradient entries stay 0. The queries are rows [b, Lq d].
//
// Steps. A step of R queries x C documents holds its [R Lq x C Ld] token
// scores at once, so the steps are pair_step's (engine/panels.h) within
// panel_bytes, at Lq max(Ld, d) e bytes a pair (the backward also holds the
// chosen tokens' rows, [R Lq C, d], as the materialised backward's panels do),
// and at most the tile side a side. Memory: the [R x C] logits, one panel of
// token work and this rank's [b] statistics besides the documents (every
// rank's when gathered, one or two ranks' blocks on the ring), never the
// [b x B g] scores.
//
// Backward. A step's logits are S = s M (s the scale, M its MaxSim scores);
// the block (engine/block.h) turns the recomputed S into G = dL/dS, and the
// scorer sends it on:
//   dL/dM = s G, through the step's arg-max (maxsim_panel_backward, derived
//     in engine/maxsim.h), into the queries' rows and the block's tokens;
//   dL/ds = sum over the steps of sum_ij G_ij M_ij.
// The step's panel (arg-max, M) is the one its backward's logits computed
// (kept for that step only): one token GEMM per step in the backward, as in
// the forward.
#pragma once

#include <torch/torch.h>

#include "engine/block.h"
#include "engine/prologue.h"

namespace contrax::detail {

/// Bytes of token work a pair (query, document) takes in a step: Lq max(Ld,
/// width) elements of `element_size` (the walk's pair_bytes).
int64_t maxsim_pair_bytes(int64_t Lq, int64_t Ld, int64_t width, int64_t element_size);

/// maxsim_loss on its tiled route (p.tiled; the ring with p.ring): InfoNCE as
/// `spec` says over the logits scale * MaxSim(q_i, d_j) of this rank's queries
/// [b, Lq, d] (token weights `query_weight` [b, Lq]) against every rank's
/// documents, from this rank's [b g, Ld, d] (Ld the same on every rank;
/// `document_mask` bool [b g, Ld]; `floor` [b g] or undefined): gathered with
/// gradient, or travelling around the ring. Differentiable in queries,
/// documents and `scale` (0-dim, the scale itself). Steps of `panel_bytes`
/// of token work, at most p.walk's tile side a side.
torch::Tensor tiled_maxsim_loss(const torch::Tensor& queries, const torch::Tensor& query_weight,
                                const torch::Tensor& documents, const torch::Tensor& document_mask,
                                const torch::Tensor& floor, const torch::Tensor& scale, const Prologue& p,
                                const BlockSpec& spec, int64_t panel_bytes);

}  // namespace contrax::detail
