// Single-device reference losses on the whole global batch, written the
// textbook way ([B x B] logits, mean reductions) and independently of the
// distributed code. `contrax verify` and the tests compare against these.
#pragma once

#include <torch/torch.h>

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

}  // namespace contrax::reference
