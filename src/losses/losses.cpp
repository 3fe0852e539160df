// The InfoNCE-family front ends (CLIP / InfoNCE, NT-Xent, MoCo v3), the
// momentum-encoder helpers of MoCo v3, and the loss modules. Each front end
// validates its arguments locally, runs the engine's shared prologue
// (engine/prologue.h: one row-count exchange that also tells every rank about
// a bad argument, the layout, the memory path), gathers what it needs in one
// collective and hands over to the engine (engine/engine.h), which returns
// L_r = (W/B) * sum_{i in r} l_i so that data-parallel gradient averaging
// gives the exact global-batch gradient. fp16/bf16 features are computed in
// fp32 (the loss comes back fp32).
#include "contrax/losses/losses.h"

#include <algorithm>
#include <cmath>

#include "engine/engine.h"
#include "engine/scorer.h"

namespace contrax {

torch::Tensor clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias, const ClipLossOptions& options) {
  using namespace detail;
  const char* caller = "clip_loss";
  NoAutocast no_autocast;
  ArgChecker check(caller);
  check.paired_features(a, "a", b, "b");
  check.scalar(logit_scale, "logit_scale");
  if (logit_bias.has_value()) check.scalar(*logit_bias, "logit_bias");
  check.positive(options.max_logit_scale(), "max_logit_scale");
  if (check.error().empty()) check_labels(check, options.labels(), "labels", a.size(0), a.device());
  check.require(options.labels().defined() || options.label_mode() == LabelMode::kMultiPositive,
                "argument 'label_mode' (kMaskDuplicates) needs 'labels'");
  check_memory_path(check, options.memory());
  if (check.error().empty()) check_matryoshka(check, options.matryoshka(), a.size(1));
  if (check.error().empty()) warn_if_scale_not_log(logit_scale, options.max_logit_scale());

  const auto& comm = options.comm();
  auto counts = agree_on_rows(caller, options.symmetric() ? a : b, options.symmetric() ? "a" : "b", comm,
                              check.error());
  // One [b x B] buffer whichever the direction (see engine/engine.h), per prefix.
  const Scorer scorer(options.matryoshka(), a, /*shared=*/true);
  const auto p = make_prologue(caller, comm, counts, a, options.memory(), logits_blocks("clip") * scorer.blocks());
  auto a_n = prepare(a, p, scorer.normalize_whole(options.normalize()));  // [b, d]
  auto b_n = prepare(b, p, scorer.normalize_whole(options.normalize()));  // [b, d]
  auto scale = clamped_scale(logit_scale, options.max_logit_scale()).to(p.dtype);
  const auto bias = logit_bias.has_value() ? logit_bias->to(p.dtype) : torch::Tensor();
  BlockSpec spec;
  spec.symmetric = options.symmetric();
  spec.reduction = options.reduction();
  spec.label_mode = options.label_mode();
  if (options.labels().defined()) {
    spec.row_labels = options.labels();
    spec.col_labels = gather_labels(options.labels(), comm, counts);  // [B]
  }
  // Only the text tower is gathered (with gradient: its backward reduce-scatters
  // dB_all to the owners); the image-to-text direction is the column softmax of
  // the same block. On the ring the text blocks travel instead.
  auto keys = p.ring ? b_n : gather_rows(b_n, comm, counts, /*with_grad=*/true);  // [B, d]
  return scorer.clip_loss(p, a_n, keys, scale, bias, spec);
}

