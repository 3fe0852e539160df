// SigLIP's pairwise sigmoid loss (see contrax/losses/siglip.h): the front end
// (checks, the shared prologue of engine/prologue.h, the keys gathered or left
// for the ring) and the module; the block is the engine's
// (engine/siglip_block.cpp, behind the seam engine/engine.h).
#include "contrax/losses/siglip.h"

#include <cmath>
#include <optional>
#include <utility>

#include "engine/engine.h"
#include "engine/scorer.h"
#include "engine/prologue.h"

namespace contrax {

torch::Tensor siglip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                          const c10::optional<torch::Tensor>& logit_bias, const SigLipLossOptions& options) {
  detail::NoAutocast no_autocast;
  const char* caller = "siglip_loss";
  detail::ArgChecker check(caller);
  check.paired_features(a, "a", b, "b");
  check.scalar(logit_scale, "logit_scale");
  if (logit_bias.has_value()) check.scalar(*logit_bias, "logit_bias");
  check.require(options.max_logit_scale() > 0.0, "argument 'max_logit_scale' must be positive, but got ",
                options.max_logit_scale());
  detail::check_memory_path(check, options.memory());
  if (check.error().empty()) detail::check_matryoshka(check, options.matryoshka(), a.size(1));
  const auto& comm = options.comm();
  auto counts = detail::agree_on_rows(caller, check.error().empty() ? b : torch::Tensor(), "b", comm, check.error());
  // One [b x B] logits block when materialised, per prefix.
  const detail::Scorer scorer(options.matryoshka(), a);
  const auto p = detail::make_prologue(caller, comm, counts, a, options.memory(),
                                       detail::logits_blocks("siglip") * scorer.blocks());
  // The engine's precision policy (engine/precision.h): normalised in the
  // compute dtype without overflow, gathered and multiplied in the operand dtype.
  const bool normalize = scorer.normalize_whole(options.normalize());
  auto a_n = detail::prepare(a, p, normalize), b_n = detail::prepare(b, p, normalize);
  auto keys = p.ring ? b_n : detail::gather_rows(b_n, comm, counts, /*with_grad=*/true);
  auto scale = detail::clamped_scale(logit_scale, options.max_logit_scale());  // NaN stays NaN
  const auto bias = logit_bias.has_value() ? std::make_optional(logit_bias->to(p.dtype)) : c10::nullopt;
  scale = scale.to(p.dtype);
  return scorer.loss(p, {a_n, keys},
                     [&](const auto& f) { return detail::siglip_block_loss(f[0], f[1], scale, bias, p); });
}

SigLipLossImpl::SigLipLossImpl(SigLipLossOptions options_, double init_scale, double init_bias)
    : options(std::move(options_)) {
  TORCH_CHECK(init_scale > 0.0, "SigLipLoss(): argument 'init_scale' must be positive, but got ", init_scale);
  logit_scale = register_parameter("logit_scale", torch::tensor(std::log(init_scale)));
  logit_bias = register_parameter("logit_bias", torch::tensor(init_bias));
}

torch::Tensor SigLipLossImpl::forward(const torch::Tensor& a, const torch::Tensor& b) {
  return siglip_loss(a, b, logit_scale.to(a.scalar_type()), logit_bias.to(a.scalar_type()), options);
}

}  // namespace contrax
