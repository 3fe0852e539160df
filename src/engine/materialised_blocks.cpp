// The engine's seam (engine/engine.h) and its materialised blocks: CLIP /
// InfoNCE / grouped and NT-Xent, each one autograd function whose logits
// buffer (engine/workspace.h) is the only [b x N] tensor, masked in place,
// kept, and turned into G / c in place by the backward (the derivation:
// engine/block.h). Where the prologue chose the tiled path the seam hands the
// block to engine/tiled_blocks.h instead.
#include "engine/engine.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>

#include "engine/block.h"
#include "engine/panels.h"
#include "engine/tiled_blocks.h"
#include "engine/workspace.h"

namespace contrax::detail {

namespace {

// The state of a backward, refused the second time through the same graph:
// it would read G where S was.
c10::intrusive_ptr<BlockState> single_backward_state(AutogradContext* ctx) {
  auto state = backward_state<BlockState>(ctx);
  TORCH_CHECK(!state->consumed, state->layout.caller,
              "(): backward ran twice through the same graph; the materialised loss turns its logits buffer into "
              "the gradient in place, so retain_graph=true cannot reuse it (compute the loss again instead)");
  state->consumed = true;
  return state;
}

// Rows per panel of a [b x cols] logits buffer for features like `features`
// (buffer_panel_rows, engine/panels.h).
int64_t panel_rows(int64_t b, int64_t cols, const torch::Tensor& features) {
  return buffer_panel_rows(features.device().type(), features.scalar_type(), b, cols, features.size(1),
                           panels_on(features.device().type()) ? panel_budget(features.device()) : 0);
}

// Calls fn(r0, n) for the row panels [r0, r0 + n) of a [rows x cols] buffer
// (panel_rows), counting each as a step of the walk.
void for_each_panel(int64_t rows, int64_t cols, const torch::Tensor& features,
                    const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t R = panel_rows(rows, cols, features);
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    count_steps(1);
    fn(r0, std::min(R, rows - r0));
  }
}

// The rows [r0, r0 + n) of the buffer, holding S (or E when bounded: `fa`,
// `fb` are the shift's factors, see ClipBlock::backward), made G / c in place;
// multi-positive labels on sub-panels of `label_rows` rows.
void panel_gradient(const BlockState& state, const RowTerms& rt, const Weights& w, torch::Tensor& Sg, int64_t r0,
                    const torch::Tensor& fa, const torch::Tensor& fb, int64_t label_rows) {
  const int64_t n = Sg.size(0);
  if (state.shift) {
    scale_rows_plus_cols_(Sg, fa.narrow(0, r0, n), fb);
    subtract_positives(state, w, Sg, r0, 0);
    return;
  }
  for (int64_t l0 = 0; l0 < n; l0 += label_rows) {
    auto Sc = Sg.narrow(0, l0, std::min(label_rows, n - l0));
    torch::Tensor P;
    if (state.multi()) {
      auto scratch = Sc;  // multi-positive masks nothing: only P is wanted
      P = apply_labels(state, scratch, r0 + l0, 0);
    }
    tile_gradient(state, rt, w, Sc, P, r0 + l0, 0);
  }
}

class ClipBlock : public torch::autograd::Function<ClipBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q /* [b, d] */,
                               const torch::Tensor& k_all /* [N, d] */, const torch::Tensor& scale /* [] */,
                               const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<BlockState>& state) {
    const int64_t b = q.size(0), N = k_all.size(0), g = state->spec.group;
    const bool has_bias = bias.has_value() && bias->defined();
    auto qs = q * scale;                          // [b, d]
    auto S = logits_buffer(b, N, compute_options(qs));  // [b, N]
    // Bounded: every logit lies in [-M, M], M = s max|q_i| max|k_j| + |bias|
    // (Cauchy-Schwarz). Where 2M is within the dtype's exponent range, M is an
    // exact shift for every row and column: E = exp(S - M) >= e^(-2M) never
    // underflows, lse_row_i = M + log sum_j E_ij, and this rank's partial
    // lse_col_j = M + log sum_i E_ij (an empty sum: -inf). One exponential per
    // logit and no max pass; the buffer keeps E, and the backward needs no
    // exponential (see there). Normalised features at CLIP's initial scale
    // (1/0.07) give M = 14.3. Multi-positive labels need S itself: general path.
    // Off the CPU the bound is not taken: its factors live on the device, and
    // reading them would be a host synchronisation every call (the general
    // path's max pass costs the GPU less than the CPU waiting for it).
    // (A CPU standing in for CUDA, its kernels emulated, walks as CUDA does.)
    if (!state->multi() && b > 0 && N > 0 && q.device().is_cpu() && !emulated_panel_kernels_installed() &&
        bounded_shift_enabled()) {
      // The bound's factors in one host read.
      std::vector<torch::Tensor> parts{scale.reshape({}), q.norm(2, 1).max(), k_all.norm(2, 1).max()};
      if (has_bias) parts.push_back(bias->abs().reshape({}));
      for (auto& t : parts) t = t.to(torch::kDouble);
      const auto f = torch::stack(parts).to(torch::kCPU);
      const auto v = f.accessor<double, 1>();
      double M = v[0] * v[1] * v[2];
      if (has_bias) M += v[3];
      if (bound_fits(M, S.scalar_type())) state->shift = M;
    }
    const bool bounded = state->shift.has_value();
    const double M = state->shift.value_or(0.0);
    ForwardStats st(*state, b, S.options(), /*online_cols=*/!bounded);
    auto designated = torch::empty({b}, S.options());  // [b]: S_{i, pos(i)}
    auto col_sum = bounded && state->spec.symmetric ? torch::zeros({N}, S.options()) : torch::Tensor();
    // GEMM panel by panel, each panel's statistics while it is in cache;
    // labels work on smaller sub-panels (their structure is a [R, N] temporary).
    const int64_t Rl = state->labeled() ? label_panel_rows(N, S) : std::max<int64_t>(b, 1);
    for_each_panel(b, N, q, [&](int64_t r0, int64_t n) {
      auto Sg = S.narrow(0, r0, n);
      gemm_out(Sg, qs.narrow(0, r0, n), k_all.t());
      if (has_bias) Sg.add_(*bias);
      designated.narrow(0, r0, n).copy_(run_view(Sg, positives_in(r0, n, 0, N, state->layout.offset, g), g));
      for (int64_t l0 = 0; l0 < n; l0 += Rl) {
        auto Sc = Sg.narrow(0, l0, std::min(Rl, n - l0));  // [R, N]
        auto P = apply_labels(*state, Sc, r0 + l0, 0);
        if (bounded) {
          st.lse_row.narrow(0, r0 + l0, Sc.size(0)).copy_(exp_rows_(Sc, M, col_sum).log_().add_(M));
        } else {
          st.add(Sc, P, r0 + l0, 0, /*whole_rows=*/true);
        }
      }
    });
    if (bounded && state->spec.symmetric) st.lse_col = col_sum.log_().add_(M);  // this rank's column partials
    RowTerms rt;
    auto l = finish_forward(*state, st, designated, rt);
    ctx->save_for_backward({q, k_all, scale});
    ctx->saved_data["S"] = S;
    save_terms(ctx, rt);
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return reduce_rows(l, state->layout, state->spec.reduction);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    auto state = single_backward_state(ctx);
    auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& k_all = saved[1];
    const auto& scale = saved[2];
    // The buffer leaves the graph now: it becomes the gradient below and is
    // freed (or returned to the workspace) when this backward returns, not
    // when the caller drops the loss (often only after the next forward).
    auto S = ctx->saved_data["S"].toTensor();
    ctx->saved_data.erase("S");
    const auto rt = saved_terms(ctx);
    const int64_t b = q.size(0), N = k_all.size(0), d = q.size(1);
    const auto w = backward_weights(*state, grads[0], S.scalar_type());
    const bool want_dk = ctx->needs_input_grad(1);
    const bool want_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(3);

    // Panel by panel, as the forward: S -> G / c in place (multi-positive
    // labels on sub-panels, for their [R, N] structure), then the panel's rows
    // of Gk = (G / c) k_all while it is in cache. dk = (G / c)^T q s c is one
    // GEMM afterwards: accumulated per panel it would read and write the whole
    // [N, d] result once per panel (512 MiB of traffic at W = 4, b = 4096),
    // while the one GEMM is compute-bound and streams G once. The scalar c goes
    // on the [b, d] and [N, d] products instead of on the [b, N] buffer.
    //
    // Bounded (the buffer holds E = exp(S - M)): exp(S_ij - lse_row_i) =
    // E_ij exp(M - lse_row_i) and exp(S_ij - lse_col_j) = E_ij exp(M - lse_col_j),
    // so G / c = E (a_i + b_j) - Y with a = w_row exp(M - lse_row) and
    // b = w_col exp(M - lse_col) (0 one-directional). Both factors are at most
    // e^(2M) (every lse is >= -M): finite.
    //
    // Reduced operands (bf16 keys on CUDA): both products take each panel's one
    // cast (scaled_operand): its rows of G k_all, and dk accumulated per panel
    // in fp32 (addmm) instead of casting the whole buffer again for one GEMM.
    const bool reduced = k_all.scalar_type() != S.scalar_type();
    auto Gk = torch::empty({b, d}, S.options());  // [b, d]
    auto g_sum = want_bias ? torch::zeros({}, S.options()) : torch::Tensor();
    auto qs = reduced && want_dk ? q * scale : torch::Tensor();                            // [b, d], operand dtype
    torch::Tensor dk_acc;  // [N, d]: assigned by the first panel's product (zeros when there is none)
    if (reduced && want_dk) {
      dk_acc = b > 0 ? torch::empty(k_all.sizes(), S.options()) : torch::zeros(k_all.sizes(), S.options());
    }
    torch::Tensor fa, fb;  // bounded: [b], [N]
    if (state->shift) {
      fa = shift_factors(*state->shift, rt.lse_row, w.row);
      fb = state->spec.symmetric ? shift_factors(*state->shift, rt.lse_col, w.col) : torch::zeros({N}, S.options());
    }
    const int64_t Rl = state->multi() ? label_panel_rows(N, S) : std::max<int64_t>(b, 1);
    for_each_panel(b, N, q, [&](int64_t r0, int64_t n) {
      auto Sg = S.narrow(0, r0, n);
      panel_gradient(*state, rt, w, Sg, r0, fa, fb, Rl);
      auto gk = Gk.narrow(0, r0, n);
      if (want_bias) g_sum.add_(Sg.sum());
      if (reduced) {
        const auto G = scaled_operand(Sg, w.c, k_all.scalar_type());  // [n, N]: G, once
        gemm_out(gk, G, k_all);
        if (want_dk) gemm_into_(dk_acc, G.t(), qs.narrow(0, r0, n), r0 == 0);
      } else {
        gemm_out(gk, Sg, k_all);
      }
    });
    torch::Tensor dk;
    if (want_dk) {
      dk = (reduced ? dk_acc : gemm(S.t(), q * (scale * w.c), S.scalar_type())).to(k_all.scalar_type());  // [N, d]
    }
    if (!reduced) Gk.mul_(w.c);  // G k_all
    auto dq = (Gk * scale).to(q.scalar_type());
    torch::Tensor ds, dbias;
    if (ctx->needs_input_grad(2)) ds = (Gk * q).sum().reshape(scale.sizes());
    if (want_bias) dbias = g_sum * w.c;
    return {dq, dk, ds, dbias, torch::Tensor()};
  }
};

