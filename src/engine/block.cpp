// The terms both forms of the InfoNCE-family block compute (see
// engine/block.h for the derivation).
#include "engine/block.h"

#include <algorithm>
#include <cmath>

namespace contrax::detail {

namespace {

// Combines per-rank partial log-sum-exps ([C] on every rank) into the global
// one. An all-gather of the W partials and a local logsumexp: exact, one
// collective, and for W <= 4 no more bytes than the all-reduce of maxima
// followed by the all-reduce of shifted sums ((W-1) C vs 4 (W-1)/W C floats).
torch::Tensor combine_lse(const torch::Tensor& partial /* [C] */, const EngineLayout& layout) {
  if (layout.world == 1) return partial;
  auto all = layout.comm->all_gather_rows(partial.unsqueeze(0).contiguous(), std::vector<int64_t>(layout.world, 1),
                                          "lse_all_gather");  // [W, C]
  return all.logsumexp(0);
}

}  // namespace

PositiveRun positives_in(int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t offset, int64_t g) {
  auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  const int64_t lo = std::max(r0, ceil_div(c0, g) - offset);
  const int64_t hi = std::min(r0 + R, ceil_div(c0 + C, g) - offset);
  if (hi <= lo) return {};
  return {lo - r0, (offset + lo) * g - c0, hi - lo};
}

torch::Tensor run_view(const torch::Tensor& t, const PositiveRun& p, int64_t g) {
  if (p.n == 0) return torch::empty({0}, t.options());
  return t.as_strided({p.n}, {t.stride(0) + g * t.stride(1)},
                      t.storage_offset() + p.row * t.stride(0) + p.col * t.stride(1));
}

torch::Tensor run_cols(const torch::Tensor& v, const PositiveRun& p, int64_t g) {
  if (p.n == 0) return v.narrow(0, 0, 0);
  return v.slice(0, p.col, p.col + (p.n - 1) * g + 1, g);
}

std::optional<panels::Masks> kernel_masks(const BlockState& state, const torch::Tensor& t, int64_t r0, int64_t c0) {
  if (!state.by_index.has_value()) state.by_index = panel_kernels_take(t);
  if (!*state.by_index) return std::nullopt;
  panels::Masks m;
  m.row0 = r0, m.col0 = c0;
  m.positives = !state.multi();
  m.multi = state.multi();  // P_ij by index: the labels and the designated positive
  m.pos_offset = state.layout.offset, m.group = state.spec.group;
  if (state.labeled()) {
    m.row_labels = state.spec.row_labels.data_ptr<int64_t>() + r0;
    m.col_labels = state.spec.col_labels.data_ptr<int64_t>() + c0;
  }
  return m;
}

torch::Tensor apply_labels(const BlockState& state, torch::Tensor& t, int64_t r0, int64_t c0) {
  if (!state.labeled()) return {};
  if (kernel_masks(state, t, r0, c0)) return {};  // masked, or P summed, by index in the kernels
  const int64_t R = t.size(0), C = t.size(1), g = state.spec.group;
  auto eq = state.spec.row_labels.narrow(0, r0, R).unsqueeze(1) ==
            state.spec.col_labels.narrow(0, c0, C).unsqueeze(0);  // [R, C] bool, contiguous
  auto run = positives_in(r0, R, c0, C, state.layout.offset, g);
  if (!state.multi()) {
    run_view(eq, run, g).fill_(false);  // the designated positive is never masked
    t.masked_fill_(eq, -kInf);
    return {};
  }
  run_view(eq, run, g).fill_(true);  // ... and always a positive
  return eq.to(t.scalar_type());
}

ForwardStats::ForwardStats(const BlockState& state_, int64_t b, const torch::TensorOptions& opt, bool online_cols)
    : state(state_) {
  const bool sym = state.spec.symmetric, multi = state.multi();
  const int64_t N = state.n_cols();
  lse_row = torch::full({b}, -kInf, opt);
  if (multi) pos_row = torch::zeros({b}, opt), n_row = torch::zeros({b}, opt);
  if (sym && online_cols) cols = std::make_unique<ColumnLse>(N, opt);
  if (sym && multi) pos_col = torch::zeros({N}, opt), n_col = torch::zeros({N}, opt);
}

void ForwardStats::add(const torch::Tensor& t, const torch::Tensor& P, int64_t r0, int64_t c0, bool whole_rows) {
  const int64_t R = t.size(0), C = t.size(1);
  const auto m = kernel_masks(state, t, r0, c0);
  const panels::Masks* masks = m ? &*m : nullptr;
  auto lr = lse_row.narrow(0, r0, R);
  // Final rows on the panel kernels: written into lse_row by the kernel itself.
  const auto direct = whole_rows && m ? lr : torch::Tensor();
  // Multi-positive labels on the panel kernels: P's sums added in the same pass.
  PositiveSums sums;
  if (m && state.multi()) {
    sums.row = pos_row.narrow(0, r0, R), sums.row_n = n_row.narrow(0, r0, R);
    if (pos_col.defined()) sums.col = pos_col.narrow(0, c0, C), sums.col_n = n_col.narrow(0, c0, C);
  }
  const PositiveSums* by_index = sums.row.defined() ? &sums : nullptr;
  auto row = cols ? cols->add(t, c0, /*rows=*/true, masks, direct, by_index)
                  : tile_lse(t, /*rows=*/true, /*cols=*/false, masks, direct, by_index).row;
  if (!direct.defined()) lr.copy_(whole_rows ? row : torch::logaddexp(lr, row));
  if (P.defined()) {
    auto tp = t * P;  // multi-positive masks nothing: t is finite
    pos_row.narrow(0, r0, R).add_(tp.sum(1));
    n_row.narrow(0, r0, R).add_(P.sum(1));
    if (pos_col.defined()) {
      pos_col.narrow(0, c0, C).add_(tp.sum(0));
      n_col.narrow(0, c0, C).add_(P.sum(0));
    }
  }
}

void ForwardStats::finish() {
  if (cols) lse_col = cols->lse();
}

void save_terms(torch::autograd::AutogradContext* ctx, const RowTerms& rt) {
  ctx->saved_data["lse_row"] = rt.lse_row;
  if (rt.lse_col.defined()) ctx->saved_data["lse_col"] = rt.lse_col;
  if (rt.inv_n_row.defined()) ctx->saved_data["inv_n_row"] = rt.inv_n_row;
  if (rt.inv_n_col.defined()) ctx->saved_data["inv_n_col"] = rt.inv_n_col;
}

RowTerms saved_terms(torch::autograd::AutogradContext* ctx) {
  auto get = [&](const char* key) {
    return ctx->saved_data.count(key) ? ctx->saved_data[key].toTensor() : torch::Tensor();
  };
  return {get("lse_row"), get("lse_col"), get("inv_n_row"), get("inv_n_col")};
}

torch::Tensor finish_forward(const BlockState& state, ForwardStats& st, const torch::Tensor& designated,
                             RowTerms& out) {
  const auto& L = state.layout;
  const int64_t b = designated.size(0), N = state.n_cols();
  st.finish();
  out.lse_row = st.lse_row;
  auto l = st.lse_row - (state.multi() ? st.pos_row / st.n_row : designated);  // [b]
  if (state.multi()) out.inv_n_row = st.n_row.reciprocal();
  if (state.spec.symmetric) {
    torch::Tensor col_pos;  // [b]: the positive term of this rank's columns
    if (state.multi()) {
      // lse, positive sum and count of every column, over all ranks' rows: one gather.
      auto mine = torch::cat({st.lse_col, st.pos_col, st.n_col}).unsqueeze(0);  // [1, 3N]
      auto all = L.world == 1 ? mine
                              : L.comm->all_gather_rows(mine.contiguous(), std::vector<int64_t>(L.world, 1),
                                                        "lse_all_gather");  // [W, 3N]
      out.lse_col = all.narrow(1, 0, N).logsumexp(0);
      auto pos_sum = all.narrow(1, N, N).sum(0), n = all.narrow(1, 2 * N, N).sum(0);
      out.inv_n_col = n.reciprocal();
      col_pos = (pos_sum * out.inv_n_col).narrow(0, L.offset, b);
    } else {
      out.lse_col = combine_lse(st.lse_col, L);
      col_pos = designated;  // S_{i, off+i}: group is 1
    }
    l = (l + out.lse_col.narrow(0, L.offset, b) - col_pos) * 0.5;
  }
  return l;
}

torch::Tensor reduce_rows(const torch::Tensor& l, const EngineLayout& L, Reduction r) {
  switch (r) {
    case Reduction::kNone:
      return l;
    case Reduction::kSum:
      return l.sum() * static_cast<double>(L.world);
    case Reduction::kMean:
      break;
  }
  return l.sum() * (static_cast<double>(L.world) / static_cast<double>(L.total));
}

Weights backward_weights(const BlockState& state, const torch::Tensor& grad, c10::ScalarType dt) {
  const auto& L = state.layout;
  const double h = state.spec.symmetric ? 0.5 : 1.0;
  Weights w;
  if (state.spec.reduction == Reduction::kNone) {
    w.c = torch::scalar_tensor(h, grad.options().dtype(dt));
    w.row = grad.to(dt).contiguous();  // [b]
    if (state.spec.symmetric) {
      // Every column's owner's upstream gradient: one O(B) gather, which is
      // why every rank must run backward with kNone.
      w.col = L.world == 1 ? w.row : L.comm->all_gather_rows(w.row, L.counts, "grad_all_gather");  // [B]
    }
    return w;
  }
  const double f = state.spec.reduction == Reduction::kSum
                       ? static_cast<double>(L.world)
                       : static_cast<double>(L.world) / static_cast<double>(L.total);
  w.c = grad.to(dt) * (f * h);
  return w;
}

torch::Tensor positive_targets(const BlockState& state, const Weights& w, const PositiveRun& run, int64_t r0,
                               int64_t c0, const torch::TensorOptions& options) {
  const bool sym = state.spec.symmetric;
  if (!w.row.defined()) return torch::full({run.n}, sym ? 2.0 : 1.0, options);
  auto y = w.row.narrow(0, r0 + run.row, run.n);
  return sym ? y + w.col.narrow(0, c0 + run.col, run.n) : y;  // group 1: columns consecutive
}

void subtract_positives(const BlockState& state, const Weights& w, torch::Tensor& t, int64_t r0, int64_t c0) {
  const int64_t g = state.spec.group;
  const auto run = positives_in(r0, t.size(0), c0, t.size(1), state.layout.offset, g);
  if (run.n == 0) return;
  auto diag = run_view(t, run, g);
  if (!w.row.defined()) {
    diag.sub_(state.spec.symmetric ? 2.0 : 1.0);  // one launch, no vector of 1s and 2s
    return;
  }
  diag.sub_(positive_targets(state, w, run, r0, c0, t.options()));
}

namespace {

// Multi-positive labels' targets of a tile for the panel kernels (undefined
// without them).
PositiveCounts counts_of(const BlockState& state, const RowTerms& rt, const torch::Tensor& t, int64_t r0,
                         int64_t c0) {
  if (!state.multi()) return {};
  PositiveCounts n;
  n.inv_n_row = rt.inv_n_row.narrow(0, r0, t.size(0));
  if (state.spec.symmetric) n.inv_n_col = rt.inv_n_col.narrow(0, c0, t.size(1));
  return n;
}

}  // namespace

torch::Tensor kernel_gradient(const BlockState& state, const RowTerms& rt, const Weights& w, torch::Tensor& t,
                              int64_t r0, int64_t c0, c10::ScalarType op) {
  const auto m = kernel_masks(state, t, r0, c0);
  const bool writable = op == t.scalar_type() || (t.scalar_type() == torch::kFloat &&
                                                  (op == torch::kBFloat16 || op == torch::kHalf));
  if (!m || !writable) return {};
  const int64_t R = t.size(0), C = t.size(1);
  const bool sym = state.spec.symmetric;
  auto out = op == t.scalar_type() ? t : torch::empty(t.sizes(), t.options().dtype(op));  // [R, C]
  softmax_grad_into(t, rt.lse_row.narrow(0, r0, R), w.row.defined() ? w.row.narrow(0, r0, R) : torch::Tensor(),
                    sym ? rt.lse_col.narrow(0, c0, C) : torch::Tensor(),
                    sym && w.col.defined() ? w.col.narrow(0, c0, C) : torch::Tensor(), &*m, w.c, out,
                    counts_of(state, rt, t, r0, c0));
  return out;
}

void tile_gradient(const BlockState& state, const RowTerms& rt, const Weights& w, torch::Tensor& t,
                   const torch::Tensor& P, int64_t r0, int64_t c0) {
  const int64_t R = t.size(0), C = t.size(1);
  const bool sym = state.spec.symmetric;
  // w_i exp(S_ij - lse_row_i) [+ w_j exp(S_ij - lse_col_j)], fused, in place;
  // on the panel kernels, masked entries and the -Y terms (the designated
  // positives', or multi-positive labels') by index in the same pass.
  const auto m = kernel_masks(state, t, r0, c0);
  softmax_grad_(t, rt.lse_row.narrow(0, r0, R), w.row.defined() ? w.row.narrow(0, r0, R) : torch::Tensor(),
                sym ? rt.lse_col.narrow(0, c0, C) : torch::Tensor(),
                sym && w.col.defined() ? w.col.narrow(0, c0, C) : torch::Tensor(), m ? &*m : nullptr,
                m ? counts_of(state, rt, t, r0, c0) : PositiveCounts());
  if (P.defined()) {
    auto yr = rt.inv_n_row.narrow(0, r0, R);
    if (w.row.defined()) yr = yr * w.row.narrow(0, r0, R);
    t.sub_(P * yr.unsqueeze(1));
    if (sym) {
      auto yc = rt.inv_n_col.narrow(0, c0, C);
      if (w.col.defined()) yc = yc * w.col.narrow(0, c0, C);
      t.sub_(P * yc.unsqueeze(0));
    }
    return;
  }
  if (!m) subtract_positives(state, w, t, r0, c0);
}

NtWeights nt_weights(const BlockState& state, const torch::Tensor& grad, c10::ScalarType dt) {
  const auto& L = state.layout;
  const double B = static_cast<double>(L.total);
  NtWeights w;
  if (state.reduction != Reduction::kNone) {
    w.c = grad.to(dt) * (static_cast<double>(L.world) / (2.0 * B) * state.inv_temperature);
    return w;
  }
  auto half = grad.to(dt).contiguous() * 0.5;                                                   // [b]
  auto all = L.world == 1 ? half : L.comm->all_gather_rows(half, L.counts, "grad_all_gather");  // [B]
  w.row = torch::cat({half, half});
  w.all = torch::cat({all, all});
  w.c = torch::scalar_tensor(state.inv_temperature, grad.options().dtype(dt));
  return w;
}

torch::Tensor gather_view_lse(const torch::Tensor& lse, const EngineLayout& L) {
  if (L.world == 1) return lse;
  const int64_t b = lse.size(0) / 2;
  auto pairs = L.comm->all_gather_rows(lse.view({2, b}).t().contiguous(), L.counts, "lse_all_gather");  // [B, 2]
  return pairs.t().reshape({2 * L.total});
}

torch::Tensor nt_reduce(const torch::Tensor& l, const BlockState& state) {
  const auto& L = state.layout;
  if (state.reduction == Reduction::kNone) return l.view({2, -1}).mean(0);  // [b]
  return l.sum() * (static_cast<double>(L.world) / (2.0 * static_cast<double>(L.total)));
}

bool bound_fits(double M, c10::ScalarType t) {
  const double range = t == torch::kDouble ? 700.0 : 80.0;
  return bounded_shift_enabled() && M >= 0 && std::isfinite(M) && 2.0 * M <= range;
}

torch::Tensor shift_factors(double M, const torch::Tensor& lse, const torch::Tensor& w) {
  auto f = (M - lse).exp_();
  return w.defined() ? f.mul_(w) : f;
}

int64_t label_panel_rows(int64_t cols, const torch::Tensor& like) {
  const int64_t bytes = like.device().is_cpu() ? int64_t{1} << 20 : int64_t{64} << 20;
  return std::max<int64_t>(1, bytes / std::max<int64_t>(1, cols * like.element_size()));
}

}  // namespace contrax::detail
