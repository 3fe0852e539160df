// MaxSim scores in bounded panels (engine/maxsim.h, with the derivation of
// the backward).
#include "engine/maxsim.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <string>

#include "engine/panels.h"

namespace contrax::detail {

MaxSimPanel maxsim_panel(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& document_mask,
                         const torch::Tensor& floor) {
  // The token scores, masked document tokens at -inf, reduced over the
  // document's tokens, then raised to the documents' floor.
  const int64_t pi = q.size(0), Lq = q.size(1), pj = d.size(0), Ld = d.size(1);
  auto t = torch::mm(q.reshape({pi * Lq, -1}), d.reshape({pj * Ld, -1}).t()).view({pi, Lq, pj, Ld});
  t.masked_fill_(document_mask.logical_not().view({1, 1, pj, Ld}), -std::numeric_limits<double>::infinity());
  auto [best, at] = t.max(3);
  if (floor.numel() == 0) return {best, at, {}};
  auto won = best >= floor.view({1, 1, pj});
  return {torch::maximum(best, floor.view({1, 1, pj})), at, won};
}

torch::Tensor maxsim_panel_scores(const MaxSimPanel& p, const torch::Tensor& weight) {
  return (p.best * weight.unsqueeze(2)).sum(1);
}

void maxsim_panel_backward(const MaxSimPanel& p, const torch::Tensor& g, const torch::Tensor& weight,
                           const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& dq,
                           const torch::Tensor& dd) {
  const int64_t pi = q.size(0), Lq = q.size(1), pj = d.size(0), Ld = d.size(1), width = q.size(2);
  // a_itj = G_ij m_it at each query token's best document token, 0 where the
  // floor won (a constant).
  auto a = g.unsqueeze(1) * weight.unsqueeze(2);  // [pi, Lq, pj]
  if (p.won.defined()) a = a * p.won.to(a.scalar_type());
  // The best token of (i, t, j) as a row of the panel's [pj Ld, width] documents.
  auto best = (torch::arange(pj, p.at.options()).view({1, 1, pj}) * Ld + p.at).reshape(-1);  // [pi Lq pj]
  auto chosen = d.reshape({pj * Ld, width}).index_select(0, best).view({pi * Lq, pj, width});
  // dq_it = sum_j a_itj d_{j s*}: a [1 x pj] x [pj x width] product per query token.
  dq.add_(torch::bmm(a.reshape({pi * Lq, 1, pj}), chosen).view({pi, Lq, width}));
  if (!dd.defined()) return;
  // dd_{j s*} += a_itj q_it over every (i, t) whose best token it is.
  auto sent = (a.unsqueeze(3) * q.unsqueeze(2)).reshape({pi * Lq * pj, width});
  dd.index_add_(0, best, sent);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows of queries and documents per panel (pair_step, engine/panels.h): all
// queries when one document's token work for all of them fits, else as many
// as fit; then as many documents as fit beside them.
StepShape panel_shape(int64_t n, int64_t Lq, int64_t m, int64_t Ld, int64_t bytes, int64_t budget) {
  return pair_step(n, m, Lq * Ld * bytes, budget, std::numeric_limits<int64_t>::max());
}

struct MaxSim : torch::autograd::Function<MaxSim> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& d,
                               const torch::Tensor& weight, const torch::Tensor& d_mask, const torch::Tensor& floor,
                               int64_t budget, const std::string& caller) {
    const int64_t n = q.size(0), m = d.size(0);
    auto scores = torch::zeros({n, m}, q.options());
    const auto [rows, cols] = panel_shape(n, q.size(1), m, d.size(1), q.element_size(), budget);
    for (int64_t i = 0; i < n; i += rows) {
      const int64_t pi = std::min(rows, n - i);
      for (int64_t j = 0; j < m; j += cols) {
        const int64_t pj = std::min(cols, m - j);
        auto p = maxsim_panel(q.narrow(0, i, pi), d.narrow(0, j, pj), d_mask.narrow(0, j, pj),
                              floor.numel() ? floor.narrow(0, j, pj) : floor);
        scores.narrow(0, i, pi).narrow(1, j, pj).copy_(maxsim_panel_scores(p, weight.narrow(0, i, pi)));
      }
    }
    ctx->save_for_backward({q, d, weight, d_mask, floor});
    ctx->saved_data["budget"] = budget;
    ctx->saved_data["caller"] = caller;
    return scores;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    TORCH_CHECK(!torch::GradMode::is_enabled(), ctx->saved_data["caller"].toStringRef(),
                "(): double backward (create_graph=true) is not supported");
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &d = saved[1], &weight = saved[2], &d_mask = saved[3], &floor = saved[4];
    const auto g = grads[0].contiguous();  // [n, m]
    const int64_t n = q.size(0), Lq = q.size(1), m = d.size(0), Ld = d.size(1), width = q.size(2);
    auto dq = torch::zeros_like(q), dd = torch::zeros_like(d);
    // A panel holds its token scores and the chosen tokens' rows ([pi Lq pj, width]).
    const auto [rows, cols] =
        panel_shape(n, Lq, m, std::max(Ld, width), q.element_size(), ctx->saved_data["budget"].toInt());
    for (int64_t i = 0; i < n; i += rows) {
      const int64_t pi = std::min(rows, n - i);
      auto qp = q.narrow(0, i, pi);
      for (int64_t j = 0; j < m; j += cols) {
        const int64_t pj = std::min(cols, m - j);
        auto dp = d.narrow(0, j, pj);
        auto p = maxsim_panel(qp, dp, d_mask.narrow(0, j, pj), floor.numel() ? floor.narrow(0, j, pj) : floor);
        maxsim_panel_backward(p, g.narrow(0, i, pi).narrow(1, j, pj), weight.narrow(0, i, pi), qp, dp,
                              dq.narrow(0, i, pi), dd.narrow(0, j, pj).view({pj * Ld, width}));
      }
    }
    return {dq, dd, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor maxsim_scores(const torch::Tensor& queries, const torch::Tensor& query_weight,
                            const torch::Tensor& documents, const torch::Tensor& document_mask,
                            const torch::Tensor& floor, int64_t panel_bytes, const EngineLayout& layout) {
  // An empty tensor stands for no floor: the autograd function takes defined tensors.
  return MaxSim::apply(queries, documents, query_weight, document_mask,
                       floor.defined() ? floor : torch::empty({0}, queries.options()), panel_bytes,
                       std::string(layout.caller));
}

}  // namespace contrax::detail