// NT-Xent (the derivation is in engine/block.h). Forward: S_r = (z / T) Z^T
// ([2b x 2B], the only such buffer), self columns set to -inf (exact in every
// dtype: exp(-inf) = 0 in the softmax and in its gradient), lse_u per local
// row, then every row's lse all-gathered (O(B)).
class NtXentBlock : public torch::autograd::Function<NtXentBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& z /* [2b, d] */,
                               const torch::Tensor& z_all /* [2B, d] */, const c10::intrusive_ptr<BlockState>& state) {
    const auto& L = state->layout;
    const int64_t b2 = z.size(0), b = b2 / 2, B = L.total;
    auto zs = z * state->inv_temperature;             // [2b, d]
    auto S = logits_buffer(b2, 2 * B, compute_options(zs));  // [2b, 2B]
    auto idx = self_and_positive(b, L, z.device());
    auto lse = torch::empty({b2}, S.options());       // [2b]
    auto positive = torch::empty({b2}, S.options());  // [2b]: S_{u, pos(u)}
    // GEMM panel by panel; each panel's self columns masked, its positives
    // read and its rows' log-sum-exps taken while it is in cache. Bounded
    // (unit rows: every S_uv lies in [-1/T, 1/T]): 1/T is a safe shift for
    // every row, so one pass turns the panel into E = exp(S - 1/T) (no
    // underflow: 2/T is within the dtype's exponent range) and sums it; the
    // backward then needs no exponential at all (see there).
    // The mask value as a tensor on S's device: index_put_ with a C++ scalar
    // makes a CPU tensor of it and copies that to the GPU, a blocking copy
    // (a host synchronisation) every panel.
    const auto minus_inf = torch::full({}, -kInf, S.options());
    for_each_panel(b2, 2 * B, z, [&](int64_t r0, int64_t n) {
      auto Sc = S.narrow(0, r0, n);
      gemm_out(Sc, zs.narrow(0, r0, n), z_all.t());
      const auto rows = idx[0].narrow(0, 0, n);
      Sc.index_put_({rows, idx[1].narrow(0, r0, n)}, minus_inf);
      positive.narrow(0, r0, n).copy_(Sc.index({rows, idx[2].narrow(0, r0, n)}));
      if (state->shift) {
        lse.narrow(0, r0, n).copy_(exp_rows_(Sc, *state->shift).log_().add_(*state->shift));
      } else {
        lse.narrow(0, r0, n).copy_(tile_lse(Sc, /*rows=*/true, /*cols=*/false).row);
      }
    });
    ctx->save_for_backward({z_all});
    ctx->saved_data["S"] = S;
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["lse_all"] = gather_view_lse(lse, L);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return nt_reduce(lse - positive, *state);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    auto state = single_backward_state(ctx);
    const auto& L = state->layout;
    auto z_all = ctx->get_saved_variables()[0];
    // The buffer leaves the graph now (see ClipBlock::backward).
    auto S = ctx->saved_data["S"].toTensor();
    ctx->saved_data.erase("S");
    auto lse = ctx->saved_data["lse"].toTensor();
    auto lse_all = ctx->saved_data["lse_all"].toTensor();
    const int64_t b2 = S.size(0), b = b2 / 2, d = z_all.size(1);
    const auto w = nt_weights(*state, grads[0], S.scalar_type());
    auto idx = self_and_positive(b, L, S.device());
    auto minus = w.row.defined() ? w.row * 2.0 : torch::full({b2}, 2.0, S.options());  // [2b]
    // Panel by panel, as the forward: w_u exp(S_uv - lse_u) + w_v exp(S_uv - lse_v)
    // (P and the rows of P^T this rank needs) fused in place, 0 on the self
    // column; the positives lose 2 w_u; then the panel's rows of G~ Z while it
    // is in cache. The scalar c (which holds 1/T) goes on the [2b, d] product.
    // Bounded, the buffer holds E = exp(S - 1/T), and both terms are E times
    // a factor: exp(S_uv - lse_u) = E_uv exp(1/T - lse_u) and
    // exp(S_uv - lse_v) = E_uv exp(1/T - lse_v), so G~ = E (a_u + b_v) with
    // a = w exp(1/T - lse), b = w_all exp(1/T - lse_all) (each <= e^(2/T):
    // finite, as 2/T is within the exponent range).
    torch::Tensor a, bc;  // bounded: [2b], [2B]
    if (state->shift) {
      a = shift_factors(*state->shift, lse, w.row);
      bc = shift_factors(*state->shift, lse_all, w.all);
    }
    auto dz = torch::empty({b2, d}, S.options());  // [2b, d]
    for_each_panel(b2, S.size(1), z_all, [&](int64_t r0, int64_t n) {
      auto Sc = S.narrow(0, r0, n);
      if (state->shift) {
        scale_rows_plus_cols_(Sc, a.narrow(0, r0, n), bc);
      } else {
        softmax_grad_(Sc, lse.narrow(0, r0, n), w.row.defined() ? w.row.narrow(0, r0, n) : torch::Tensor(), lse_all,
                      w.all);
      }
      const auto rows = idx[0].narrow(0, 0, n), pos = idx[2].narrow(0, r0, n);
      Sc.index_put_({rows, pos}, Sc.index({rows, pos}) - minus.narrow(0, r0, n));
      auto out = dz.narrow(0, r0, n);
      gemm_out(out, Sc, z_all);
    });
    return {dz.mul_(w.c).to(z_all.scalar_type()), torch::Tensor(), torch::Tensor()};
  }

  // {local row, its self column, its positive column}, each [2b].
  static std::array<torch::Tensor, 3> self_and_positive(int64_t b, const EngineLayout& L, const torch::Device& device) {
    auto opt = torch::TensorOptions().dtype(torch::kLong).device(device);
    auto i = torch::arange(b, opt);
    auto rows = torch::arange(2 * b, opt);
    auto view1 = i + L.offset, view2 = i + (L.total + L.offset);
    return {rows, torch::cat({view1, view2}), torch::cat({view2, view1})};
  }
};

}  // namespace

