// SigLIP's block on one rank (declared in engine/engine.h, the seam): one
// autograd function over the key blocks and the engine's walk of each
// (engine/tiles.h; one tile when materialised). Where the CUDA panel kernels
// are on (engine/lse_kernels.h: CONTRAX_FUSED_KERNELS=1), each panel's loss,
// gradient and bias-gradient sums are one kernel pass (cuda_siglip_panel.cuh);
// with the keys gathered and a gradient wanted, the forward also runs the
// gradient's GEMMs, as siglip-kernel does, so the backward only scales what the
// forward summed and reads no logits again. On the ring the blocks travel
// again in the backward, which recomputes each panel (with the kernel where it
// is on).
#include <algorithm>
#include <optional>
#include <utility>

#include "engine/engine.h"
#include "engine/lse_kernels.h"
#include "engine/tiles.h"

namespace contrax::detail {

namespace {

struct SigLipState : torch::CustomClassHolder {
  EngineLayout layout;  // null comm or world 1: b holds every row
  TileWalk walk;        // tiles (CPU) or panels (CUDA): engine/panels.h; one tile when materialised
  bool ring = false;            // b is this rank's block, the others travel; else b holds every row
  std::optional<PanelDevice> kernels;  // the fused panel kernels, where on
  bool forward_grads = false;  // the forward runs the gradient's GEMMs (kernels, gathered keys, a gradient wanted)
  bool want_db = false;        // ... and the keys' among them
  double weight = 1.0;         // L_r = weight sum_i f_i
  KeyBlocks key_blocks() const {
    if (ring) return KeyBlocks(layout.comm, layout.counts, layout.rank);
    return KeyBlocks(nullptr, {layout.total}, layout.rank);
  }
  // Where row i's positive lies in a block: column i of this rank's own block
  // on the ring, column offset + i of the gathered keys; -1 in another rank's.
  int64_t positives(int64_t owner) const {
    if (owner != layout.rank) return -1;
    return ring ? 0 : layout.offset;
  }
};

// x_ij = as_i . b_j for tile `t` of one block, in the compute dtype.
torch::Tensor raw_logits(const torch::Tensor& as /* [b, d] */, const torch::Tensor& block /* [n, d] */,
                         const Tile& t) {
  return gemm(as.narrow(0, t.r0, t.rows), block.narrow(0, t.c0, t.cols).t(),
                      compute_dtype(as.scalar_type()));  // [R, C]
}

// y_ij = -z_ij x_ij for tile `t` of one block: x = as @ bt^T + bias, sign
// flipped on the positives (i, positive + i) when the block holds them.
torch::Tensor signed_logits(const torch::Tensor& as /* [b, d] */, const torch::Tensor& block /* [n, d] */,
                            const c10::optional<torch::Tensor>& bias, int64_t positive, const Tile& t) {
  auto y = raw_logits(as, block, t);
  if (bias.has_value()) y.add_(*bias);
  if (positive >= 0) tile_diagonal(y, t.r0, t.c0, positive).neg_();
  return y;
}

// The fused kernel over tile `t`: each row's loss sum f_i and, with `h`
// ([R, C], the GEMMs' operand dtype), h_ij = df_i/dx_ij written there and its
// row sums (`.second`).
std::pair<torch::Tensor, torch::Tensor> kernel_tile(const SigLipState& state, const torch::Tensor& as,
                                                    const torch::Tensor& block, const c10::optional<torch::Tensor>& bias,
                                                    int64_t positive, const Tile& t, const torch::Tensor& h) {
  count_cuda_panel_call();
  // Entry (r, c) is a positive where t.c0 + c == positive + t.r0 + r.
  return panel_siglip(*state.kernels, raw_logits(as, block, t), bias.has_value() ? *bias : torch::Tensor(),
                              t.r0 + std::max<int64_t>(positive, 0), t.c0, positive >= 0, h);
}

class SigLip : public torch::autograd::Function<SigLip> {
 public:
  // L_r = weight sum_i f_i, f_i = sum_j softplus(y_ij) = -sum_j log sigmoid(z_ij x_ij).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& a /* [b, d] */,
                               const torch::Tensor& b /* [n_r, d] */, const torch::Tensor& scale /* [] */,
                               const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<SigLipState>& state) {
    auto as = a * scale;                                             // [b, d]
    auto f = torch::zeros({a.size(0)}, compute_options(a));  // [b]
    // With the gradient's GEMMs in the forward (see backward): H = h B, DB =
    // h^T as and the bias's sum_ij h_ij, each accumulator written by its
    // first product (no zero fill).
    // (A rank without rows has no tile: its keys' gradient is zeros.)
    torch::Tensor H, DB, h_rows;
    if (state->forward_grads) {
      H = torch::empty(a.sizes(), compute_options(a));  // [b, d]
      if (state->want_db) {
        DB = a.size(0) > 0 ? torch::empty(b.sizes(), compute_options(b))
                           : torch::zeros(b.sizes(), compute_options(b));  // [n, d]
      }
      if (bias.has_value()) h_rows = torch::zeros({a.size(0)}, compute_options(a));  // [b]
    }
    const auto blocks = state->key_blocks();
    blocks.for_each(b, [&](int64_t owner, int64_t, const torch::Tensor& block) {
      const int64_t positive = state->positives(owner);
      for_each_tile(a.size(0), block.size(0), state->walk, [&](const Tile& t) {
        auto fr = f.narrow(0, t.r0, t.rows);
        if (!state->kernels) {
          // softplus(y) = -log sigmoid(-y), exact for every y (torch's
          // softplus switches to the identity above a threshold).
          fr.sub_(torch::log_sigmoid(signed_logits(as, block, bias, positive, t).neg_()).sum(1));
          return;
        }
        auto bt = block.narrow(0, t.c0, t.cols);  // [C, d]
        torch::Tensor h = state->forward_grads ? torch::empty({t.rows, t.cols}, bt.options()) : torch::Tensor();
        auto [loss, h_sum] = kernel_tile(*state, as, block, bias, positive, t, h);
        fr.add_(loss);
        if (!h.defined()) return;
        gemm_into_(H.narrow(0, t.r0, t.rows), h, bt, /*first=*/t.c0 == 0);
        if (DB.defined()) gemm_into_(DB.narrow(0, t.c0, t.cols), h.t(), as.narrow(0, t.r0, t.rows), t.r0 == 0);
        if (h_rows.defined()) h_rows.narrow(0, t.r0, t.rows).add_(h_sum);
      });
    });
    ctx->save_for_backward({a, b, scale});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    if (bias.has_value()) ctx->saved_data["bias"] = bias->detach();
    if (H.defined()) ctx->saved_data["H"] = H;
    if (DB.defined()) ctx->saved_data["DB"] = DB;
    if (h_rows.defined()) ctx->saved_data["h_rows"] = h_rows;
    return f.sum() * state->weight;
  }

