// Matryoshka's shared pass (engine/prefix_block.h; the derivation is there).
#include "engine/prefix_block.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>

#include "engine/lse_kernels.h"
#include "engine/panels.h"
#include "engine/precision.h"
#include "engine/workspace.h"

namespace contrax::detail {

namespace {

struct PrefixState : BlockState {
  std::vector<int64_t> dims;     // m_1 < ... < m_P = d
  std::vector<double> weights;   // w_p

  // Bounded (`shift`, set by the forward) without labels: every pass reads
  // the raw products and writes no logits.
  bool fused() const { return shift && !labeled(); }
};

}  // namespace

int64_t prefix_panel_rows(c10::DeviceType device, c10::ScalarType dtype, int64_t b, int64_t N, int64_t d) {
  const int64_t rows = buffer_panel_rows(device, dtype, b, N, d, 0);
  return std::max<int64_t>(1, std::min(rows, (b + 15) / 16));
}

int64_t prefix_recompute_rows(int64_t R, int64_t b, int64_t P) {
  const int64_t rows = std::min(R, std::max<int64_t>(b, 1));
  return P > 1 ? std::max<int64_t>(1, std::min(rows, 3 * R / (P - 1))) : rows;
}

namespace {

int64_t panel_rows_of(int64_t b, int64_t N, const torch::Tensor& q) {
  return prefix_panel_rows(q.device().type(), q.scalar_type(), b, N, q.size(1));
}

// Rows of a label sub-panel (label_panel_rows; the whole panel without labels).
int64_t label_rows(const BlockState& state, int64_t n, int64_t N, const torch::Tensor& like) {
  return state.labeled() ? label_panel_rows(N, like) : std::max<int64_t>(n, 1);
}

// fn(r0, l0, tile) over the label sub-panels of the logits panel T (rows
// [r0, r0 + n) of the block), each masked in place (kMaskDuplicates) and its
// positive set P (kMultiPositive) passed on.
template <typename Fn>
void for_label_panels(const BlockState& state, torch::Tensor& T, int64_t r0, Fn fn) {
  const int64_t n = T.size(0), Rl = label_rows(state, n, T.size(1), T);
  for (int64_t l0 = 0; l0 < n; l0 += Rl) {
    auto Tc = T.narrow(0, l0, std::min(Rl, n - l0));
    auto P = apply_labels(state, Tc, r0 + l0, 0);
    fn(Tc, P, r0 + l0);
  }
}

// One prefix's statistics from X, its raw products ([b, N]), whose logits
// are a_i ik_j X_ij + c: the row log-sum-exps into st (bounded: this rank's
// column sums of exp(S - M) into col_sum, where defined) and the designated
// logits into `designated`, panel by panel (`count`: each a step of the
// walk). Bounded (shift M) without labels (state.fused()) from the products
// in one pass, no logits written; otherwise through the logits panel T,
// labels applied.
void prefix_statistics(const PrefixState& state, const torch::Tensor& X, const torch::Tensor& a,
                       const torch::Tensor& ik, double c, int64_t R, torch::Tensor& T, ForwardStats& st,
                       torch::Tensor designated, const torch::Tensor& col_sum, bool count) {
  const int64_t b = X.size(0), N = X.size(1), g = state.spec.group, offset = state.layout.offset;
  const auto& M = state.shift;
  const bool fast = state.fused();
  if (fast) {
    const auto run = positives_in(0, b, 0, N, offset, g);
    if (run.n > 0) {
      designated.narrow(0, run.row, run.n)
          .copy_(run_view(X, run, g) * a.narrow(0, run.row, run.n) * run_cols(ik, run, g) + c);
    }
  }
  for (int64_t r0 = 0; r0 < b; r0 += R) {
    const int64_t n = std::min(R, b - r0);
    if (count) count_steps(1);
    if (fast) {
      const auto sums = scaled_exp_sums(X.narrow(0, r0, n), a.narrow(0, r0, n), ik, c, *M, col_sum);
      st.lse_row.narrow(0, r0, n).copy_(sums.log_().add_(*M));
      continue;
    }
    auto Tg = T.narrow(0, 0, n);
    scaled_logits_out(Tg, X.narrow(0, r0, n), a.narrow(0, r0, n), ik, c);
    designated.narrow(0, r0, n).copy_(run_view(Tg, positives_in(r0, n, 0, N, offset, g), g));
    for_label_panels(state, Tg, r0, [&](torch::Tensor& Tc, const torch::Tensor& Pl, int64_t row) {
      if (!M) return st.add(Tc, Pl, row, 0, /*whole_rows=*/true);
      const auto sums = exp_rows_(Tc, *M, col_sum);
      st.lse_row.narrow(0, row, Tc.size(0)).copy_(sums.log_().add_(*M));
    });
  }
}

// One panel of the backward (engine/prefix_block.h): the raw products Xg
// (rows [r0, r0 + n) of prefix p) turned into H_p, added into the buffer's
// rows Hg (or, for the widest prefix, Hg = Xg itself, in place); returns the
// row sums of raw_products_grad_, whose column sums go into cg.
//
// The general form: the logits in the panel T, their gradient G_p / c there
// (labels applied), then H_p.
PrefixSums general_panel(const BlockState& state, const RowTerms& rt, const Weights& w, torch::Tensor& Xg,
                         torch::Tensor& Hg, torch::Tensor Tg, const torch::Tensor& a, const torch::Tensor& b,
                         double c, const torch::Tensor& k, bool add, torch::Tensor& cg, int64_t r0) {
  scaled_logits_out(Tg, Xg, a, b, c);
  for_label_panels(state, Tg, r0, [&](torch::Tensor& Tc, const torch::Tensor& Pl, int64_t row) {
    tile_gradient(state, rt, w, Tc, Pl, row, 0);  // G_p / c
  });
  auto sums = raw_products_grad_(Xg, Tg, a, b, k, cg);  // Xg <- H_p
  if (add) Hg.add_(Xg);
  return sums;
}

// The bounded form without labels: one pass from the products with the
// shift's factors fa, fb, then the -Y terms of the designated positives
// taken out of each result: with y their targets, at (i, j) = (i, pos(i)),
// G_ij loses y_i, so sum_j G b x loses y_i b_j x_ij, sum_j G loses y_i,
// column j's sum_i G a x loses y_i a_i x_ij, and H_ij loses k a_i b_j y_i.
PrefixSums bounded_panel(const PrefixState& state, const Weights& w, const torch::Tensor& Xg, torch::Tensor& Hg,
                         const torch::Tensor& a, const torch::Tensor& b, double c, const torch::Tensor& fa,
                         const torch::Tensor& fb, const torch::Tensor& k, bool add, torch::Tensor& cg, int64_t r0) {
  const int64_t g = state.spec.group;
  const auto run = positives_in(r0, Xg.size(0), 0, Xg.size(1), state.layout.offset, g);
  const auto xd = run.n > 0 ? run_view(Xg, run, g).clone() : torch::Tensor();  // Xg may be Hg
  auto sums = bounded_raw_products_grad(Xg, Hg, a, b, c, *state.shift, fa, fb, k, add, cg);
  if (run.n == 0) return sums;
  const auto y = positive_targets(state, w, run, r0, 0, Xg.options());
  const auto bd = run_cols(b, run, g), ay = a.narrow(0, run.row, run.n) * y;
  sums.gx.narrow(0, run.row, run.n).sub_(bd * y * xd);
  sums.g.narrow(0, run.row, run.n).sub_(y);
  run_cols(cg, run, g).sub_(ay * xd);
  run_view(Hg, run, g).sub_(ay * bd * k);
  return sums;
}

// Each prefix's terms in the backward: its row terms, c w_p and, bounded
// and unlabelled (as prefix_statistics), the shift's factors as in the
// materialised block's backward.
struct PrefixTerms {
  std::vector<RowTerms> rt;
  std::vector<torch::Tensor> k, fa, fb;  // [P] each; k: 0-dim c w_p
};

PrefixTerms prefix_terms(const PrefixState& state, const Weights& w, const torch::Tensor& lse_row /* [P, b] */,
                         const torch::Tensor& lse_col /* [P, N] or undefined */, const torch::Tensor& inv_n_row,
                         const torch::Tensor& inv_n_col, int64_t N) {
  PrefixTerms t;
  for (size_t p = 0; p < state.dims.size(); ++p) {
    const auto i = static_cast<int64_t>(p);
    t.rt.push_back({lse_row[i], lse_col.defined() ? lse_col[i] : torch::Tensor(), inv_n_row, inv_n_col});
    t.k.push_back(w.c * state.weights[p]);
    if (!state.fused()) continue;
    const auto& rt = t.rt.back();
    t.fa.push_back(shift_factors(*state.shift, rt.lse_row, w.row));
    t.fb.push_back(rt.lse_col.defined() ? shift_factors(*state.shift, rt.lse_col, w.col)
                                        : torch::zeros({N}, lse_row.options()));
  }
  return t;
}

class PrefixClipBlock : public torch::autograd::Function<PrefixClipBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q /* [b, d] */,
                               const torch::Tensor& k_all /* [N, d] */, const torch::Tensor& iq /* [P, b] */,
                               const torch::Tensor& ik /* [P, N] */, const torch::Tensor& scale /* [] */,
                               const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<PrefixState>& state) {
    const int64_t b = q.size(0), N = k_all.size(0), P = static_cast<int64_t>(state->dims.size());
    const bool has_bias = bias.has_value() && bias->defined();
    const double c = has_bias ? bias->item<double>() : 0.0;
    auto aq = iq * scale;                         // [P, b]: s / ||q_p||
    auto X = logits_buffer(b, N, q.options());    // [b, N]: the raw products, X_P once done
    // Bounded (as the materialised block, engine/materialised_blocks.cpp):
    // every prefix's logits are cosines times s plus c, |S| <= M = s + |c|;
    // where 2M is within the dtype's exponent range M is every softmax's
    // exact shift, and one exponential per logit gives the row sums and this
    // rank's column sums. Multi-positive labels need S itself.
    const double M = scale.item<double>() + std::abs(c);
    const bool bounded = !state->multi() && bound_fits(M, q.scalar_type());
    if (bounded) state->shift = M;
    // Bounded without labels, the passes read the products and write no
    // logits (prefix_statistics; bounded_panel in backward).
    const int64_t R = panel_rows_of(b, N, q);
    auto T = state->fused() ? torch::Tensor() : torch::empty({R, N}, q.options());
    const bool sym = state->spec.symmetric;
    std::deque<ForwardStats> st;
    std::vector<torch::Tensor> col_sum;  // bounded and symmetric: [P] of [N]
    for (int64_t p = 0; p < P; ++p) {
      st.emplace_back(*state, b, q.options(), /*online_cols=*/!bounded);
      if (bounded && sym) col_sum.push_back(torch::zeros({N}, q.options()));
    }
    auto designated = torch::empty({P, b}, q.options());  // [P, b]: S_p,i,pos(i)
    // Each slice's product over the whole buffer (a GEMM per panel of a
    // 64-wide slice runs at half the speed of one over all rows), then the
    // prefix's statistics panel by panel.
    int64_t m0 = 0;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t m = state->dims[p];
      if (b > 0) gemm_into_(X, q.narrow(1, m0, m - m0), k_all.narrow(1, m0, m - m0).t(), p == 0);
      m0 = m;
      prefix_statistics(*state, X, aq[p], ik[p], c, R, T, st[p], designated[p],
                        bounded && sym ? col_sum[p] : torch::Tensor(), /*count=*/p == 0);
      if (bounded && sym) st[p].lse_col = col_sum[p].log_().add_(M);  // this rank's column partials
    }
    torch::Tensor l;  // [b]: sum_p w_p l_p
    std::vector<torch::Tensor> lse_row, lse_col;
    RowTerms rt;
    for (int64_t p = 0; p < P; ++p) {
      auto lp = finish_forward(*state, st[p], designated[p], rt) * state->weights[p];
      l = l.defined() ? l + lp : lp;
      lse_row.push_back(rt.lse_row);
      if (rt.lse_col.defined()) lse_col.push_back(rt.lse_col);
    }
    ctx->save_for_backward({q, k_all, iq, ik, scale});
    ctx->saved_data["X"] = X;
    ctx->saved_data["lse_row"] = torch::stack(lse_row);  // [P, b]
    if (!lse_col.empty()) ctx->saved_data["lse_col"] = torch::stack(lse_col);  // [P, N]
    if (rt.inv_n_row.defined()) ctx->saved_data["inv_n_row"] = rt.inv_n_row;   // labels only: the same for every p
    if (rt.inv_n_col.defined()) ctx->saved_data["inv_n_col"] = rt.inv_n_col;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["bias"] = c;
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return reduce_rows(l, state->layout, state->spec.reduction);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    auto state = backward_state<PrefixState>(ctx);
    TORCH_CHECK(!state->consumed, state->layout.caller,
                "(): backward ran twice through the same graph; the Matryoshka prefixes' shared pass turns its "
                "buffer into the gradient in place, so retain_graph=true cannot reuse it (compute the loss again "
                "instead)");
    state->consumed = true;
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k_all = saved[1], &iq = saved[2], &ik = saved[3], &scale = saved[4];
    // The buffer leaves the graph now (as the materialised block's does).
    auto X = ctx->saved_data["X"].toTensor();
    ctx->saved_data.erase("X");
    const auto lse_row = ctx->saved_data["lse_row"].toTensor();
    auto get = [&](const char* key) {
      return ctx->saved_data.count(key) ? ctx->saved_data[key].toTensor() : torch::Tensor();
    };
    const auto lse_col = get("lse_col");
    const double c = ctx->saved_data["bias"].toDouble();
    const int64_t b = q.size(0), N = k_all.size(0), d = q.size(1), P = static_cast<int64_t>(state->dims.size());
    const auto opt = q.options();
    const auto w = backward_weights(*state, grads[0], q.scalar_type());
    auto aq = iq * scale;  // [P, b]
    auto dq = torch::empty({b, d}, opt), dk = torch::empty({N, d}, opt);
    auto diq = torch::empty({P, b}, opt), col_gx = torch::zeros({P, N}, opt);
    auto ds = torch::zeros({}, opt), dbias = torch::zeros({}, opt);
    const int64_t R = panel_rows_of(b, N, q);
    const bool fast = state->fused();
    const auto t = prefix_terms(*state, w, lse_row, lse_col, get("inv_n_row"), get("inv_n_col"), N);
    auto T = fast ? torch::Tensor() : torch::empty({R, N}, opt);  // the general form's logits
    // Row panels of RY <= R rows. In each, the narrower prefixes' products
    // are recomputed as the forward built them, from the narrowest, each the
    // previous one plus its slice's product (m_(P-1) columns of GEMM, not
    // sum_(p<P) m_p), into P - 1 panels; then the prefixes from the widest,
    // the buffer's rows accumulating H_(>=p) (engine/prefix_block.h). Slice
    // p's two GEMMs come right after prefix p: they need the rows at
    // H_(>=p), which the next narrower prefix's pass adds to (dk's
    // accumulated over the panels).
    const int64_t RY = prefix_recompute_rows(R, b, P);
    auto Y = P > 1 ? torch::empty({P - 1, RY, N}, opt) : torch::Tensor();
    if (b == 0) dk.zero_();
    for (int64_t r0 = 0; r0 < b; r0 += RY) {
      const int64_t n = std::min(RY, b - r0);
      auto Hg = X.narrow(0, r0, n);
      const auto qg = q.narrow(0, r0, n);
      for (int64_t p = 0; p + 1 < P; ++p) {
        const int64_t m = state->dims[p], lo = p > 0 ? state->dims[p - 1] : 0;
        auto Yp = Y[p].narrow(0, 0, n);
        if (p > 0) Yp.copy_(Y[p - 1].narrow(0, 0, n));
        gemm_into_(Yp, qg.narrow(1, lo, m - lo), k_all.narrow(1, lo, m - lo).t(), /*first=*/p == 0);
      }
      for (int64_t p = P - 1; p >= 0; --p) {
        const int64_t m = state->dims[p], lo = p > 0 ? state->dims[p - 1] : 0;
        auto Xg = p == P - 1 ? Hg : Y[p].narrow(0, 0, n);
        auto cg = col_gx[p];
        auto a = aq[p].narrow(0, r0, n);
        const auto sums = fast ? bounded_panel(*state, w, Xg, Hg, a, ik[p], c, t.fa[p].narrow(0, r0, n), t.fb[p],
                                               t.k[p], p < P - 1, cg, r0)
                               : general_panel(*state, t.rt[p], w, Xg, Hg, T.narrow(0, 0, n), a, ik[p], c, t.k[p],
                                               p < P - 1, cg, r0);
        diq[p].narrow(0, r0, n).copy_(sums.gx * (t.k[p] * scale));
        ds.add_((sums.gx * iq[p].narrow(0, r0, n)).sum() * t.k[p]);
        dbias.add_(sums.g.sum() * t.k[p]);
        gemm_out(dq.narrow(0, r0, n).narrow(1, lo, m - lo), Hg, k_all.narrow(1, lo, m - lo));
        gemm_into_(dk.narrow(1, lo, m - lo), Hg.t(), qg.narrow(1, lo, m - lo), /*first=*/r0 == 0);
      }
    }
    auto dik = col_gx * torch::stack(t.k).unsqueeze(1);  // [P, N]
    const bool want_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(5);
    return {dq, dk, diq, dik, ctx->needs_input_grad(4) ? ds.reshape(scale.sizes()) : torch::Tensor(),
            want_bias ? dbias : torch::Tensor(), torch::Tensor()};
  }
};