torch::Tensor clip_block_loss(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                              const torch::Tensor& bias, const Prologue& p, const BlockSpec& spec) {
  TORCH_INTERNAL_ASSERT(spec.group >= 1 && (!spec.symmetric || spec.group == 1));
  if (p.tiled) return tiled_clip_block(q, k, scale, bias, p.layout, spec, p.walk, p.ring);
  TORCH_INTERNAL_ASSERT(spec.masked < 0, "the materialised block masks no diagonal");
  auto state = c10::make_intrusive<BlockState>();
  state->layout = p.layout;
  state->spec = spec;
  return ClipBlock::apply(q, k, scale, bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt, state);
}

torch::Tensor nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& z_all, double inv_temperature,
                                 const Prologue& p, Reduction reduction, bool unit_rows) {
  if (p.tiled) return tiled_nt_xent_block(z, z_all, inv_temperature, p.layout, p.walk, reduction, p.ring);
  auto state = c10::make_intrusive<BlockState>();
  state->layout = p.layout;
  state->reduction = reduction;
  state->inv_temperature = inv_temperature;
  // Unit rows: |S| <= 1/T (in fp32 usable for T >= 0.025).
  if (unit_rows && bound_fits(inv_temperature, z.scalar_type())) state->shift = inv_temperature;
  return NtXentBlock::apply(z, z_all, state);
}

}  // namespace contrax::detail
