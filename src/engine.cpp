// The contrastive-loss engine's materialised path: one logits buffer per rank,
// turned in place into the gradient G in backward (see contrax/detail/engine.h
// for the two ideas and the gradient convention).
#include "contrax/detail/engine.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "contrax/collectives.h"

namespace contrax::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Non-tensor state of one engine call, kept alive in the graph until backward.
struct BlockPlan : torch::CustomClassHolder {
  EngineLayout layout;
  bool symmetric = false;
  double inv_temperature = 1.0;  // NT-Xent
  bool consumed = false;         // the buffer has become G: a second backward would be wrong
};

// Log-sum-exp of every row of `x` ([R, C]), one [R, C] temporary. A row that
// is -inf throughout (a tile holding only a masked self column) gives -inf, not
// the NaN of -inf - -inf.
torch::Tensor rows_lse(const torch::Tensor& x) {
  auto m = x.amax(1);  // [R]
  m.masked_fill_(m == -kInf, 0.0);
  return (x - m.unsqueeze(1)).exp_().sum(1).log_().add_(m);  // [R]
}

// Log-sum-exp of every column of `x` ([R, C]), one [R, C] temporary; -inf for
// R == 0 (an empty rank's partial contributes nothing).
torch::Tensor cols_lse(const torch::Tensor& x) {
  if (x.size(0) == 0) return torch::full({x.size(1)}, -kInf, x.options());
  auto m = x.amax(0);                                          // [C]
  return (x - m.unsqueeze(0)).exp_().sum(0).log_().add_(m);  // [C]
}

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

void check_single_backward(BlockPlan& plan, const char* caller) {
  TORCH_CHECK(!torch::GradMode::is_enabled(), caller,
              "(): double backward (create_graph=true) is not supported");
  TORCH_CHECK(!plan.consumed, caller,
              "(): backward ran twice through the same graph; the materialised loss turns its logits buffer into "
              "the gradient in place, so retain_graph=true cannot reuse it (compute the loss again instead)");
  plan.consumed = true;
}

