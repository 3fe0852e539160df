// SigLIP: the pairwise sigmoid loss, on every loss's memory paths.
//
// Every pair (i, j) of the global batch is an independent binary problem,
// positive when i == j: loss = -(1/B) sum_i sum_j log sigmoid(z_ij (s a_i.b_j + bias)),
// z_ij = +1 on the diagonal, -1 elsewhere, s = exp(logit_scale). No softmax
// couples a row, so with `ring` a rank needs no gathered keys at all: the b
// blocks travel around the ring as in contrax/losses/tiled.h, with their partial
// gradients in the backward. Tiled memory is O(b x tile), with at most two
// remote blocks on the ring. Without `ring` the b rows are gathered once (their
// gradient reduce-scattered back); the materialised path takes the whole
// [b x B] block as one tile.
//
// Rank r returns L_r = -(W/B) sum_{i in r} sum_j log sigmoid(...), so averaging
// gradients over ranks gives exactly the single-device loss on the concatenated
// batch, also when ranks hold different numbers of rows.
#pragma once

#include <torch/torch.h>

#include <limits>

#include "contrax/comm/communicator.h"
#include "contrax/util/vocabulary.h"

namespace contrax {

/// Options for `siglip_loss`.
///
/// Defaults: no clamp of the scale, no normalisation, world 1, the automatic
/// memory path (MemoryPathOptions in contrax/util/vocabulary.h).
struct SigLipLossOptions : detail::WithMemoryPath<SigLipLossOptions>, detail::WithMatryoshka<SigLipLossOptions> {
  /// exp(logit_scale) is clamped to at most this (default: no clamp).
  TORCH_ARG(double, max_logit_scale) = std::numeric_limits<double>::infinity();
  /// L2-normalise both feature sets inside the loss.
  TORCH_ARG(bool, normalize) = false;
  /// Process group; null means single device.
  TORCH_ARG(CommunicatorPtr, comm) = nullptr;
};

/// SigLIP loss over the global batch.
///
/// a, b: [b_r, d] paired features (row i of a matches row i of b).
/// logit_scale: 0-dim, the log of the scale t' (SigLIP initialises it to log 10).
/// logit_bias: optional 0-dim bias (SigLIP initialises it to -10); absent = 0.
/// Differentiable once in a, b, logit_scale and logit_bias.
///
///   auto loss = contrax::siglip_loss(img, txt, t_prime, bias,
///                                    contrax::SigLipLossOptions().comm(comm));
///   loss.backward();
torch::Tensor siglip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                          const c10::optional<torch::Tensor>& logit_bias = c10::nullopt,
                          const SigLipLossOptions& options = {});

/// Module form of `siglip_loss` owning the learnable log-scale (init log 10)
/// and bias (init -10), as in the SigLIP paper.
///
///   contrax::SigLipLoss loss_fn(contrax::SigLipLossOptions().comm(comm));
///   auto loss = loss_fn(img, txt);
class SigLipLossImpl : public torch::nn::Module {
 public:
  /// Registers `logit_scale` as the parameter log(`init_scale`) (`init_scale` > 0)
  /// and `logit_bias` as the parameter `init_bias`.
  explicit SigLipLossImpl(SigLipLossOptions options = {}, double init_scale = 10.0, double init_bias = -10.0);
  /// `siglip_loss(a, b, logit_scale, logit_bias, options)`, the parameters cast to a's dtype.
  torch::Tensor forward(const torch::Tensor& a, const torch::Tensor& b);
  /// The options every forward passes to `siglip_loss`.
  SigLipLossOptions options;
  /// The learnable log of the scale t' (0-dim parameter).
  torch::Tensor logit_scale;
  /// The learnable bias (0-dim parameter).
  torch::Tensor logit_bias;
};
TORCH_MODULE(SigLipLoss);

}  // namespace contrax
