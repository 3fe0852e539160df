// SigLIP's pairwise sigmoid loss as one autograd function over ring-visited,
// chunked key blocks (see contrax/siglip.h). It shares the ring driver and the
// tile helpers with the tiled InfoNCE (contrax/tiled.h).
#include "contrax/siglip.h"

#include <algorithm>
#include <cmath>

#include "contrax/collectives.h"
#include "contrax/detail/check.h"
#include "contrax/tiled.h"

namespace contrax {

namespace {

struct SigLipPlan : torch::CustomClassHolder {
  CommunicatorPtr comm;         // null or world 1: b holds every row
  std::vector<int64_t> counts;  // b rows per rank
  int64_t tile = 64;
};

// y_ij = -z_ij x_ij for the tile of rows [r0, r0+R) and columns [c0, c0+T) of
// one block: x = as @ bt^T + bias, sign flipped on the positives (i, i) when
// the block is this rank's own.
torch::Tensor signed_logits(const torch::Tensor& as_c /* [R, d] */, const torch::Tensor& bt /* [T, d] */,
                            const c10::optional<torch::Tensor>& bias, bool own, int64_t r0, int64_t c0) {
  auto y = torch::mm(as_c, bt.t());  // [R, T]
  if (bias.has_value()) y.add_(*bias);
  if (own) detail::tile_diagonal(y, r0, c0, 0).neg_();
  return y;
}

class SigLip : public torch::autograd::Function<SigLip> {
 public:
  // Per-row sums f_i = sum_j softplus(y_ij) = -sum_j log sigmoid(z_ij x_ij), [b].
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& a /* [b, d] */,
                               const torch::Tensor& b /* [n_r, d] */, const torch::Tensor& scale /* [] */,
                               const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<SigLipPlan>& plan) {
    auto as = a * scale;                       // [b, d]
    auto f = torch::zeros({a.size(0)}, a.options());  // [b]
    const int64_t rows = a.size(0), tile = plan->tile;
    detail::ring_for_each_block(plan->comm, plan->counts, b, [&](int64_t owner, const torch::Tensor& block) {
      const bool own = !plan->comm || owner == plan->comm->rank();
      for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        const int64_t R = std::min(tile, rows - r0);
        for (int64_t c0 = 0; c0 < block.size(0); c0 += tile) {
          const int64_t T = std::min(tile, block.size(0) - c0);
          auto y = signed_logits(as.narrow(0, r0, R), block.narrow(0, c0, T), bias, own, r0, c0);
          // softplus(y) = -log sigmoid(-y), exact for every y (torch's softplus
          // switches to the identity above a threshold).
          f.narrow(0, r0, R).sub_(torch::log_sigmoid(y.neg_()).sum(1));
        }
      }
    });
    ctx->save_for_backward({a, b, scale});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    if (bias.has_value()) ctx->saved_data["bias"] = bias->detach();
    return f;
  }

  // Gradient. With x_ij = s a_i.b_j + bias and y_ij = -z_ij x_ij,
  // f_i = sum_j softplus(y_ij), so df_i/dx_ij = -z_ij sigmoid(y_ij). With
  // upstream g_i, G_ij := -g_i z_ij sigmoid(y_ij), recomputed per tile:
  //   da_i = s sum_j G_ij b_j = s A_i,   db_j = s sum_i G_ij a_i,
  //   ds = sum_ij G_ij a_i.b_j = sum_i A_i.a_i,   dbias = sum_ij G_ij.
  // The b-gradient of each block is summed around the ring back to its owner.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(), "siglip_loss(): double backward (create_graph=true) is not supported");
    auto saved = ctx->get_saved_variables();
    const auto& a = saved[0];
    const auto& b = saved[1];
    const auto& scale = saved[2];
    auto plan = c10::static_intrusive_pointer_cast<SigLipPlan>(ctx->saved_data["plan"].toCapsule());
    c10::optional<torch::Tensor> bias;
    if (ctx->saved_data.count("bias")) bias = ctx->saved_data["bias"].toTensor();
    auto g = grads[0].contiguous();  // [b]
    const int64_t rows = a.size(0), tile = plan->tile;
    const bool want_db = ctx->needs_input_grad(1);

