// Materialised `[local x global]` contrastive losses: CLIP/InfoNCE, NT-Xent,
// MoCo v3, and the momentum-encoder helpers.
//
// Each loss validates its arguments locally, shares the verdict with every
// rank while exchanging row counts (so one rank's bad input is an error on all
// ranks, not a hang), gathers what it needs in one collective, and returns
// L_r = (W/B) * sum_{i in r} l_i so that data-parallel gradient averaging gives
// the exact global-batch gradient.
#include "contrax/losses.h"

#include <cmath>
#include <limits>

#include "contrax/collectives.h"
#include "contrax/detail/check.h"
#include "contrax/tiled.h"

namespace contrax {

namespace F = torch::nn::functional;

namespace {

int64_t world_of(const CommunicatorPtr& comm) { return comm ? comm->world_size() : 1; }

torch::Tensor maybe_normalize(const torch::Tensor& x, bool normalize) {
  return normalize ? F::normalize(x, F::NormalizeFuncOptions().dim(1)) : x;
}

// Sum over local rows of -log softmax(logits_i)[off + i]: cross-entropy with the
// positive of local row i at global column off + i.
torch::Tensor ce_sum(const torch::Tensor& logits /* [b, B] */, int64_t offset) {
  auto labels = torch::arange(offset, offset + logits.size(0),
                              torch::TensorOptions().dtype(torch::kLong).device(logits.device()));
  return F::cross_entropy(logits, labels, F::CrossEntropyFuncOptions().reduction(torch::kSum));
}

// Gathers `local` (with or without gradient) and checks that every rank agrees
// on the arguments first. Returns the gathered rows, counts and offset.
// `checked` is the user's argument named `arg` (what error messages describe);
// `local` is what is gathered (e.g. both towers side by side), same rows.
std::vector<int64_t> exchange_checked(const torch::Tensor& checked, const CommunicatorPtr& comm, const char* caller,
                                      const char* arg, const std::string& local_error) {
  auto counts = detail::exchange_row_counts(checked, comm, caller, arg, local_error);
  int64_t total = 0;
  for (auto c : counts) total += c;
  TORCH_CHECK(total > 0, caller, "(): the global batch is empty (every rank passed 0 rows)");
  return counts;
}

Gathered gather_checked(const std::vector<int64_t>& counts, const torch::Tensor& local, const CommunicatorPtr& comm,
                        bool with_grad) {
  // The counts are now known to be consistent; the gathers below re-check
  // only in debug-worthy cases, so skip their exchange by using the raw path.
  Gathered g;
  g.counts = counts;
  const int64_t W = world_of(comm);
  if (W == 1) {
    g.all = with_grad ? local : local.detach();
    return g;
  }
  for (int64_t s = 0; s < comm->rank(); ++s) g.offset += counts[s];
  if (with_grad) {
    g.all = detail::gather_rows_with_grad(local, comm, counts);
  } else {
    torch::NoGradGuard no_grad;
    g.all = comm->all_gather_rows(local.detach(), counts, "all_gather_no_grad");
  }
  return g;
}

// Decides, identically on every rank (from the exchanged counts), whether to
// take the tiled path. `blocks` is how many [b x B] logits blocks the
// materialised loss keeps alive (2 for two directions or two views).
template <typename Options>
bool use_tiled(const Options& o, const std::vector<int64_t>& counts, int64_t element_size, int64_t blocks) {
  if (o.tile_size() > 0 || o.ring()) return true;
  if (o.tile_size() < 0) return false;
  int64_t B = 0, bmax = 0;
  for (auto c : counts) {
    B += c;
    bmax = std::max(bmax, c);
  }
  return bmax * B * element_size * blocks > o.max_logits_bytes();
}

template <typename Options>
TiledOptions tiled_of(const Options& o) {
  return TiledOptions().tile_size(std::max<int64_t>(o.tile_size(), 0)).ring(o.ring());
}

template <typename Options>
std::string check_path_options(const Options& o, const char* caller) {
  if (o.tile_size() < -1) return c10::str(caller, "(): argument 'tile_size' must be -1, 0 or positive, but got ", o.tile_size());
  if (o.max_logits_bytes() <= 0) {
    return c10::str(caller, "(): argument 'max_logits_bytes' must be positive, but got ", o.max_logits_bytes());
  }
  if (o.ring() && o.tile_size() < 0) return c10::str(caller, "(): 'ring' needs the tiled path, but 'tile_size' is -1");
  return "";
}

}  // namespace

// ---------------------------------------------------------------------------

torch::Tensor clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias, const ClipLossOptions& options) {
  const char* caller = "clip_loss";
  detail::ArgChecker check(caller);
  check.paired_features(a, "a", b, "b");
  check.scalar(logit_scale, "logit_scale");
  if (logit_bias.has_value()) check.scalar(*logit_bias, "logit_bias");
  check.positive(options.max_logit_scale(), "max_logit_scale");

  std::string error = check.error().empty() ? check_path_options(options, caller) : check.error();

  const auto& comm = options.comm();
  auto counts = exchange_checked(options.symmetric() ? a : b, comm, caller, options.symmetric() ? "a" : "b", error);
  if (use_tiled(options, counts, a.element_size(), options.symmetric() ? 2 : 1)) {
    return tiled_clip_loss(a, b, logit_scale, logit_bias, options, tiled_of(options));
  }
  auto a_n = maybe_normalize(a, options.normalize());
  auto b_n = maybe_normalize(b, options.normalize());
  const int64_t d = a.size(1);

  // One gather for both towers when both directions are needed.
  torch::Tensor a_all, b_all;
  Gathered g;
  if (options.symmetric()) {
    g = gather_checked(counts, torch::cat({a_n, b_n}, 1), comm, /*with_grad=*/true);
    a_all = g.all.narrow(1, 0, d);
    b_all = g.all.narrow(1, d, d);
  } else {
    g = gather_checked(counts, b_n, comm, /*with_grad=*/true);
    b_all = g.all;
  }
  const int64_t B = g.total();
  const int64_t W = world_of(comm);

  auto scale = logit_scale.exp().clamp_max(options.max_logit_scale());
  // Scale the [b, d] operand rather than the [b, B] product.
  auto logits_ab = torch::mm(a_n * scale, b_all.t());  // [b, B]
  if (logit_bias.has_value()) logits_ab = logits_ab + *logit_bias;
  auto total = ce_sum(logits_ab, g.offset);
  if (options.symmetric()) {
    auto logits_ba = torch::mm(b_n * scale, a_all.t());  // [b, B]
    if (logit_bias.has_value()) logits_ba = logits_ba + *logit_bias;
    total = (total + ce_sum(logits_ba, g.offset)) * 0.5;
  }
  return total * (static_cast<double>(W) / static_cast<double>(B));
}