  // Gradient. With x_ij = s a_i.b_j + bias and y_ij = -z_ij x_ij,
  // f_i = sum_j softplus(y_ij), so h_ij := df_i/dx_ij = -z_ij sigmoid(y_ij).
  // With the upstream gradient G of L_r, every row's is g = G weight, and
  //   da_i = g s sum_j h_ij b_j = g s H_i,   db_j = g sum_i h_ij (s a_i) = g DB_j,
  //   ds = g sum_ij h_ij a_i.b_j = g sum_i H_i.a_i,   dbias = g sum_ij h_ij.
  // H, DB and sum h are what the forward summed (forward_grads), or are
  // recomputed here per tile (g folded into the [b, d] operand as g s a rather
  // than into every entry). The b-gradient of each block is summed around the
  // ring back to its owner.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    NoAutocast no_autocast;
    auto state = backward_state<SigLipState>(ctx);
    auto saved = ctx->get_saved_variables();
    const auto& a = saved[0];
    const auto& b = saved[1];
    const auto& scale = saved[2];
    c10::optional<torch::Tensor> bias;
    if (ctx->saved_data.count("bias")) bias = ctx->saved_data["bias"].toTensor();
    auto g = grads[0] * state->weight;  // [], every row's upstream
    const bool want_db = ctx->needs_input_grad(1);
    auto get = [&](const char* key) {
      return ctx->saved_data.count(key) ? ctx->saved_data[key].toTensor() : torch::Tensor();
    };
    torch::Tensor H = get("H"), db = get("DB"), h_rows = get("h_rows");
    auto as = a * scale;  // [b, d]
    if (!state->forward_grads) {
      auto asg = (as * g).to(a.scalar_type());                 // [b, d], an operand
      H = torch::empty(a.sizes(), compute_options(a));  // [b, d]: sum_j h_ij b_j
      if (bias.has_value()) h_rows = torch::zeros({a.size(0)}, g.options());  // [b]: sum_j h_ij
      const auto blocks = state->key_blocks();
      db = blocks.for_each_grad(b, want_db, [&](int64_t owner, int64_t, const torch::Tensor& block) {
        const int64_t positive = state->positives(owner);
        torch::Tensor db_block;  // [n, d], written by its first product (zeros without rows)
        if (want_db) {
          db_block = a.size(0) > 0 ? torch::empty(block.sizes(), compute_options(block))
                                   : torch::zeros(block.sizes(), compute_options(block));
        }
        for_each_tile(
            a.size(0), block.size(0), state->walk,
            [&](const Tile& t) {
              auto bt = block.narrow(0, t.c0, t.cols);  // [C, d]
              torch::Tensor hb;                         // h in the operand dtype, cast once for both GEMMs
              if (state->kernels) {
                hb = torch::empty({t.rows, t.cols}, bt.options());
                auto sums = kernel_tile(*state, as, block, bias, positive, t, hb).second;
                if (h_rows.defined()) h_rows.narrow(0, t.r0, t.rows).add_(sums);
              } else {
                auto h = signed_logits(as, block, bias, positive, t).sigmoid_();  // [R, C]
                if (positive >= 0) tile_diagonal(h, t.r0, t.c0, positive).neg_();  // times -z
                if (h_rows.defined()) h_rows.narrow(0, t.r0, t.rows).add_(h.sum(1));
                hb = scaled_operand(h, {}, bt.scalar_type());
              }
              // The first block's first column step writes H's rows; the
              // first row step writes the block's gradient.
              gemm_into_(H.narrow(0, t.r0, t.rows), hb, bt, owner == blocks.rank() && t.c0 == 0);
              if (want_db) {
                gemm_into_(db_block.narrow(0, t.c0, t.cols), hb.t(), asg.narrow(0, t.r0, t.rows), t.r0 == 0);
              }
            },
            /*columns_outer=*/true);
        return db_block;
      });
    } else if (db.defined()) {
      db = db * g;
    }
    auto A = H * g;  // [b, d]: g sum_j h_ij b_j
    auto da = (A * scale).to(a.scalar_type());
    if (db.defined()) db = db.to(b.scalar_type());
    auto ds = (A * a).sum().reshape(scale.sizes());
    torch::Tensor dbias;
    if (bias.has_value()) dbias = (g * h_rows.sum()).reshape(bias->sizes());
    return {da, want_db ? db : torch::Tensor(), ds, dbias, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor siglip_block_loss(const torch::Tensor& a, const torch::Tensor& keys, const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& bias, const Prologue& p) {
  auto state = c10::make_intrusive<SigLipState>();
  state->layout = p.layout;
  state->ring = p.ring;
  state->walk = p.walk;
  if (!p.tiled) {  // materialised: the whole block is one tile
    state->walk.panels = false;
    state->walk.tile = std::max<int64_t>({1, a.size(0), p.layout.total});
  }
  state->weight = static_cast<double>(p.layout.world) / static_cast<double>(p.layout.total);
  state->kernels = cuda_fused_device(compute_options(a));
  const bool grads = torch::GradMode::is_enabled() &&
                     (a.requires_grad() || keys.requires_grad() || scale.requires_grad() ||
                      (bias.has_value() && bias->requires_grad()));
  state->forward_grads = state->kernels.has_value() && !p.ring && grads;
  state->want_db = keys.requires_grad();
  return SigLip::apply(a, keys, scale, bias, state);
}

}  // namespace contrax::detail
