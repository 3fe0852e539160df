// Exact distributed contrastive losses: CLIP/InfoNCE, NT-Xent (SimCLR), MoCo v3.
//
// Every loss computes `[local x global]` logits: a rank's local rows against the
// gathered rows of all ranks, with the positive of local row i at global column
// off_r + i. Rank r returns L_r = (W/B) * sum_{i in r} l_i so that the average
// over ranks (what data-parallel gradient averaging computes) is the mean loss
// over the global batch, exactly, also when ranks hold different row counts.
// With a null or world-1 communicator these are the ordinary single-device
// losses.
#pragma once

#include <torch/torch.h>

#include "contrax/comm/communicator.h"
#include "contrax/util/vocabulary.h"

namespace contrax {

// ---- CLIP / InfoNCE

/// Options for `clip_loss`.
///
/// Defaults: symmetric, scale clamped at 100, no normalisation, world 1, the
/// automatic memory path (`memory()`: MemoryPathOptions in contrax/util/vocabulary.h,
/// or its shorthands `path()`, `tile_size()`, `ring()`, ...) and one dot product
/// of the whole width (`matryoshka()`: MatryoshkaOptions, the nested prefixes
/// of Matryoshka representation learning), as for every loss below.
struct ClipLossOptions : detail::WithMemoryPath<ClipLossOptions>, detail::WithMatryoshka<ClipLossOptions> {
  /// true: (CE(a->b) + CE(b->a)) / 2. false: CE(a->b) only (InfoNCE, retrieval).
  TORCH_ARG(bool, symmetric) = true;
  /// The scale exp(logit_scale) is clamped to at most this (CLIP uses 100).
  TORCH_ARG(double, max_logit_scale) = 100.0;
  /// L2-normalise both feature sets inside the loss (before the gather).
  TORCH_ARG(bool, normalize) = false;
  /// Process group; null means single device.
  TORCH_ARG(CommunicatorPtr, comm) = nullptr;
  /// Reduction of the per-row losses (per row: the mean of its two directions
  /// when symmetric).
  TORCH_ARG(Reduction, reduction) = Reduction::kMean;
  /// Optional int64 [b_r]: this rank's rows' labels (row i of a and of b share
  /// label i); gathered inside. Rows with equal labels are positives of each
  /// other or masked, as `label_mode` says.
  TORCH_ARG(torch::Tensor, labels) = {};
  /// Meaning of equal labels; used only with `labels`.
  TORCH_ARG(LabelMode, label_mode) = LabelMode::kMultiPositive;
};

/// Symmetric CLIP loss over the global batch.
///
/// a, b: [b_r, d] paired features (row i of a matches row i of b).
/// logit_scale: 0-dim, the *log* of the scale (CLIP's learnable parameter);
///   the logits are a @ b_all^T * min(exp(logit_scale), max_logit_scale).
/// logit_bias: optional 0-dim bias added to every logit.
///
///   auto loss = contrax::clip_loss(img, txt, model->logit_scale, {},
///                                  contrax::ClipLossOptions().comm(comm));
///   loss.backward();
torch::Tensor clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias = c10::nullopt,
                        const ClipLossOptions& options = {});

// ---- NT-Xent (SimCLR)

/// Options for `nt_xent_loss`. Defaults: temperature 0.1, normalise, world 1.
struct NTXentLossOptions : detail::WithMemoryPath<NTXentLossOptions>, detail::WithMatryoshka<NTXentLossOptions> {
  /// Softmax temperature; must be > 0.
  TORCH_ARG(double, temperature) = 0.1;
  /// L2-normalise the projections inside the loss (cosine similarity).
  TORCH_ARG(bool, normalize) = true;
  /// Process group; null means single device.
  TORCH_ARG(CommunicatorPtr, comm) = nullptr;
  /// Reduction over the B examples (per example: the mean of its two views'
  /// losses).
  TORCH_ARG(Reduction, reduction) = Reduction::kMean;
};

/// SimCLR's NT-Xent over the global batch of 2B views.
///
/// z1, z2: [b_r, d], the two views' projections (row i of z1 and z2 come from
/// the same image). For view-1 row i the logits are [z1_i.z2_all | z1_i.z1_all]/T
/// with its own column in the second block masked out; likewise for view 2;
/// the loss is the mean over all 2B rows.
///
///   auto loss = contrax::nt_xent_loss(p1, p2,
///       contrax::NTXentLossOptions().temperature(0.2).comm(comm));
torch::Tensor nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, const NTXentLossOptions& options = {});