// ---------------------------------------------------------------------------

torch::Tensor nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, const NTXentLossOptions& options) {
  const char* caller = "nt_xent_loss";
  detail::ArgChecker check(caller);
  check.features(z1, "z1").features(z2, "z2");
  if (check.error().empty()) check.same_as(z2, "z2", z1, "z1");
  check.positive(options.temperature(), "temperature");

  std::string error = check.error().empty() ? check_path_options(options, caller) : check.error();
  const auto& comm = options.comm();
  auto counts = exchange_checked(z1, comm, caller, "z1", error);
  if (use_tiled(options, counts, z1.element_size(), 2)) return tiled_nt_xent_loss(z1, z2, options, tiled_of(options));
  auto z1n = maybe_normalize(z1, options.normalize());
  auto z2n = maybe_normalize(z2, options.normalize());
  const int64_t d = z1.size(1);
  auto g = gather_checked(counts, torch::cat({z1n, z2n}, 1), comm, /*with_grad=*/true);
  auto z1_all = g.all.narrow(1, 0, d);  // [B, d]
  auto z2_all = g.all.narrow(1, d, d);  // [B, d]
  const int64_t B = g.total();
  const int64_t W = world_of(comm);
  const int64_t b = z1.size(0);
  const double inv_t = 1.0 / options.temperature();

  // For a view-v row i the softmax runs over [other view (B) | same view (B)]
  // with its own same-view column off + i removed. Rather than materialise the
  // [b, 2B] concatenation, combine the two blocks' log-sum-exps.
  auto rows = torch::arange(b, torch::TensorOptions().dtype(torch::kLong).device(z1.device()));
  auto cols = rows + g.offset;
  auto view_loss = [&](const torch::Tensor& q, const torch::Tensor& other_all, const torch::Tensor& same_all) {
    auto qs = q * inv_t;
    auto cross = torch::mm(qs, other_all.t());  // [b, B]
    auto self = torch::mm(qs, same_all.t());    // [b, B]
    // -inf is exact in every floating dtype (unlike a large negative constant)
    // and contributes exp(-inf) = 0 to the softmax and to its gradient.
    self.index_put_({rows, cols}, -std::numeric_limits<double>::infinity());
    auto lse = torch::logaddexp(cross.logsumexp(1), self.logsumexp(1));  // [b]
    auto positive = cross.diagonal(g.offset);                              // [b]: (i, off + i)
    return (lse - positive).sum();
  };
  auto total = view_loss(z1n, z2_all, z1_all) + view_loss(z2n, z1_all, z2_all);
  return total * (static_cast<double>(W) / (2.0 * static_cast<double>(B)));
}

