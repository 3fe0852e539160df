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
// With `TiledOptions::ring` the keys are not gathered at all: each rank's key
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
// so routing `clip_loss` & co. here changes nothing for the caller.
#pragma once

#include <torch/torch.h>

#include "contrax/comm/communicator.h"
#include "contrax/losses/losses.h"

namespace contrax {

/// How the tiled losses walk the logits.
///
/// Defaults: tiles chosen so that one `[tile x tile]` logits block takes about
/// 16 MiB (2048 x 2048 in fp32), keys gathered (not ring).
///
///   auto loss = contrax::tiled_clip_loss(a, b, logit_scale, {},
///       contrax::ClipLossOptions().comm(comm), contrax::TiledOptions().ring(true));
struct TiledOptions {
  /// Rows and columns of one logits tile; 0 picks it from `tile_bytes`.
  TORCH_ARG(int64_t, tile_size) = 0;
  /// Budget of one logits tile when `tile_size` is 0 (at least 64 x 64 is used).
  TORCH_ARG(int64_t, tile_bytes) = int64_t{16} << 20;
  /// Distributed only: pass key blocks around the ring instead of gathering
  /// them (bytes 3(W-1) blocks instead of 2(W-1), memory 2 remote blocks
  /// instead of W). Every rank must pass the same value.
  TORCH_ARG(bool, ring) = false;
};

/// Options of the InfoNCE core `tiled_info_nce`.
///
/// Defaults: positive of row i at key column i, nothing masked, automatic tile,
/// no communicator (k holds every key).
struct InfoNceOptions {
  /// The positive of query row i is key column `positive_offset + i`. With a
  /// ring communicator the column is counted inside this rank's own key block.
  TORCH_ARG(int64_t, positive_offset) = 0;
  /// When >= 0, key column `masked_offset + i` is excluded from row i's softmax
  /// (NT-Xent's self-similarity); counted like `positive_offset`.
  TORCH_ARG(int64_t, masked_offset) = -1;
  /// Side of a logits tile; 0 (default) chooses it from `tile_bytes`.
  TORCH_ARG(int64_t, tile_size) = 0;
  /// Budget of one logits tile when `tile_size` is 0.
  TORCH_ARG(int64_t, tile_bytes) = int64_t{16} << 20;
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

/// `clip_loss` computed tile by tile (and, with `tiled.ring()`, with the keys
/// travelling around the ring). Same arguments, options and value.
///
///   auto loss = contrax::tiled_clip_loss(img, txt, logit_scale, {},
///       contrax::ClipLossOptions().comm(comm), contrax::TiledOptions().tile_size(1024));
torch::Tensor tiled_clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                              const c10::optional<torch::Tensor>& logit_bias = c10::nullopt,
                              const ClipLossOptions& options = {}, const TiledOptions& tiled = {});

/// `nt_xent_loss` computed tile by tile; the self column is masked by index,
/// never by a buffer.
///
///   auto loss = contrax::tiled_nt_xent_loss(p1, p2, contrax::NTXentLossOptions().comm(comm));
torch::Tensor tiled_nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2,
                                 const NTXentLossOptions& options = {}, const TiledOptions& tiled = {});

/// `moco_v3_loss` computed tile by tile; keys stay constants.
///
///   auto loss = contrax::tiled_moco_v3_loss(q1, q2, k1, k2,
///       contrax::MocoV3LossOptions().temperature(0.2).comm(comm));
torch::Tensor tiled_moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                                 const torch::Tensor& k2, const MocoV3LossOptions& options = {},
                                 const TiledOptions& tiled = {});

}  // namespace contrax
