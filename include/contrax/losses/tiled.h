// Memory-bounded (tiled) InfoNCE, CLIP, NT-Xent and MoCo v3, and the ring that
// moves key blocks between neighbours instead of gathering them.
//
// The materialised losses build `[b x B]` logits; at a global batch of 32768 in
// fp32 that is 4 GiB per direction before the softmax and its gradient double
// it. The tiled path never holds more than one `[tile x tile]` block of logits:
// the forward accumulates every row's log-sum-exp over column tiles (each tile's
// LSE combined with the running one by logaddexp, the stable online form) and
// saves only the inputs and that per-row LSE; the backward recomputes each
// tile's probabilities p = exp(logits - lse) and accumulates dq, dk and the
// scale gradient from them. Values and gradients equal the materialised path
// up to floating-point reassociation.
//
// With `ring` (MemoryPathOptions) the keys are not gathered at all: each rank's key
// block travels once around the ring (send to rank+1, receive from rank-1,
// overlapped with the tile computation of the block in hand), and in the
// backward the key blocks travel again together with their partial gradients,
// which arrive summed at their owner. Memory then holds at most two remote key
// blocks (and two partial key-gradient blocks) instead of all B keys. NT-Xent
// and MoCo v3 send no gradient blocks: NT-Xent's keys are its own rows without
// gradient (each rank's gradient is complete from its own logits and every
// row's log-sum-exp), MoCo's keys have none; their blocks travel again alone.
//
// The per-rank weighting is the materialised losses' one, L_r = (W/B) sum l_i,
// so routing `clip_loss` & co. here changes nothing for the caller. Every loss
// takes this path with `path(MemoryPath::kTiled)` (or `kAuto` when its logits
// would not fit); this header adds the InfoNCE core with arbitrary offsets.
#pragma once

#include <torch/torch.h>

#include "contrax/comm/communicator.h"
#include "contrax/losses/losses.h"

namespace contrax {

/// Options of the InfoNCE core `tiled_info_nce`.
///
/// Defaults: positive of row i at key column i, nothing masked, automatic tile,
/// no communicator (k holds every key). Its memory path is the tiled one:
/// `tile_size` and `tile_bytes` size the tiles, `path` must not be
/// kMaterialised, and with a communicator of W > 1 the key blocks always
/// travel around the ring (`ring` is implied).
struct InfoNceOptions : detail::WithMemoryPath<InfoNceOptions> {
  /// The positive of query row i is key column `positive_offset + i`. With a
  /// ring communicator the column is counted inside this rank's own key block.
  TORCH_ARG(int64_t, positive_offset) = 0;
  /// When >= 0, key column `masked_offset + i` is excluded from row i's softmax
  /// (NT-Xent's self-similarity); counted like `positive_offset`.
  TORCH_ARG(int64_t, masked_offset) = -1;
  /// Null or world 1: `k` holds every key. Otherwise `k` is this rank's key
  /// block and the blocks of all ranks are visited around the ring.
  TORCH_ARG(CommunicatorPtr, comm) = nullptr;
};

/// Per-row InfoNCE losses without materialising the logits:
/// l_i = log sum_j exp(s q_i.k_j + bias) - (s q_i.k_{p+i} + bias), `[b]`.
///
/// q: [b, d] queries. k: [N, d] keys (this rank's block in ring mode).
/// scale: 0-dim, the scale s itself (not its log), differentiable.
/// bias: optional 0-dim logit bias (it cancels in the value; its gradient is
///   the rounding-level sum_i g_i (sum_j p_ij - 1), returned for completeness).
/// Differentiable in q, k, scale and bias once; double backward is an error.
///
///   auto l = contrax::tiled_info_nce(q, k_all, scale, {},
///                                    contrax::InfoNceOptions().positive_offset(off));
torch::Tensor tiled_info_nce(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                             const c10::optional<torch::Tensor>& bias = c10::nullopt,
                             const InfoNceOptions& options = {});

}  // namespace contrax
