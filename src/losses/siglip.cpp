// SigLIP's pairwise sigmoid loss (see contrax/losses/siglip.h) as one autograd
// function over the key blocks and the engine's walk of each (engine/tiles.h;
// one tile when materialised), after the shared prologue (engine/prologue.h).
#include "contrax/losses/siglip.h"

#include <algorithm>
#include <cmath>

#include "engine/prologue.h"
#include "engine/tiles.h"

namespace contrax {

namespace {

struct SigLipState : torch::CustomClassHolder {
  detail::EngineLayout layout;  // null comm or world 1: b holds every row
  detail::TileWalk walk;        // tiles (CPU) or panels (CUDA): engine/panels.h; one tile when materialised
  bool ring = false;            // b is this rank's block, the others travel; else b holds every row
  detail::KeyBlocks key_blocks() const {
    if (ring) return detail::KeyBlocks(layout.comm, layout.counts, layout.rank);
    return detail::KeyBlocks(nullptr, {layout.total}, layout.rank);
  }
  // Where row i's positive lies in a block: column i of this rank's own block
  // on the ring, column offset + i of the gathered keys; -1 in another rank's.
  int64_t positives(int64_t owner) const {
    if (owner != layout.rank) return -1;
    return ring ? 0 : layout.offset;
  }
};

// y_ij = -z_ij x_ij for tile `t` of one block: x = as @ bt^T + bias, sign
// flipped on the positives (i, positive + i) when the block holds them.
torch::Tensor signed_logits(const torch::Tensor& as /* [b, d] */, const torch::Tensor& block /* [n, d] */,
                            const c10::optional<torch::Tensor>& bias, int64_t positive, const detail::Tile& t) {
  auto y = detail::gemm(as.narrow(0, t.r0, t.rows), block.narrow(0, t.c0, t.cols).t(),
                        detail::compute_dtype(as.scalar_type()));  // [R, C]
  if (bias.has_value()) y.add_(*bias);
  if (positive >= 0) detail::tile_diagonal(y, t.r0, t.c0, positive).neg_();
  return y;
}

class SigLip : public torch::autograd::Function<SigLip> {
 public:
  // Per-row sums f_i = sum_j softplus(y_ij) = -sum_j log sigmoid(z_ij x_ij), [b].
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& a /* [b, d] */,
                               const torch::Tensor& b /* [n_r, d] */, const torch::Tensor& scale /* [] */,
                               const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<SigLipState>& state) {
    auto as = a * scale;                                             // [b, d]
    auto f = torch::zeros({a.size(0)}, detail::compute_options(a));  // [b]
    const auto blocks = state->key_blocks();
    blocks.for_each(b, [&](int64_t owner, int64_t, const torch::Tensor& block) {
      detail::for_each_tile(a.size(0), block.size(0), state->walk, [&](const detail::Tile& t) {
        auto y = signed_logits(as, block, bias, state->positives(owner), t);
        // softplus(y) = -log sigmoid(-y), exact for every y (torch's softplus
        // switches to the identity above a threshold).
        f.narrow(0, t.r0, t.rows).sub_(torch::log_sigmoid(y.neg_()).sum(1));
      });
    });
    ctx->save_for_backward({a, b, scale});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
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
    detail::NoAutocast no_autocast;
    auto state = detail::backward_state<SigLipState>(ctx);
    auto saved = ctx->get_saved_variables();
    const auto& a = saved[0];
    const auto& b = saved[1];
    const auto& scale = saved[2];
    c10::optional<torch::Tensor> bias;
    if (ctx->saved_data.count("bias")) bias = ctx->saved_data["bias"].toTensor();
    auto g = grads[0].contiguous();  // [b]
    const bool want_db = ctx->needs_input_grad(1);

    // g is folded into [b, d] operands (as * g, and A scaled once at the end)
    // instead of into every [tile x tile] entry.
    auto as = a * scale;                                               // [b, d]
    auto asg = (as * g.unsqueeze(1)).to(a.scalar_type());              // [b, d], an operand
    auto H_sum = torch::zeros(a.sizes(), detail::compute_options(a));  // [b, d]: sum_j h_ij b_j, h = G / g
    auto h_rows = torch::zeros_like(g);                                // [b]: sum_j h_ij (bias only)
    const auto blocks = state->key_blocks();
    auto db = blocks.for_each_grad(b, want_db, [&](int64_t owner, int64_t, const torch::Tensor& block) {
      const int64_t positive = state->positives(owner);
      torch::Tensor db_block =
          want_db ? torch::zeros(block.sizes(), detail::compute_options(block)) : torch::Tensor();  // [n, d]
      detail::for_each_tile(
          a.size(0), block.size(0), state->walk,
          [&](const detail::Tile& t) {
            auto bt = block.narrow(0, t.c0, t.cols);                          // [C, d]
            auto h = signed_logits(as, block, bias, positive, t).sigmoid_();  // [R, C]
            if (positive >= 0) detail::tile_diagonal(h, t.r0, t.c0, positive).neg_();  // times -z
            if (bias.has_value()) h_rows.narrow(0, t.r0, t.rows).add_(h.sum(1));
            auto hb = detail::scaled_operand(h, {}, bt.scalar_type());  // cast once for both GEMMs
            detail::gemm_add_(H_sum.narrow(0, t.r0, t.rows), hb, bt);
            if (want_db) detail::gemm_add_(db_block.narrow(0, t.c0, t.cols), hb.t(), asg.narrow(0, t.r0, t.rows));
          },
          /*columns_outer=*/true);
      return db_block;
    });
    auto A = H_sum.mul_(g.unsqueeze(1));  // [b, d]: sum_j G_ij b_j
    auto da = (A * scale).to(a.scalar_type());
    if (db.defined()) db = db.to(b.scalar_type());
    auto ds = (A * a).sum().reshape(scale.sizes());
    torch::Tensor dbias;
    if (bias.has_value()) dbias = (g * h_rows).sum().reshape(bias->sizes());
    return {da, db, ds, dbias, torch::Tensor()};
  }
};

}  // namespace

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
  const auto& comm = options.comm();
  auto counts = detail::agree_on_rows(caller, check.error().empty() ? b : torch::Tensor(), "b", comm, check.error());
  // One [b x B] logits block when materialised.
  const auto p = detail::make_prologue(caller, comm, counts, a, options.memory(), detail::logits_blocks("siglip"));
  // The engine's precision policy (engine/precision.h): normalised in the
  // compute dtype without overflow, gathered and multiplied in the operand dtype.
  auto a_n = detail::prepare(a, p, options.normalize()), b_n = detail::prepare(b, p, options.normalize());
  auto state = c10::make_intrusive<SigLipState>();
  state->layout = p.layout;
  state->ring = p.ring;
  state->walk = p.walk;
  if (!p.tiled) {  // materialised: the whole block is one tile
    state->walk.panels = false;
    state->walk.tile = std::max<int64_t>({1, a.size(0), p.layout.total});
  }
  auto keys = p.ring ? b_n : detail::gather_rows(b_n, comm, counts, /*with_grad=*/true);
  auto scale = detail::clamped_scale(logit_scale, options.max_logit_scale());  // NaN stays NaN
  const auto bias = logit_bias.has_value() ? std::make_optional(logit_bias->to(p.dtype)) : c10::nullopt;
  auto rows = SigLip::apply(a_n, keys, scale.to(p.dtype), bias, state);  // [b]
  const auto& L = state->layout;
  return rows.sum() * (static_cast<double>(L.world) / static_cast<double>(L.total));
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