// ---------------------------------------------------------------------------

torch::Tensor moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                           const torch::Tensor& k2, const MocoV3LossOptions& options) {
  const char* caller = "moco_v3_loss";
  detail::ArgChecker check(caller);
  check.features(q1, "q1").features(q2, "q2").features(k1, "k1").features(k2, "k2");
  if (check.error().empty()) {
    check.same_as(q2, "q2", q1, "q1").same_as(k1, "k1", q1, "q1").same_as(k2, "k2", q1, "q1");
  }
  check.positive(options.temperature(), "temperature");
  std::string error = check.error().empty() ? check_path_options(options, caller) : check.error();
  const auto& comm = options.comm();
  const double T = options.temperature();
  auto counts = exchange_checked(k1, comm, caller, "k1", error);
  if (use_tiled(options, counts, q1.element_size(), 2)) {
    return tiled_moco_v3_loss(q1, q2, k1, k2, options, tiled_of(options));
  }

  // Keys come from the momentum encoder: constants for this loss, so they are
  // gathered without gradient and nothing flows back to other ranks.
  torch::Tensor keys;
  {
    torch::NoGradGuard no_grad;
    keys = torch::cat({maybe_normalize(k1.detach(), options.normalize()),
                       maybe_normalize(k2.detach(), options.normalize())}, 1);
  }
  auto g = gather_checked(counts, keys, comm, /*with_grad=*/false);
  const int64_t d = q1.size(1);
  auto k1_all = g.all.narrow(1, 0, d);
  auto k2_all = g.all.narrow(1, d, d);
  const int64_t B = g.total();
  const int64_t W = world_of(comm);

  auto ctr = [&](const torch::Tensor& q, const torch::Tensor& k_all) {
    auto qn = maybe_normalize(q, options.normalize());
    return ce_sum(torch::mm(qn * (1.0 / T), k_all.t()), g.offset);  // logits [b, B]
  };
  auto total = ctr(q1, k2_all) + ctr(q2, k1_all);
  return total * (2.0 * T * static_cast<double>(W) / static_cast<double>(B));
}

// ---------------------------------------------------------------------------

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
    TORCH_CHECK(t->sizes() == item.value().sizes(), "momentum_update(): parameter '", item.key(),
                "' has shape ", t->sizes(), " in 'target' but ", item.value().sizes(), " in 'online'");
    t->mul_(momentum).add_(item.value(), 1.0 - momentum);
  }
}

double momentum_schedule(double base, int64_t step, int64_t total_steps) {
  TORCH_CHECK(base >= 0.0 && base <= 1.0, "momentum_schedule(): argument 'base' must be in [0, 1], but got ", base);
  TORCH_CHECK(total_steps > 0, "momentum_schedule(): argument 'total_steps' must be positive, but got ", total_steps);
  const double t = std::min<double>(std::max<int64_t>(step, 0), total_steps) / static_cast<double>(total_steps);
  return 1.0 - (1.0 - base) * (std::cos(M_PI * t) + 1.0) * 0.5;
}

// ---------------------------------------------------------------------------

ClipLossImpl::ClipLossImpl(ClipLossOptions options_, double init_scale, bool with_bias)
    : options(std::move(options_)) {
  TORCH_CHECK(init_scale > 0.0, "ClipLoss(): argument 'init_scale' must be positive, but got ", init_scale);
  logit_scale = register_parameter("logit_scale", torch::tensor(std::log(init_scale)));
  if (with_bias) logit_bias = register_parameter("logit_bias", torch::tensor(0.0));
}

torch::Tensor ClipLossImpl::forward(const torch::Tensor& a, const torch::Tensor& b) {
  auto scale = logit_scale.to(a.scalar_type());
  c10::optional<torch::Tensor> bias;
  if (logit_bias.defined()) bias = logit_bias.to(a.scalar_type());
  return clip_loss(a, b, scale, bias, options);
}

torch::Tensor NTXentLossImpl::forward(const torch::Tensor& z1, const torch::Tensor& z2) {
  return nt_xent_loss(z1, z2, options);
}

torch::Tensor MocoV3LossImpl::forward(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                                      const torch::Tensor& k2) {
  return moco_v3_loss(q1, q2, k1, k2, options);
}

}  // namespace contrax