// ---------------------------------------------------------------------------
// CLIP / InfoNCE on one row block.
//
// Forward. S = (s q) k_all^T + bias, [b x B], the only [b x B] buffer. Row r0
// chunks give lse_row_i = log sum_j exp S_ij and, when symmetric, the partial
// column log-sum-exps over this rank's rows, combined across ranks into
// lse_col_j = log sum_{all global rows i} exp S_ij.
//
// Backward. Global loss (symmetric)
//   L = 1/(2B) sum_i (lse_row_i - S_ii) + 1/(2B) sum_j (lse_col_j - S_jj),
// so dL/dS_ij = 1/(2B) [softmax_row(S)_ij - [i=j] + exp(S_ij - lse_col_j) - [i=j]].
// Rank r's rows of that are computable locally once lse_col is known:
//   G_r = g (W/B)/2 [exp(S_r - lse_row) + exp(S_r - lse_col) - 2 I_r],
// the W from the gradient convention (engine.h), I_r the ones at (i, off+i).
// One direction: G_r = g (W/B) [exp(S_r - lse_row) - I_r]. With S = s q k^T + bias:
//   dq = s G k_all                     ([b, d], one GEMM)
//   dk_all = s G^T q                   ([B, d], one GEMM; the gather's backward
//                                       reduce-scatters it to the owners)
//   ds = sum_ij G_ij q_i.k_j = sum(q * (G k_all))   (reuses the dq GEMM)
//   dbias = sum_ij G_ij.
// Summed over ranks these are W times the global gradients, as required.
class ClipBlock : public torch::autograd::Function<ClipBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q /* [b, d] */,
                               const torch::Tensor& k_all /* [B, d] */, const torch::Tensor& scale /* [] */,
                               const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<BlockPlan>& plan) {
    const auto& L = plan->layout;
    const int64_t b = q.size(0), B = k_all.size(0);
    auto S = torch::mm(q * scale, k_all.t());  // [b, B]
    if (bias.has_value() && bias->defined()) S.add_(*bias);
    auto lse_row = torch::empty({b}, S.options());
    auto col_partial = torch::full({B}, -kInf, S.options());
    const int64_t R = chunk_rows(B, S.element_size());
    for (int64_t r0 = 0; r0 < b; r0 += R) {
      auto Sc = S.narrow(0, r0, std::min(R, b - r0));  // [R, B]
      lse_row.narrow(0, r0, Sc.size(0)).copy_(rows_lse(Sc));
      if (plan->symmetric) col_partial = torch::logaddexp(col_partial, cols_lse(Sc));
    }
    auto positive = S.diagonal(L.offset).clone();  // [b]: S_{i, off+i}
    auto total = (lse_row - positive).sum();
    torch::Tensor lse_col;
    if (plan->symmetric) {
      lse_col = combine_lse(col_partial, L);  // [B]
      total = (total + (lse_col.narrow(0, L.offset, b) - positive).sum()) * 0.5;
    }
    ctx->save_for_backward({q, k_all, scale});
    ctx->saved_data["S"] = S;
    ctx->saved_data["lse_row"] = lse_row;
    if (plan->symmetric) ctx->saved_data["lse_col"] = lse_col;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return total * (static_cast<double>(L.world) / static_cast<double>(L.total));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto plan = c10::static_intrusive_pointer_cast<BlockPlan>(ctx->saved_data["plan"].toCapsule());
    check_single_backward(*plan, "clip_loss");
    const auto& L = plan->layout;
    auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& k_all = saved[1];
    const auto& scale = saved[2];
    auto S = ctx->saved_data["S"].toTensor();
    auto lse_row = ctx->saved_data["lse_row"].toTensor();
    torch::Tensor lse_col;
    if (plan->symmetric) lse_col = ctx->saved_data["lse_col"].toTensor();
    const int64_t b = q.size(0), B = k_all.size(0);
    // g (W/B) (1/2 when symmetric), as a 0-dim tensor so that no host sync is needed.
    auto c = grads[0].to(S.scalar_type()) *
             (static_cast<double>(L.world) / static_cast<double>(L.total) * (plan->symmetric ? 0.5 : 1.0));
    const double ones = plan->symmetric ? 2.0 : 1.0;

    // S -> G in place, chunk by chunk (one [R, B] temporary for the column part).
    const int64_t R = chunk_rows(B, S.element_size());
    for (int64_t r0 = 0; r0 < b; r0 += R) {
      const int64_t n = std::min(R, b - r0);
      auto Sc = S.narrow(0, r0, n);
      torch::Tensor col;
      if (plan->symmetric) col = (Sc - lse_col.unsqueeze(0)).exp_();
      Sc.sub_(lse_row.narrow(0, r0, n).unsqueeze(1)).exp_();
      if (plan->symmetric) Sc.add_(col);
      Sc.diagonal(L.offset + r0).sub_(ones);
    }
    // S now holds G / c; the scalar c goes on the [b, d] and [B, d] products
    // instead of on the [b, B] buffer (one pass over it fewer).
    const auto& G_over_c = S;  // [b, B]
    auto Gk = torch::mm(G_over_c, k_all).mul_(c);  // [b, d]: G k_all
    auto dq = Gk * scale;
    torch::Tensor dk, ds, dbias;
    if (ctx->needs_input_grad(1)) dk = torch::mm(G_over_c.t(), q * (scale * c));  // [B, d]
    if (ctx->needs_input_grad(2)) ds = (Gk * q).sum().reshape(scale.sizes());
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(3)) dbias = G_over_c.sum() * c;
    return {dq, dk, ds, dbias, torch::Tensor()};
  }
};