torch::Tensor nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, const NTXentLossOptions& options) {
  using namespace detail;
  const char* caller = "nt_xent_loss";
  NoAutocast no_autocast;
  ArgChecker check(caller);
  check.features(z1, "z1").features(z2, "z2");
  if (check.error().empty()) check.same_as(z2, "z2", z1, "z1");
  check.positive(options.temperature(), "temperature");
  check_memory_path(check, options.memory());
  if (check.error().empty()) check_matryoshka(check, options.matryoshka(), z1.size(1));
  const auto& comm = options.comm();
  auto counts = agree_on_rows(caller, z1, "z1", comm, check.error());
  // One [2b x 2B] buffer: four [b x B] blocks, per prefix.
  const Scorer scorer(options.matryoshka(), z1);
  const auto p = make_prologue(caller, comm, counts, z1, options.memory(), logits_blocks("nt_xent") * scorer.blocks());
  auto z1n = prepare(z1, p, scorer.normalize_whole(options.normalize()));  // [b, d]
  auto z2n = prepare(z2, p, scorer.normalize_whole(options.normalize()));  // [b, d]
  auto z = torch::cat({z1n, z2n}, 0);                    // [2b, d]
  // Z is gathered once, without gradient: the engine's backward needs no
  // collective (each rank's gradient for its own rows is complete). On the
  // ring every rank's own rows travel instead.
  torch::Tensor z_all;  // [2B, d] = [z1_all; z2_all]
  if (!p.ring) {
    z_all = z.detach();
    if (p.layout.world > 1) {
      const int64_t d = z1.size(1);
      auto all = gather_rows(torch::cat({z1n, z2n}, 1), comm, counts, /*with_grad=*/false);  // [B, 2d]
      z_all = torch::cat({all.narrow(1, 0, d), all.narrow(1, d, d)}, 0);
    }
  }
  // kSum is B times kMean (the per-example loss is the mean of its two views');
  // kNone is the engine's.
  const auto r = options.reduction() == Reduction::kNone ? Reduction::kNone : Reduction::kMean;
  // Every prefix is a unit row; the whole width is one when normalised.
  const bool unit_rows = options.normalize() || !scorer.dot();
  auto loss = scorer.loss(p, {z, z_all}, [&](const auto& f) {
    return nt_xent_block_loss(f[0], f[1], 1.0 / options.temperature(), p, r, unit_rows);
  });
  return options.reduction() == Reduction::kSum ? loss * static_cast<double>(p.layout.total) : loss;
}

torch::Tensor moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                           const torch::Tensor& k2, const MocoV3LossOptions& options) {
  using namespace detail;
  const char* caller = "moco_v3_loss";
  NoAutocast no_autocast;
  ArgChecker check(caller);
  check.features(q1, "q1").features(q2, "q2").features(k1, "k1").features(k2, "k2");
  if (check.error().empty()) {
    check.same_as(q2, "q2", q1, "q1").same_as(k1, "k1", q1, "q1").same_as(k2, "k2", q1, "q1");
  }
  check.positive(options.temperature(), "temperature");
  check_memory_path(check, options.memory());
  if (check.error().empty()) check_matryoshka(check, options.matryoshka(), q1.size(1));
  const auto& comm = options.comm();
  const double T = options.temperature();
  auto counts = agree_on_rows(caller, k1, "k1", comm, check.error());
  // Two [b x B] buffers: the two directions have different keys; per prefix.
  const Scorer scorer(options.matryoshka(), q1);
  const bool normalize = scorer.normalize_whole(options.normalize());
  const auto p = make_prologue(caller, comm, counts, q1, options.memory(), logits_blocks("moco_v3") * scorer.blocks());
  // Keys come from the momentum encoder: constants for this loss, so they are
  // gathered (or passed around the ring) without gradient.
  torch::Tensor k1n, k2n;
  {
    torch::NoGradGuard no_grad;
    k1n = prepare(k1.detach(), p, normalize);
    k2n = prepare(k2.detach(), p, normalize);
  }
  auto inv_t = torch::scalar_tensor(1.0 / T, torch::TensorOptions().dtype(p.dtype).device(q1.device()));
  auto q1n = prepare(q1, p, normalize);
  auto q2n = prepare(q2, p, normalize);
  torch::Tensor k1_keys = k1n, k2_keys = k2n;  // own blocks (ring) or all keys
  if (!p.ring) {
    auto all = gather_rows(torch::cat({k1n, k2n}, 1), comm, counts, /*with_grad=*/false);
    const int64_t d = q1.size(1);
    k1_keys = all.narrow(1, 0, d);  // [B, d]
    k2_keys = all.narrow(1, d, d);  // [B, d]
  }
  BlockSpec spec;  // one direction, no labels
  spec.reduction = options.reduction();
  return scorer.loss(p, {q1n, q2n, k1_keys, k2_keys}, [&](const auto& f) {
    return (clip_block_loss(f[0], f[3], inv_t, torch::Tensor(), p, spec) +
            clip_block_loss(f[1], f[2], inv_t, torch::Tensor(), p, spec)) *
           (2.0 * T);
  });
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
