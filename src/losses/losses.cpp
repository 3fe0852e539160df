// The plain entry points of the InfoNCE-family losses (their front ends are
// shared with the tiled entry points: infonce.h), the momentum-encoder helpers
// of MoCo v3, and the loss modules.
#include "contrax/losses/losses.h"

#include <algorithm>
#include <cmath>

#include "losses/infonce.h"

namespace contrax {

torch::Tensor clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias, const ClipLossOptions& options) {
  return detail::clip_front("clip_loss", a, b, logit_scale, logit_bias, options);
}

torch::Tensor nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, const NTXentLossOptions& options) {
  return detail::nt_xent_front("nt_xent_loss", z1, z2, options);
}

torch::Tensor moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                           const torch::Tensor& k2, const MocoV3LossOptions& options) {
  return detail::moco_v3_front("moco_v3_loss", q1, q2, k1, k2, options);
}

void momentum_update(torch::nn::Module& target, const torch::nn::Module& online, double momentum) {
  TORCH_CHECK(momentum >= 0.0 && momentum <= 1.0, "momentum_update(): argument 'momentum' must be in [0, 1], but got ",
              momentum);
  auto tp = target.named_parameters(/*recurse=*/true);
  auto op = online.named_parameters(/*recurse=*/true);
  TORCH_CHECK(tp.size() == op.size(), "momentum_update(): arguments 'target' and 'online' must have the same ",
              "parameters, but target has ", tp.size(), " and online has ", op.size());
  torch::NoGradGuard no_grad;
  for (const auto& item : op) {
    auto* t = tp.find(item.key());
    TORCH_CHECK(t != nullptr, "momentum_update(): parameter '", item.key(), "' of 'online' is missing in 'target'");
    TORCH_CHECK(t->sizes() == item.value().sizes(), "momentum_update(): parameter '", item.key(), "' has shape ",
                t->sizes(), " in 'target' but ", item.value().sizes(), " in 'online'");
    t->mul_(momentum).add_(item.value(), 1.0 - momentum);
  }
}

double momentum_schedule(double base, int64_t step, int64_t total_steps) {
  TORCH_CHECK(base >= 0.0 && base <= 1.0, "momentum_schedule(): argument 'base' must be in [0, 1], but got ", base);
  TORCH_CHECK(total_steps > 0, "momentum_schedule(): argument 'total_steps' must be positive, but got ", total_steps);
  const double t = std::min<double>(std::max<int64_t>(step, 0), total_steps) / static_cast<double>(total_steps);
  return 1.0 - (1.0 - base) * (std::cos(M_PI * t) + 1.0) * 0.5;
}

ClipLossImpl::ClipLossImpl(ClipLossOptions options_, double init_scale, bool with_bias) : options(std::move(options_)) {
  TORCH_CHECK(init_scale > 0.0, "ClipLoss(): argument 'init_scale' must be positive, but got ", init_scale);
  logit_scale = register_parameter("logit_scale", torch::tensor(std::log(init_scale)));
  if (with_bias) logit_bias = register_parameter("logit_bias", torch::tensor(0.0));
}

torch::Tensor ClipLossImpl::forward(const torch::Tensor& a, const torch::Tensor& b) {
  return clip_loss(a, b, logit_scale.to(a.scalar_type()),
                   logit_bias.defined() ? std::make_optional(logit_bias.to(a.scalar_type())) : c10::nullopt, options);
}

torch::Tensor NTXentLossImpl::forward(const torch::Tensor& z1, const torch::Tensor& z2) {
  return nt_xent_loss(z1, z2, options);
}

torch::Tensor MocoV3LossImpl::forward(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                                      const torch::Tensor& k2) {
  return moco_v3_loss(q1, q2, k1, k2, options);
}

}  // namespace contrax
