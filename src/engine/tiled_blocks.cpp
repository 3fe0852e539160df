// The tiled blocks (see engine/tiled_blocks.h): CLIP / InfoNCE / grouped and
// NT-Xent, each one autograd function that keeps only its inputs and per-row
// statistics, and walks the logits step by step (engine/tiles.h: the CPU's
// cache-sized tiles, a GPU's row panels) over the gathered keys or the ring's
// blocks.
#include "engine/tiled_blocks.h"

#include <algorithm>

#include "engine/block.h"
#include "engine/tiles.h"

namespace contrax::detail {

namespace {

struct TiledState : BlockState {
  TileWalk walk;      // tiles (CPU) or panels (CUDA): engine/panels.h
  bool ring = false;  // k is this rank's block and blocks travel around the ring
  std::shared_ptr<TileScorer> scorer;  // null: one dot product

  // Every rank's key block: g key rows per row of the layout.
  KeyBlocks key_blocks() const {
    return KeyBlocks(ring ? layout.comm : nullptr, layout.key_counts(spec.group), layout.rank);
  }
};

// The logits of tile `t` of key block `block` (first global column col0):
// qs rows times block rows (or the scorer's, `keep` as TileScorer::logits),
// plus the bias, with the masked diagonal (if any) at -inf.
torch::Tensor tile_logits(const TiledState& state, const torch::Tensor& qs /* [b, d] */,
                          const torch::Tensor& block /* [n, d] */, const torch::Tensor& scale,
                          const torch::Tensor& bias, const Tile& t, int64_t col0, bool keep) {
  auto s = state.scorer ? state.scorer->logits(qs, block, scale, t, keep)
                        : gemm(qs.narrow(0, t.r0, t.rows), block.narrow(0, t.c0, t.cols).t(),
                               compute_dtype(qs.scalar_type()));  // [R, C]
  if (bias.defined()) s.add_(bias);
  if (state.spec.masked >= 0) tile_diagonal(s, t.r0, col0 + t.c0, state.spec.masked).fill_(-kInf);
  return s;
}

// CLIP / InfoNCE / grouped, tiled: the materialised block's forward statistics
// and gradient (engine/block.h), one [tile x tile] block at a time; the label
// structure is recomputed per tile from the labels (O(R + C) each). With a
// TileScorer the steps' logits are its, and so is the step's backward from G
// (MaxSim's, derived in engine/maxsim_tiles.h); everything else is shared.
class TiledClipBlock : public torch::autograd::Function<TiledClipBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q /* [b, d] */,
                               const torch::Tensor& k /* [N, d], or [b g, d] in ring mode */,
                               const torch::Tensor& scale /* [] */, const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<TiledState>& state) {
    const auto& L = state->layout;
    const int64_t b = q.size(0), g = state->spec.group, d = q.size(1);
    const torch::Tensor bias_t = bias.has_value() ? *bias : torch::Tensor();
    const auto& scorer = state->scorer;
    auto qs = scorer ? q : q * scale;  // [b, d]; a scorer applies the scale itself
    ForwardStats st(*state, b, compute_options(qs));
    // A scorer's designated entries S_{i,pos(i)} are read off its steps (each
    // lies in one), not scored again.
    auto designated = scorer ? torch::empty({b}, compute_options(qs)) : torch::Tensor();
    const auto blocks = state->key_blocks();
    blocks.for_each(k, [&](int64_t, int64_t col0, const torch::Tensor& block) {
      for_each_tile(b, block.size(0), state->walk, [&](const Tile& t) {
        auto s = tile_logits(*state, qs, block, scale, bias_t, t, col0, /*keep=*/false);
        if (scorer) {
          const auto run = positives_in(t.r0, t.rows, col0 + t.c0, t.cols, L.offset, g);
          if (run.n > 0) designated.narrow(0, t.r0 + run.row, run.n).copy_(run_view(s, run, g));
        }
        auto P = apply_labels(*state, s, t.r0, col0 + t.c0);
        // A panel of the only block spans its rows: their lse is final.
        st.add(s, P, t.r0, col0 + t.c0, /*whole_rows=*/!blocks.ring() && t.cols == block.size(0));
      });
    });
    if (!scorer) {
      // The designated positives: every g-th row of this rank's own candidates
      // (global column (off + i) g, inside k at that column less k's first).
      const int64_t own0 = L.offset * g - (state->ring ? blocks.starts()[L.rank] : 0);
      auto own = k.narrow(0, own0, b * g);  // [b g, d]
      const auto c = compute_dtype(qs.scalar_type());
      designated = (qs.to(c) * own.reshape({b, g, d}).select(1, 0).to(c)).sum(1);  // [b]
      if (bias_t.defined()) designated = designated + bias_t;
    }
    RowTerms rt;
    auto l = finish_forward(*state, st, designated, rt);
    ctx->save_for_backward({q, k, scale});
    save_terms(ctx, rt);
    if (bias_t.defined()) ctx->saved_data["bias"] = bias_t.detach();
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return reduce_rows(l, L, state->spec.reduction);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto state = backward_state<TiledState>(ctx);
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& k = saved[1];
    const auto& scale = saved[2];
    const auto rt = saved_terms(ctx);
    const torch::Tensor bias = ctx->saved_data.count("bias") ? ctx->saved_data["bias"].toTensor() : torch::Tensor();
    const int64_t b = q.size(0);
    const bool want_dk = ctx->needs_input_grad(1);
    const bool want_bias = bias.defined() && ctx->needs_input_grad(3);
    const auto w = backward_weights(*state, grads[0], compute_dtype(q.scalar_type()));
    const auto& scorer = state->scorer;
    auto qs = scorer ? q : q * scale;  // [b, d]
    // The accumulators take their first product by assignment instead of a
    // zero fill (gemm_into_): A's rows at the first column step of the only
    // block (the ring sums A over blocks: zeros), a key block's dk rows at the
    // first row step (none when this rank has no rows: zeros). A scorer adds
    // to zeros (A is then dq itself: its scale is folded in).
    const bool one_block = !scorer && !state->ring && k.size(0) > 0;
    auto A = one_block ? torch::empty(q.sizes(), compute_options(q))
                       : torch::zeros(q.sizes(), compute_options(q));  // [b, d]: sum_j G_ij k_j
    auto g_sum = torch::zeros({}, compute_options(q));  // sum of G / c, or a scorer's dL/dscale
    auto dk = state->key_blocks().for_each_grad(k, want_dk, [&](int64_t, int64_t col0, const torch::Tensor& block) {
      // [n, d], summed in the compute dtype
      torch::Tensor dk_block;
      if (want_dk) dk_block = b > 0 && !scorer ? torch::empty(block.sizes(), compute_options(block))
                                               : torch::zeros(block.sizes(), compute_options(block));
      for_each_tile(
          b, block.size(0), state->walk,
          [&](const Tile& t) {
            auto kt = block.narrow(0, t.c0, t.cols);            // [C, d]
            auto s = tile_logits(*state, qs, block, scale, bias, t, col0, /*keep=*/true);  // [R, C], then G / c
            auto P = apply_labels(*state, s, t.r0, col0 + t.c0);
            // G in the keys' dtype with c folded in, for both GEMMs: one
            // kernel pass on the panel kernels (the bias's sum wants G / c:
            // then, and elsewhere, the gradient in place and one cast).
            torch::Tensor G =
                want_bias ? torch::Tensor() : kernel_gradient(*state, rt, w, s, t.r0, col0 + t.c0, kt.scalar_type());
            if (!G.defined()) {
              tile_gradient(*state, rt, w, s, P, t.r0, col0 + t.c0);
              if (want_bias) g_sum.add_(s.sum());  // sum of G / c (c applied once at the end)
              G = scaled_operand(s, w.c, kt.scalar_type());
            }
            if (scorer) return scorer->backward(G, qs, block, scale, t, A, dk_block, g_sum);
            gemm_into_(A.narrow(0, t.r0, t.rows), G, kt, one_block && t.c0 == 0);
            if (want_dk) gemm_into_(dk_block.narrow(0, t.c0, t.cols), G.t(), qs.narrow(0, t.r0, t.rows), t.r0 == 0);
          },
          /*columns_outer=*/true);
      return dk_block;
    });
    auto dq = (scorer ? A : A * scale).to(q.scalar_type());
    if (dk.defined()) dk = dk.to(k.scalar_type());
    torch::Tensor ds;
    if (ctx->needs_input_grad(2)) ds = (scorer ? g_sum : (A * q).sum()).reshape(scale.sizes());
    return {dq, dk, ds, want_bias ? g_sum.mul_(w.c) : torch::Tensor(), torch::Tensor()};
  }
};

