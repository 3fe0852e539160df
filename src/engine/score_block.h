// InfoNCE over a block of scores that a scorer other than one dot product
// computed (MaxSim, engine/maxsim.h): this rank's b rows against every
// rank's keys in rank order, `group` keys per row, the designated positive of
// global row u at column u g. Internal to the engine (src/engine/), not
// installed.
//
//   l^row_i = lse_j S_ij - S_{i,pos(i)}
//   l^col_j = lse_{every rank's rows u} S_uj - S_{j,j}        (symmetric, g = 1)
//   l_i = l^row_i, or (l^row_i + l^col_{off+i}) / 2, reduced as BlockSpec says.
//
// Backward. The row terms and the designated entries depend on this rank's
// block alone, so autograd differentiates them locally. The column
// log-sum-exps combine every rank's partial ones (all-gathered in the forward,
// [W x N]); under the gradient convention (engine/engine.h) the gradient
// held for rank r's block must be W dL/dS_r with L = (1/W) sum_r' L_r', and
// d lse_col_j / dS_uj = exp(S_uj - lse_col_j), so
//   W dL/dS_r (column part) = exp(S_r - lse_col) * sum_r' dL_r'/d lse_col,
// the upstream gradients of lse_col summed over ranks by an all-reduce
// ([N], O(B)) in the backward: every rank must run it.
#pragma once

#include <torch/torch.h>

#include "engine/block.h"
#include "engine/prologue.h"

namespace contrax::detail {

/// L_r (or this rank's [b] per-row losses with kNone) of scores [b, N] (N = B
/// g), differentiable in them; labels are not supported here (BlockSpec's
/// row_labels undefined).
torch::Tensor score_block_loss(const torch::Tensor& scores, const Prologue& p, const BlockSpec& spec);

}  // namespace contrax::detail