// The features the GEMMs take and the inverse norms [P, n] of their
// prefixes, with the floor of `safe_normalize` (engine/prologue.h):
// x / max(||x||, 1e-12). Where some row's largest magnitude lies outside
// [1e-15, 1e15] (its products or squares could overflow or underflow), the
// rows are divided by it first (the factor detached: the normalised prefixes
// do not depend on it); otherwise they are taken as they are, and no copy is
// held for the backward.
std::pair<torch::Tensor, torch::Tensor> prefix_norms(const torch::Tensor& x, const std::vector<Prefix>& prefixes) {
  auto m = torch::linalg_vector_norm(x.detach(), std::numeric_limits<double>::infinity(), {1}, /*keepdim=*/true)
               .clamp_min(std::numeric_limits<float>::min());  // [n, 1]
  const bool in_range = x.size(0) == 0 || (m.min().item<double>() >= 1e-15 && m.max().item<double>() <= 1e15);
  auto y = in_range ? x : x / m;
  const auto floor = in_range ? torch::full({x.size(0), 1}, 1e-12, x.options()) : 1e-12 / m;  // [n, 1]
  // The squared norms of the slices, summed up to each prefix; the floor is
  // taken on the square (no gradient of sqrt at 0 reaches a zero row).
  const auto sq = y * y;  // [n, d]
  std::vector<torch::Tensor> slices;
  int64_t m0 = 0;
  for (const auto& pre : prefixes) {
    slices.push_back(sq.narrow(1, m0, pre.dim - m0).sum(1, /*keepdim=*/true));
    m0 = pre.dim;
  }
  auto ss = torch::cat(slices, 1).cumsum(1);                                 // [n, P]
  return {y, torch::maximum(ss, floor * floor).rsqrt().t().contiguous()};  // [P, n]
}

}  // namespace

bool prefix_pass_candidate(const c10::Device& device, c10::ScalarType dtype) {
  return device.is_cpu() && compute_dtype(dtype) == operand_dtype(dtype, device);
}

bool prefix_pass_candidate(const torch::Tensor& features) {
  return prefix_pass_candidate(features.device(), features.scalar_type());
}

bool prefix_pass_takes(const Prologue& p, const torch::Tensor& features) {
  return prefix_pass_candidate(features) && !p.tiled && !p.ring && p.dtype == p.operand;
}

torch::Tensor prefix_clip_block(const torch::Tensor& q, const torch::Tensor& k_all, const torch::Tensor& scale,
                                const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec,
                                const std::vector<Prefix>& prefixes) {
  auto state = c10::make_intrusive<PrefixState>();
  state->layout = layout;
  state->spec = spec;
  for (const auto& pre : prefixes) {
    state->dims.push_back(pre.dim);
    state->weights.push_back(pre.weight);
  }
  auto [yq, iq] = prefix_norms(q, prefixes);
  auto [yk, ik] = prefix_norms(k_all, prefixes);
  return PrefixClipBlock::apply(yq, yk, iq, ik, scale, bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt,
                                state);
}

}  // namespace contrax::detail