    // g is folded into [b, d] operands (as * g, and A scaled once at the end)
    // instead of into every [tile x tile] entry.
    auto as = a * scale;                     // [b, d]
    auto asg = as * g.unsqueeze(1);          // [b, d]
    auto H_sum = torch::zeros_like(a);       // [b, d]: sum_j h_ij b_j, h = G / g
    auto h_rows = torch::zeros_like(g);      // [b]: sum_j h_ij (bias only)
    auto visit = [&](int64_t owner, const torch::Tensor& block) {
      const bool own = !plan->comm || owner == plan->comm->rank();
      torch::Tensor db = want_db ? torch::zeros_like(block) : torch::Tensor();  // [n, d]
      for (int64_t c0 = 0; c0 < block.size(0); c0 += tile) {
        const int64_t T = std::min(tile, block.size(0) - c0);
        auto bt = block.narrow(0, c0, T);  // [T, d]
        for (int64_t r0 = 0; r0 < rows; r0 += tile) {
          const int64_t R = std::min(tile, rows - r0);
          auto h = signed_logits(as.narrow(0, r0, R), bt, bias, own, r0, c0).sigmoid_();  // [R, T]
          if (own) detail::tile_diagonal(h, r0, c0, 0).neg_();                           // times -z
          H_sum.narrow(0, r0, R).addmm_(h, bt);
          if (want_db) db.narrow(0, c0, T).addmm_(h.t(), asg.narrow(0, r0, R));
          if (bias.has_value()) h_rows.narrow(0, r0, R).add_(h.sum(1));
        }
      }
      return db;
    };
    torch::Tensor db;
    if (want_db) {
      db = detail::ring_for_each_block_grad(plan->comm, plan->counts, b, visit);
    } else {
      detail::ring_for_each_block(plan->comm, plan->counts, b,
                                  [&](int64_t owner, const torch::Tensor& block) { visit(owner, block); });
    }
    auto A = H_sum.mul_(g.unsqueeze(1));  // [b, d]: sum_j G_ij b_j
    auto da = A * scale;
    auto ds = (A * a).sum().reshape(scale.sizes());
    torch::Tensor dbias;
    if (bias.has_value()) dbias = (g * h_rows).sum().reshape(bias->sizes());
    return {da, db, ds, dbias, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor siglip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                          const c10::optional<torch::Tensor>& logit_bias, const SigLipLossOptions& options) {
  const char* caller = "siglip_loss";
  detail::ArgChecker check(caller);
  check.paired_features(a, "a", b, "b");
  check.scalar(logit_scale, "logit_scale");
  if (logit_bias.has_value()) check.scalar(*logit_bias, "logit_bias");
  check.require(options.max_logit_scale() > 0.0, "argument 'max_logit_scale' must be positive, but got ",
                options.max_logit_scale());
  check.require(options.tile_size() >= 0, "argument 'tile_size' must be >= 0 (0 = automatic), but got ",
                options.tile_size());
  check.require(options.tile_bytes() > 0, "argument 'tile_bytes' must be positive, but got ",
                options.tile_bytes());
  const bool ok = check.error().empty();
  namespace F = torch::nn::functional;
  auto norm = [&](const torch::Tensor& x) {
    return ok && options.normalize() ? F::normalize(x, F::NormalizeFuncOptions().dim(1)) : x;
  };
  auto a_n = norm(a), b_n = norm(b);
  const auto& comm = options.comm();
  const int64_t W = comm ? comm->world_size() : 1;
  auto counts = detail::exchange_row_counts(ok ? b_n : torch::Tensor(), comm, caller, "b", check.error());
  int64_t B = 0;
  for (auto c : counts) B += c;
  TORCH_CHECK(B > 0, caller, "(): the global batch is empty (every rank passed 0 rows)");

  auto plan = c10::make_intrusive<SigLipPlan>();
  plan->comm = W > 1 ? comm : nullptr;
  plan->counts = counts;
  plan->tile = detail::tile_side(options.tile_size(), options.tile_bytes(), a.element_size());
  auto scale = logit_scale.exp();
  if (std::isfinite(options.max_logit_scale())) scale = scale.clamp_max(options.max_logit_scale());
  c10::optional<torch::Tensor> bias;
  if (logit_bias.has_value()) bias = logit_bias->to(a.scalar_type());
  auto rows = SigLip::apply(a_n, b_n, scale.to(a.scalar_type()), bias, plan);  // [b]
  return rows.sum() * (static_cast<double>(W) / static_cast<double>(B));
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