// NT-Xent, tiled: the materialised block's gradient entry by entry, over the
// gathered Z (one block, no gradient) or, on the ring, over every rank's block
// [z1_s; z2_s] as it passes. Either way the backward needs no gradient
// collective: G~ (engine/block.h) of rank r's rows is computed from its own
// rows' logits and every row's lse (all-gathered, O(B)), so the ring's
// backward sends the (gradient-free) blocks around once more and nothing else.
// Row tiles never straddle the two views, so a tile's self and positive
// entries are each one diagonal (tile_diagonal's offset, per view v of the
// rows, with the block's own column numbers):
//   gathered Z, columns [z1_all; z2_all]: self off + p (view 1) and
//     B + off + p - b (view 2); positive B + off + p and off + p - b;
//   ring, the own block [z1_r; z2_r] (columns in local order): self p,
//     positive p + b (view 1) and p - b (view 2); other blocks have neither.
class TiledNtXentBlock : public torch::autograd::Function<TiledNtXentBlock> {
 public:
  struct Diagonals {
    bool any = false;                                   // does this block hold self/positive columns?
    int64_t self_off[2] = {0, 0}, pos_off[2] = {0, 0};  // per view of the rows
  };

  static Diagonals diagonals(const TiledState& state, int64_t owner) {
    const auto& L = state.layout;
    const int64_t b = L.counts[L.rank];
    Diagonals d;
    if (!state.ring) {
      d.any = true;
      d.self_off[0] = L.offset;
      d.self_off[1] = L.total + L.offset - b;
      d.pos_off[0] = L.total + L.offset;
      d.pos_off[1] = L.offset - b;
    } else if (owner == L.rank) {
      d.any = true;
      d.pos_off[0] = b;
      d.pos_off[1] = -b;
    }
    return d;
  }