// ---------------------------------------------------------------------------
// NT-Xent on one row block.
//
// Rows of the global Z = [z1_all; z2_all] ([2B, d]): view-1 row i of rank r is
// u = off + i, view-2 row i is u = B + off + i; the positive of u is the other
// view of the same example, pos(u) = u +- B (an involution), and S_uu = -inf.
//
// Forward. S_r = (z / T) Z^T ([2b x 2B], the only such buffer), self columns
// set to -inf (exact in every dtype: exp(-inf) = 0 in the softmax and in its
// gradient), lse_u per local row, then every row's lse all-gathered (O(B)).
//
// Backward. L = 1/(2B) sum_u (lse_u - S_{u,pos(u)}) gives
//   dL/dS_uv = 1/(2B) (P_uv - Y_uv),  P_uv = exp(S_uv - lse_u), Y_uv = [v = pos(u)],
// and S_uv = z_u.z_v / T depends on z_u and z_v, so
//   dL/dz_w = 1/(2B T) sum_v (P_wv - Y_wv + P_vw - Y_vw) z_v.
// S is symmetric: P_vw = exp(S_wv - lse_v), the entry of rank r's own row w at
// column v shifted by the (all-gathered) lse of row v; Y_vw = [w = pos(v)] =
// [v = pos(w)] = Y_wv. Hence, with the W of the gradient convention,
//   dz_r = G~ Z / T,  G~ = g W/(2B) [exp(S_r - lse_row) + exp(S_r - lse_all) - 2 Y_r],
// computed from rank r's block alone: no backward collective, and Z needs no
// gradient path (each rank's gradient for its own rows is complete).
class NtXentBlock : public torch::autograd::Function<NtXentBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& z /* [2b, d] */,
                               const torch::Tensor& z_all /* [2B, d] */, const c10::intrusive_ptr<BlockPlan>& plan) {
    const auto& L = plan->layout;
    const int64_t b2 = z.size(0), b = b2 / 2, B = L.total;
    auto S = torch::mm(z * plan->inv_temperature, z_all.t());  // [2b, 2B]
    auto idx = self_and_positive(b, L, z.device());
    S.index_put_({idx[0], idx[1]}, -kInf);
    auto positive = S.index({idx[0], idx[2]});  // [2b]
    auto lse = torch::empty({b2}, S.options());
    const int64_t R = chunk_rows(2 * B, S.element_size());
    for (int64_t r0 = 0; r0 < b2; r0 += R) {
      const int64_t n = std::min(R, b2 - r0);
      lse.narrow(0, r0, n).copy_(rows_lse(S.narrow(0, r0, n)));
    }
    // Every row's lse in global order [lse(z1_all); lse(z2_all)]: one O(B) gather.
    torch::Tensor lse_all = lse;
    if (L.world > 1) {
      auto pairs = L.comm->all_gather_rows(lse.view({2, b}).t().contiguous(), L.counts, "lse_all_gather");  // [B, 2]
      lse_all = pairs.t().reshape({2 * B});
    }
    ctx->save_for_backward({z_all});
    ctx->saved_data["S"] = S;
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["lse_all"] = lse_all;
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return (lse - positive).sum() * (static_cast<double>(L.world) / (2.0 * static_cast<double>(B)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto plan = c10::static_intrusive_pointer_cast<BlockPlan>(ctx->saved_data["plan"].toCapsule());
    check_single_backward(*plan, "nt_xent_loss");
    const auto& L = plan->layout;
    auto z_all = ctx->get_saved_variables()[0];
    auto S = ctx->saved_data["S"].toTensor();
    auto lse = ctx->saved_data["lse"].toTensor();
    auto lse_all = ctx->saved_data["lse_all"].toTensor();
    const int64_t b2 = S.size(0), b = b2 / 2, B = L.total;
    auto c = grads[0].to(S.scalar_type()) *
             (static_cast<double>(L.world) / (2.0 * static_cast<double>(B)) * plan->inv_temperature);
    const int64_t R = chunk_rows(2 * B, S.element_size());
    for (int64_t r0 = 0; r0 < b2; r0 += R) {
      const int64_t n = std::min(R, b2 - r0);
      auto Sc = S.narrow(0, r0, n);
      auto transposed = (Sc - lse_all.unsqueeze(0)).exp_();  // P^T rows; 0 on the self column
      Sc.sub_(lse.narrow(0, r0, n).unsqueeze(1)).exp_().add_(transposed);
    }
    auto idx = self_and_positive(b, L, S.device());
    S.index_put_({idx[0], idx[2]}, S.index({idx[0], idx[2]}) - 2.0);
    // G~ Z / T: the scalar c (which holds 1/T) goes on the [2b, d] product, not the buffer.
    return {torch::mm(S, z_all).mul_(c), torch::Tensor(), torch::Tensor()};
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

// ---------------------------------------------------------------------------
// Tiled forms: the same two ideas with logits recomputed one [tile x tile]
// block at a time (online log-sum-exp over row and column tiles in the
// forward, recomputation in the backward). Memory O(b x tile) instead of
// O(b x B); the GEMM work is the materialised path's plus one recomputation
// of the logits: 4 GEMM passes for symmetric CLIP where two tiled directions
// took 8.

// The entry (i, offset + i) of global coordinates inside a tile whose first row
// is row0 and first column col0 (may be empty).
torch::Tensor tile_diag(const torch::Tensor& tile, int64_t row0, int64_t col0, int64_t offset) {
  const int64_t shift = offset + row0 - col0;
  if (shift >= tile.size(1) || -shift >= tile.size(0)) return tile.narrow(0, 0, 0).select(1, 0);
  return tile.diagonal(shift);
}

struct TiledPlan : BlockPlan {
  int64_t tile = 64;
  bool ring = false;  // k is this rank's block and blocks travel around the ring
};

// Visits every key block: the gathered keys as one block at column 0, or the
// ring's blocks with their global first column.
void for_each_key_block(const TiledPlan& plan, const torch::Tensor& k,
                        const std::function<void(int64_t owner, int64_t col0, const torch::Tensor&)>& visit) {
  const auto& L = plan.layout;
  if (!plan.ring) return visit(L.rank, 0, k);
  std::vector<int64_t> starts(L.world, 0);
  for (int64_t s = 1; s < L.world; ++s) starts[s] = starts[s - 1] + L.counts[s - 1];
  ring_for_each_block(L.comm, L.counts, k,
                      [&](int64_t owner, const torch::Tensor& block) { visit(owner, starts[owner], block); });
}

// CLIP / InfoNCE, tiled. Gradient as ClipBlock's, entry by entry:
// G_ij = c [exp(S_ij - lse_row_i) (+ exp(S_ij - lse_col_j)) - (1 or 2)[j = off+i]],
// dq = s sum_j G_ij k_j, dk_j = s sum_i G_ij q_i, ds = sum_i q_i . (sum_j G_ij k_j),
// dbias = sum G; each tile adds its share.
class TiledClipBlock : public torch::autograd::Function<TiledClipBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q /* [b, d] */,
                               const torch::Tensor& k /* [B, d], or [b, d] in ring mode */,
                               const torch::Tensor& scale /* [] */, const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<TiledPlan>& plan) {
    const auto& L = plan->layout;
    const int64_t b = q.size(0), B = L.total, tile = plan->tile;
    const bool has_bias = bias.has_value() && bias->defined();
    auto qs = q * scale;  // [b, d]
    auto lse_row = torch::full({b}, -kInf, qs.options());
    auto col_partial = torch::full({plan->symmetric ? B : 0}, -kInf, qs.options());
    for_each_key_block(*plan, k, [&](int64_t, int64_t col0, const torch::Tensor& block) {
      for (int64_t r0 = 0; r0 < b; r0 += tile) {
        const int64_t R = std::min(tile, b - r0);
        auto lr = lse_row.narrow(0, r0, R);
        for (int64_t c0 = 0; c0 < block.size(0); c0 += tile) {
          const int64_t C = std::min(tile, block.size(0) - c0);
          auto t = torch::mm(qs.narrow(0, r0, R), block.narrow(0, c0, C).t());  // [R, C]
          if (has_bias) t.add_(*bias);
          lr.copy_(torch::logaddexp(lr, rows_lse(t)));
          if (plan->symmetric) {
            auto lc = col_partial.narrow(0, col0 + c0, C);
            lc.copy_(torch::logaddexp(lc, cols_lse(t)));
          }
        }
      }
    });
    auto own_keys = plan->ring ? k : k.narrow(0, L.offset, b);  // [b, d]: the positives
    auto positive = (qs * own_keys).sum(1);                      // [b]
    if (has_bias) positive = positive + *bias;
    auto total = (lse_row - positive).sum();
    torch::Tensor lse_col;
    if (plan->symmetric) {
      lse_col = combine_lse(col_partial, L);
      total = (total + (lse_col.narrow(0, L.offset, b) - positive).sum()) * 0.5;
    }
    ctx->save_for_backward({q, k, scale});
    ctx->saved_data["lse_row"] = lse_row;
    if (plan->symmetric) ctx->saved_data["lse_col"] = lse_col;
    ctx->saved_data["has_bias"] = has_bias;
    if (has_bias) ctx->saved_data["bias"] = bias->detach();
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return total * (static_cast<double>(L.world) / static_cast<double>(B));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(), "clip_loss(): double backward (create_graph=true) is not supported");
    auto plan = c10::static_intrusive_pointer_cast<TiledPlan>(ctx->saved_data["plan"].toCapsule());
    const auto& L = plan->layout;
    auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& k = saved[1];
    const auto& scale = saved[2];
    auto lse_row = ctx->saved_data["lse_row"].toTensor();
    torch::Tensor lse_col, bias;
    if (plan->symmetric) lse_col = ctx->saved_data["lse_col"].toTensor();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    if (has_bias) bias = ctx->saved_data["bias"].toTensor();
    const int64_t b = q.size(0), tile = plan->tile;
    const bool want_dk = ctx->needs_input_grad(1);
    const bool want_bias = has_bias && ctx->needs_input_grad(3);
    auto c = grads[0].to(q.scalar_type()) *
             (static_cast<double>(L.world) / static_cast<double>(L.total) * (plan->symmetric ? 0.5 : 1.0));
    const double ones = plan->symmetric ? 2.0 : 1.0;
    auto qs = q * scale;                 // [b, d]
    auto A = torch::zeros_like(q);       // [b, d]: sum_j G_ij k_j
    auto g_sum = torch::zeros({}, q.options());
    auto visit = [&](int64_t owner, int64_t col0, const torch::Tensor& block) {
      const bool own = owner == L.rank;
      const int64_t pos_offset = plan->ring ? 0 : L.offset;  // column of row 0's positive inside the block
      torch::Tensor dk = want_dk ? torch::zeros_like(block) : torch::Tensor();  // [n, d]
      for (int64_t c0 = 0; c0 < block.size(0); c0 += tile) {
        const int64_t C = std::min(tile, block.size(0) - c0);
        auto kt = block.narrow(0, c0, C);  // [C, d]
        for (int64_t r0 = 0; r0 < b; r0 += tile) {
          const int64_t R = std::min(tile, b - r0);
          auto t = torch::mm(qs.narrow(0, r0, R), kt.t());  // [R, C], then in place G
          if (has_bias) t.add_(bias);
          torch::Tensor col;
          if (plan->symmetric) col = (t - lse_col.narrow(0, col0 + c0, C).unsqueeze(0)).exp_();
          t.sub_(lse_row.narrow(0, r0, R).unsqueeze(1)).exp_();
          if (plan->symmetric) t.add_(col);
          if (own) tile_diag(t, r0, c0, pos_offset).sub_(ones);
          t.mul_(c);
          A.narrow(0, r0, R).addmm_(t, kt);
          if (want_dk) dk.narrow(0, c0, C).addmm_(t.t(), qs.narrow(0, r0, R));
          if (want_bias) g_sum.add_(t.sum());
        }
      }
      return dk;
    };
    torch::Tensor dk;
    if (!plan->ring) {
      dk = visit(L.rank, 0, k);
    } else {
      std::vector<int64_t> starts(L.world, 0);
      for (int64_t s = 1; s < L.world; ++s) starts[s] = starts[s - 1] + L.counts[s - 1];
      if (want_dk) {
        dk = ring_for_each_block_grad(L.comm, L.counts, k, [&](int64_t owner, const torch::Tensor& block) {
          return visit(owner, starts[owner], block);
        });
      } else {
        ring_for_each_block(L.comm, L.counts, k,
                            [&](int64_t owner, const torch::Tensor& block) { visit(owner, starts[owner], block); });
      }
    }
    auto dq = A * scale;
    torch::Tensor ds;
    if (ctx->needs_input_grad(2)) ds = (A * q).sum().reshape(scale.sizes());
    return {dq, dk, ds, want_bias ? g_sum : torch::Tensor(), torch::Tensor()};
  }
};

