// What a contrastive loss will cost before it runs: for a global batch B of
// width d over W ranks, the bytes each memory path holds per rank, the GEMM
// work, the bytes each rank sends forward and backward, and which path the
// automatic routing of clip_loss / nt_xent_loss / moco_v3_loss / maxsim_loss
// picks (the same rule the losses apply, from the largest rank's row count).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "contrax/util/vocabulary.h"

namespace contrax {

/// Options for `plan_loss`. Defaults: symmetric CLIP, B = 8192, d = 256,
/// W = 1, fp32, the losses' default memory path (`memory()` and its
/// shorthands, as in the losses' options: MemoryPathOptions).
///
///   auto p = contrax::plan_loss(contrax::PlanOptions().batch(32768).world(4));
///   std::cout << contrax::to_string(p);
struct PlanOptions : detail::WithMemoryPath<PlanOptions>, detail::WithMatryoshka<PlanOptions> {
  /// "clip" (symmetric), "infonce" (one direction), "grouped" (one direction,
  /// `group` candidates per query: grouped_loss), "nt_xent", "moco_v3",
  /// "siglip" or "maxsim" (maxsim_loss, one direction, `group` documents per
  /// query, padding_score -inf: query_tokens x document_tokens of `width`).
  TORCH_ARG(std::string, loss) = "clip";
  /// grouped and maxsim only: candidates per query (its positive and group - 1 hard negatives).
  TORCH_ARG(int64_t, group) = 1;
  /// maxsim only: tokens per query (Lq).
  TORCH_ARG(int64_t, query_tokens) = 32;
  /// maxsim only: tokens per document (Ld).
  TORCH_ARG(int64_t, document_tokens) = 256;
  /// maxsim only: the budget of one panel of token scores (MaxSimLossOptions::panel_bytes).
  TORCH_ARG(int64_t, token_panel_bytes) = int64_t{16} << 20;
  /// Global batch B (rows per view); ranks hold ceil(B/W) or floor(B/W) rows.
  TORCH_ARG(int64_t, batch) = 8192;
  /// Feature width d (columns of each feature row).
  TORCH_ARG(int64_t, width) = 256;
  /// World size W (ranks).
  TORCH_ARG(int64_t, world) = 1;
  /// Feature dtype; fp16/bf16 are computed in fp32 (the engine's rule).
  TORCH_ARG(c10::ScalarType, dtype) = c10::kFloat;
  /// Where the features live: on CUDA, fp16/bf16 features are gathered and
  /// multiplied in their own dtype (half the bytes of fp32), and the logits
  /// are walked in row panels sized from the panel budget; on the CPU in fp32,
  /// in cache-sized tiles.
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// The panel budget to plan with on CUDA; 0: the automatic budget of the
  /// GPU planned for (1 GiB, 1.5 GiB from 40 GB; see gpu_memory), or
  /// loss_panel_bytes() when set.
  TORCH_ARG(int64_t, panel_bytes) = 0;
  /// The memory in bytes of the GPU to plan for on CUDA (it sizes the
  /// automatic panel budget); 0: this machine's GPU, or where none is visible
  /// kReferenceGpuMemory (an 80 GB A100/H100), which LossPlan::budget_source says.
  TORCH_ARG(int64_t, gpu_memory) = 0;
};

/// The GPU a CUDA plan assumes where none is visible: 80 GB (A100 80GB, H100).
constexpr int64_t kReferenceGpuMemory = int64_t{80} * 1000 * 1000 * 1000;

/// One path's cost for the rank with the most rows.
struct PathCost {
  std::string path;           ///< "materialised", "tiled" or "ring"
  int64_t logits_bytes = 0;   ///< bytes of logits-sized buffers held at once
  int64_t feature_bytes = 0;  ///< bytes of gathered features and their gradient
  double gemm_flops = 0;      ///< floating-point operations (2 per multiply-add) of every GEMM, forward and backward
  /// GEMMs in units of one [b x B x d] product (grouped: g per [b x B g x d]);
  /// maxsim: of one token product [b Lq x B g Ld x d]
  int64_t gemms = 0;
  /// Bytes this rank sends in the forward, on the bandwidth-optimal schedule (as CommStats counts them).
  int64_t bytes_sent_forward = 0;
  int64_t bytes_sent_backward = 0;  ///< bytes this rank sends in the backward, counted the same way
  bool available = true;            ///< false where the path cannot run (the ring needs W > 1)
  /// Steps of one walk over the logits (the forward's; the backward walks
  /// as many): CPU tiles, or on CUDA row panels of every column of a block.
  int64_t panels = 0;
  /// Rows of each step (the last may be shorter).
  int64_t panel_rows = 0;
  /// Columns of each step: every column of a block on CUDA, a tile's on the CPU.
  int64_t panel_cols = 0;
  /// Bytes the walk holds at once beside the features: a step's logits and
  /// their temporaries (tiled, ring), or the logits buffer plus a panel's
  /// temporaries (materialised).
  int64_t workspace_bytes = 0;
  /// Kernel launches of a forward + backward on a GPU (the ATen operators
  /// that launch work, and the panel kernels'), estimated from the same walk:
  /// the prologue's fixed count plus, per step, its GEMMs and element-wise
  /// passes (the ATen forms, or the fused kernels where on: LossPlan::fused;
  /// src/check/plan.cpp derives the counts; the ring's from W = 2, its
  /// sends and receives not counted). -1 where not modelled: the CPU's walk
  /// (no launches; its tiles run fused kernels).
  int64_t launches = 0;
};

/// The cost of a loss call on each memory path, for the rank with the most
/// rows, and the path the loss would take (plan_loss()).
struct LossPlan {
  PlanOptions options;          ///< the options planned for
  int64_t rows_per_rank = 0;    ///< rows of the largest rank: ceil(B / W)
  std::vector<PathCost> paths;  ///< the cost of each path
  std::string chosen;           ///< the path the loss would run with these options
  /// The old algorithm's GEMMs for the same loss (both directions with their
  /// own products; NT-Xent's four [b x B] products), for comparison.
  int64_t old_gemms = 0;
  /// Whether the walk's element-wise passes are the fused CUDA panel kernels
  /// (a CUDA plan with the kernels built and switched on:
  /// CONTRAX_FUSED_KERNELS=1): panels without ATen temporaries, fewer
  /// launches, and SigLIP's gradient GEMMs in the forward.
  bool fused = false;
  /// CUDA: the panel budget planned with, in bytes (0 on the CPU).
  int64_t panel_budget = 0;
  /// CUDA: where panel_budget came from (panel_bytes, this machine's GPU,
  /// gpu_memory, or the 80 GB GPU assumed where none is visible); empty on the CPU.
  std::string budget_source;
};

/// Plans a loss call. Throws on an unknown loss or a non-positive size.
LossPlan plan_loss(const PlanOptions& options);

/// Human-readable table.
std::string to_string(const LossPlan& plan);
/// One JSON object.
std::string to_json(const LossPlan& plan);

}  // namespace contrax