  // The entries of a [2B] global-order vector ([z1_all rows; z2_all rows]) for
  // the columns of a block: all of it for the gathered Z; for the ring block
  // [z1_s; z2_s] of 2 b_s rows starting at key row col0 = 2 off_s (two key
  // rows per example), [v[off_s : off_s + b_s]; v[B + off_s : ...]].
  static torch::Tensor block_cols(const TiledState& state, int64_t col0, const torch::Tensor& block,
                                  const torch::Tensor& v /* [2B] */) {
    if (!state.ring || !v.defined()) return v;
    const int64_t off = col0 / 2, bs = block.size(0) / 2;
    return torch::cat({v.narrow(0, off, bs), v.narrow(0, state.layout.total + off, bs)});
  }

  // fn(tile, v) for the tiles of the block's columns against this rank's rows
  // of view v ([v b, (v + 1) b)), view by view.
  static void for_each_view_tile(int64_t b, int64_t n_cols, const TileWalk& walk,
                                 const std::function<void(const Tile&, int64_t v)>& fn) {
    for (int64_t v = 0; v < 2; ++v) {
      for_each_tile(b, n_cols, walk, [&](Tile t) {
        t.r0 += v * b;
        fn(t, v);
      });
    }
  }

  // keys: the gathered Z ([2B, d]) or, on the ring, this rank's own block
  // ([2b, d] = z without gradient).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& z /* [2b, d] */, const torch::Tensor& keys,
                               const c10::intrusive_ptr<TiledState>& state) {
    const int64_t b2 = z.size(0), b = b2 / 2;
    auto zs = z * state->inv_temperature;  // [2b, d]
    auto lse = torch::full({b2}, -kInf, compute_options(zs));
    state->key_blocks().for_each(keys, [&](int64_t owner, int64_t, const torch::Tensor& block) {
      const auto dg = diagonals(*state, owner);
      for_each_view_tile(b, block.size(0), state->walk, [&](const Tile& t, int64_t v) {
        auto s = gemm(zs.narrow(0, t.r0, t.rows), block.narrow(0, t.c0, t.cols).t(), lse.scalar_type());  // [R, C]
        if (dg.any) tile_diagonal(s, t.r0, t.c0, dg.self_off[v]).fill_(-kInf);
        auto lr = lse.narrow(0, t.r0, t.rows);
        lr.copy_(torch::logaddexp(lr, tile_lse(s, /*rows=*/true, /*cols=*/false).row));
      });
    });
    // S_{u, pos(u)}: view-1 row i against view-2 row i of the same example.
    auto zd = z.detach();
    auto swapped = torch::cat({zd.narrow(0, b, b), zd.narrow(0, 0, b)});  // [2b, d]
    auto positive = (zs.to(lse.scalar_type()) * swapped.to(lse.scalar_type())).sum(1);  // [2b]
    ctx->save_for_backward({z, keys});
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["lse_all"] = gather_view_lse(lse, state->layout);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return nt_reduce(lse - positive, *state);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto state = backward_state<TiledState>(ctx);
    const auto saved = ctx->get_saved_variables();
    const auto &z = saved[0], &keys = saved[1];
    auto lse = ctx->saved_data["lse"].toTensor();
    auto lse_all = ctx->saved_data["lse_all"].toTensor();
    const int64_t b = z.size(0) / 2;
    const auto w = nt_weights(*state, grads[0], compute_dtype(z.scalar_type()));
    auto zs = z * state->inv_temperature;
    // A's rows take their first product by assignment (no zero fill): at the
    // first column step of this rank's own block, the first visited (on the
    // ring too), which holds this rank's 2b rows' own columns.
    auto A = torch::empty(z.sizes(), compute_options(z));  // [2b, d]
    const auto blocks = state->key_blocks();
    blocks.for_each(keys, [&](int64_t owner, int64_t col0, const torch::Tensor& block) {
      const auto dg = diagonals(*state, owner);
      const auto lse_cols = block_cols(*state, col0, block, lse_all);
      const auto w_cols = block_cols(*state, col0, block, w.all);
      for_each_view_tile(b, block.size(0), state->walk, [&](const Tile& t, int64_t v) {
        auto zt = block.narrow(0, t.c0, t.cols);
        auto s = gemm(zs.narrow(0, t.r0, t.rows), zt.t(), A.scalar_type());  // [R, C], then in place G
        if (dg.any) tile_diagonal(s, t.r0, t.c0, dg.self_off[v]).fill_(-kInf);
        softmax_grad_(s, lse.narrow(0, t.r0, t.rows), w.row.defined() ? w.row.narrow(0, t.r0, t.rows) : torch::Tensor(),
                      lse_cols.narrow(0, t.c0, t.cols),
                      w_cols.defined() ? w_cols.narrow(0, t.c0, t.cols) : torch::Tensor());
        auto pos = dg.any ? tile_diagonal(s, t.r0, t.c0, dg.pos_off[v]) : s.narrow(0, 0, 0).select(1, 0);
        if (pos.numel() > 0) {
          if (w.row.defined()) {
            // The diagonal's first row: max(0, -(pos_off + r0 - c0)) within the tile.
            const int64_t first = std::max<int64_t>(0, -(dg.pos_off[v] + t.r0 - t.c0));
            pos.sub_(w.row.narrow(0, t.r0 + first, pos.numel()) * 2.0);
          } else {
            pos.sub_(2.0);
          }
        }
        gemm_into_(A.narrow(0, t.r0, t.rows), scaled_operand(s, w.c, zt.scalar_type()), zt,  // cast once, c folded
                   owner == blocks.rank() && t.c0 == 0);
      });
    });
    return {A.to(z.scalar_type()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor tiled_clip_block(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                               const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec,
                               const TileWalk& walk, bool ring, std::shared_ptr<TileScorer> scorer) {
  auto state = c10::make_intrusive<TiledState>();
  state->layout = layout;
  state->spec = spec;
  state->walk = walk;
  state->ring = ring && layout.world > 1;
  state->scorer = std::move(scorer);
  return TiledClipBlock::apply(q, k, scale, bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt, state);
}

torch::Tensor tiled_nt_xent_block(const torch::Tensor& z, const torch::Tensor& keys, double inv_temperature,
                                  const EngineLayout& layout, const TileWalk& walk, Reduction reduction, bool ring) {
  auto state = c10::make_intrusive<TiledState>();
  state->layout = layout;
  state->reduction = reduction;
  state->inv_temperature = inv_temperature;
  state->walk = walk;
  state->ring = ring && layout.world > 1;
  state->spec.group = 2;  // key rows per example (its two views): a ring block is [z1_s; z2_s]
  return TiledNtXentBlock::apply(z, state->ring ? z.detach() : keys, state);
}

}  // namespace contrax::detail