// ---- MoCo v3

/// Options for `moco_v3_loss`. Defaults: temperature 1.0 (MoCo v3 ViT uses 0.2),
/// normalise, world 1.
struct MocoV3LossOptions : detail::WithMemoryPath<MocoV3LossOptions>, detail::WithMatryoshka<MocoV3LossOptions> {
  /// Softmax temperature; must be > 0.
  TORCH_ARG(double, temperature) = 1.0;
  /// L2-normalise queries and keys inside the loss.
  TORCH_ARG(bool, normalize) = true;
  /// Process group; null means single device.
  TORCH_ARG(CommunicatorPtr, comm) = nullptr;
  /// Reduction over the B examples (per example: 2T (l(q1_i, k2) + l(q2_i, k1))).
  TORCH_ARG(Reduction, reduction) = Reduction::kMean;
};

/// MoCo v3's symmetrised loss ctr(q1, k2) + ctr(q2, k1), where
/// ctr(q, k) = CE(q @ k_all^T / T, positives) * 2T and the keys (momentum
/// encoder outputs) are gathered without gradient.
///
/// q1, q2: [b_r, d] queries (with gradient); k1, k2: [b_r, d] keys (treated as
/// constants).
///
///   auto loss = contrax::moco_v3_loss(q1, q2, k1, k2,
///       contrax::MocoV3LossOptions().temperature(0.2).comm(comm));
torch::Tensor moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                           const torch::Tensor& k2, const MocoV3LossOptions& options = {});

/// Momentum (EMA) update: target = m * target + (1 - m) * online, parameter by
/// parameter, without gradient. Both modules must have the same parameter
/// names and shapes (checked). Buffers are not touched: the target keeps its
/// own (e.g. its BatchNorm running statistics).
void momentum_update(torch::nn::Module& target, const torch::nn::Module& online, double momentum);

/// MoCo v3's cosine momentum schedule: m(t) = 1 - (1 - base) * (cos(pi t / T) + 1) / 2,
/// rising from `base` at step 0 to 1 at `total_steps`.
double momentum_schedule(double base, int64_t step, int64_t total_steps);

// ---- Modules

/// Module form of `clip_loss` that owns the learnable logit scale (initialised
/// to log(1/0.07) as in CLIP) and, when `with_bias`, a bias (SigLIP-style init 0).
class ClipLossImpl : public torch::nn::Module {
 public:
  /// Registers `logit_scale` as the parameter log(`init_scale`) (`init_scale` > 0)
  /// and, when `with_bias`, `logit_bias` as the parameter 0.
  explicit ClipLossImpl(ClipLossOptions options = {}, double init_scale = 1.0 / 0.07, bool with_bias = false);
  /// `clip_loss(a, b, logit_scale, logit_bias, options)`, the parameters cast to a's dtype.
  torch::Tensor forward(const torch::Tensor& a, const torch::Tensor& b);
  /// The options every forward passes to `clip_loss`.
  ClipLossOptions options;
  /// The learnable log of the logit scale (0-dim parameter).
  torch::Tensor logit_scale;
  /// The learnable logit bias (0-dim parameter); undefined unless `with_bias`.
  torch::Tensor logit_bias;
};
TORCH_MODULE(ClipLoss);

/// Module form of `nt_xent_loss` (it has no parameters).
class NTXentLossImpl : public torch::nn::Module {
 public:
  /// Keeps the options every forward passes to `nt_xent_loss`.
  explicit NTXentLossImpl(NTXentLossOptions options = {}) : options(std::move(options)) {}
  /// `nt_xent_loss(z1, z2, options)`.
  torch::Tensor forward(const torch::Tensor& z1, const torch::Tensor& z2);
  /// The options every forward passes to `nt_xent_loss`.
  NTXentLossOptions options;
};
TORCH_MODULE(NTXentLoss);

/// Module form of `moco_v3_loss` (it has no parameters).
class MocoV3LossImpl : public torch::nn::Module {
 public:
  /// Keeps the options every forward passes to `moco_v3_loss`.
  explicit MocoV3LossImpl(MocoV3LossOptions options = {}) : options(std::move(options)) {}
  /// `moco_v3_loss(q1, q2, k1, k2, options)`.
  torch::Tensor forward(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                        const torch::Tensor& k2);
  /// The options every forward passes to `moco_v3_loss`.
  MocoV3LossOptions options;
};
TORCH_MODULE(MocoV3Loss);

}  // namespace contrax