// NT-Xent, tiled, with the gathered Z (no gradient): NtXentBlock's gradient
// entry by entry. Row tiles never straddle the two views, so a tile's self and
// positive entries are each one diagonal: view-1 rows p = i have self column
// off + p and positive B + off + p; view-2 rows p = b + i have self column
// B + off + (p - b) and positive off + (p - b).
class TiledNtXentBlock : public torch::autograd::Function<TiledNtXentBlock> {
 public:
  static void for_each_tile(int64_t b, int64_t n_cols, int64_t tile, const EngineLayout& L,
                            const std::function<void(int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t self_off,
                                                     int64_t pos_off)>& fn) {
    for (int64_t v = 0; v < 2; ++v) {
      const int64_t self_off = v == 0 ? L.offset : L.total + L.offset - b;
      const int64_t pos_off = v == 0 ? L.total + L.offset : L.offset - b;
      for (int64_t r0 = v * b; r0 < (v + 1) * b; r0 += tile) {
        const int64_t R = std::min(tile, (v + 1) * b - r0);
        for (int64_t c0 = 0; c0 < n_cols; c0 += tile) fn(r0, R, c0, std::min(tile, n_cols - c0), self_off, pos_off);
      }
    }
  }

  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& z /* [2b, d] */,
                               const torch::Tensor& z_all /* [2B, d] */, const c10::intrusive_ptr<TiledPlan>& plan) {
    const auto& L = plan->layout;
    const int64_t b2 = z.size(0), b = b2 / 2, B = L.total;
    auto zs = z * plan->inv_temperature;  // [2b, d]
    auto lse = torch::full({b2}, -kInf, zs.options());
    for_each_tile(b, 2 * B, plan->tile, L, [&](int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t self_off, int64_t) {
      auto t = torch::mm(zs.narrow(0, r0, R), z_all.narrow(0, c0, C).t());  // [R, C]
      tile_diag(t, r0, c0, self_off).fill_(-kInf);
      auto lr = lse.narrow(0, r0, R);
      lr.copy_(torch::logaddexp(lr, rows_lse(t)));
    });
    auto i = torch::arange(b, torch::TensorOptions().dtype(torch::kLong).device(z.device()));
    auto pos_rows = torch::cat({i + (B + L.offset), i + L.offset});
    auto positive = (zs * z_all.index_select(0, pos_rows)).sum(1);  // [2b]
    torch::Tensor lse_all = lse;
    if (L.world > 1) {
      auto pairs = L.comm->all_gather_rows(lse.view({2, b}).t().contiguous(), L.counts, "lse_all_gather");  // [B, 2]
      lse_all = pairs.t().reshape({2 * B});
    }
    ctx->save_for_backward({z, z_all});
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["lse_all"] = lse_all;
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return (lse - positive).sum() * (static_cast<double>(L.world) / (2.0 * static_cast<double>(B)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(),
                "nt_xent_loss(): double backward (create_graph=true) is not supported");
    auto plan = c10::static_intrusive_pointer_cast<TiledPlan>(ctx->saved_data["plan"].toCapsule());
    const auto& L = plan->layout;
    auto saved = ctx->get_saved_variables();
    const auto& z = saved[0];
    const auto& z_all = saved[1];
    auto lse = ctx->saved_data["lse"].toTensor();
    auto lse_all = ctx->saved_data["lse_all"].toTensor();
    const int64_t b = z.size(0) / 2, B = L.total;
    auto c = grads[0].to(z.scalar_type()) *
             (static_cast<double>(L.world) / (2.0 * static_cast<double>(B)) * plan->inv_temperature);
    auto zs = z * plan->inv_temperature;
    auto A = torch::zeros_like(z);  // [2b, d]
    for_each_tile(b, 2 * B, plan->tile, L,
                  [&](int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t self_off, int64_t pos_off) {
                    auto zt = z_all.narrow(0, c0, C);
                    auto t = torch::mm(zs.narrow(0, r0, R), zt.t());  // [R, C], then in place G
                    tile_diag(t, r0, c0, self_off).fill_(-kInf);
                    auto transposed = (t - lse_all.narrow(0, c0, C).unsqueeze(0)).exp_();
                    t.sub_(lse.narrow(0, r0, R).unsqueeze(1)).exp_().add_(transposed);
                    tile_diag(t, r0, c0, pos_off).sub_(2.0);
                    A.narrow(0, r0, R).addmm_(t.mul_(c), zt);
                  });
    return {A, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

EngineLayout make_layout(const CommunicatorPtr& comm, std::vector<int64_t> counts) {
  EngineLayout l;
  l.world = comm ? comm->world_size() : 1;
  l.rank = comm ? comm->rank() : 0;
  l.comm = l.world > 1 ? comm : nullptr;
  l.counts = std::move(counts);
  for (size_t s = 0; s < l.counts.size(); ++s) {
    if (static_cast<int64_t>(s) < l.rank) l.offset += l.counts[s];
    l.total += l.counts[s];
  }
  return l;
}

c10::ScalarType compute_dtype(c10::ScalarType t) {
  return (t == c10::kHalf || t == c10::kBFloat16) ? c10::kFloat : t;
}

torch::Tensor safe_normalize(const torch::Tensor& x) {
  // x / max(|x|, eps) is unchanged by scaling x by any m > 0 together with eps,
  // so dividing by the row's largest magnitude first (a constant for autograd:
  // the function does not depend on it) changes nothing but the overflow.
  auto m = x.detach().abs().amax(1, /*keepdim=*/true).clamp_min(std::numeric_limits<float>::min());  // [n, 1]
  auto y = x / m;
  return y / torch::maximum(y.norm(2, 1, /*keepdim=*/true), 1e-12 / m);
}

torch::Tensor clamped_scale(const torch::Tensor& logit_scale, double max_scale) {
  // exp never sees more than log(max_scale), so its backward multiplies by a
  // finite number; at and above the clamp the constant branch is taken (zero
  // gradient, as min(exp(x), max) has wherever exp(x) >= max).
  const double log_max = std::log(max_scale);
  auto capped = logit_scale.clamp_max(log_max).exp();
  return torch::where(logit_scale < log_max, capped, torch::full_like(capped, max_scale));
}

int64_t logits_blocks(const std::string& loss) {
  if (loss == "nt_xent") return 4;
  if (loss == "moco_v3") return 2;
  return 1;
}

int64_t chunk_rows(int64_t cols, int64_t element_size, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(1, cols * element_size));
}

torch::Tensor clip_block_loss(const torch::Tensor& q, const torch::Tensor& k_all, const torch::Tensor& scale,
                              const torch::Tensor& bias, const EngineLayout& layout, bool symmetric) {
  auto plan = c10::make_intrusive<BlockPlan>();
  plan->layout = layout;
  plan->symmetric = symmetric;
  c10::optional<torch::Tensor> opt_bias;
  if (bias.defined()) opt_bias = bias;
  return ClipBlock::apply(q, k_all, scale, opt_bias, plan);
}

torch::Tensor tiled_clip_block_loss(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                                    const torch::Tensor& bias, const EngineLayout& layout, bool symmetric,
                                    int64_t tile, bool ring) {
  auto plan = c10::make_intrusive<TiledPlan>();
  plan->layout = layout;
  plan->symmetric = symmetric;
  plan->tile = tile;
  plan->ring = ring && layout.world > 1;
  c10::optional<torch::Tensor> opt_bias;
  if (bias.defined()) opt_bias = bias;
  return TiledClipBlock::apply(q, k, scale, opt_bias, plan);
}

torch::Tensor tiled_nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& z_all, double inv_temperature,
                                       const EngineLayout& layout, int64_t tile) {
  auto plan = c10::make_intrusive<TiledPlan>();
  plan->layout = layout;
  plan->inv_temperature = inv_temperature;
  plan->tile = tile;
  return TiledNtXentBlock::apply(z, z_all, plan);
}

torch::Tensor nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& z_all, double inv_temperature,
                                 const EngineLayout& layout) {
  auto plan = c10::make_intrusive<BlockPlan>();
  plan->layout = layout;
  plan->inv_temperature = inv_temperature;
  return NtXentBlock::apply(z, z_all, plan);
}

}  // namespace contrax::detail
