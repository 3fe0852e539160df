// Tiled InfoNCE (`tiled_info_nce`, the public core with arbitrary positive and
// masked offsets): online log-sum-exp over logits tiles with recomputation in
// the backward (see contrax/tiled.h). The tiled and ring CLIP, MoCo v3 and
// NT-Xent losses run on the engine (src/engine.cpp); the ring driver lives
// with the collectives.
//
// One autograd function, InfoNce, serves both the gathered and the ring path:
// with gathered keys the "ring" has a single block. The only state it saves is
// q, this rank's keys, the scale and one LSE per row.
#include "contrax/tiled.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "contrax/collectives.h"
#include "contrax/detail/check.h"
#include "contrax/detail/engine.h"

namespace contrax {

namespace detail {

int64_t tile_side(int64_t tile_size, int64_t tile_bytes, int64_t element_size) {
  if (tile_size > 0) return tile_size;
  const double side = std::sqrt(static_cast<double>(tile_bytes) / static_cast<double>(element_size));
  return std::max<int64_t>(64, static_cast<int64_t>(side));
}

torch::Tensor tile_diagonal(const torch::Tensor& tile, int64_t row0, int64_t col0, int64_t offset) {
  // Entry (i, offset + i) in global coordinates sits at tile (i - row0, offset + i - col0):
  // the tile diagonal with column shift offset + row0 - col0.
  const int64_t shift = offset + row0 - col0;
  if (shift >= tile.size(1) || -shift >= tile.size(0)) return tile.narrow(0, 0, 0).select(1, 0);
  return tile.diagonal(shift);
}

}  // namespace detail

namespace {

// Everything about the key layout the autograd function needs besides tensors.
struct NcePlan : torch::CustomClassHolder {
  CommunicatorPtr comm;          // null or world 1: `k` holds every key
  std::vector<int64_t> counts;   // key rows per rank (ring)
  int64_t positive_offset = 0;   // inside the own block
  int64_t masked_offset = -1;    // inside the own block; -1: none
  int64_t tile = 64;
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// Accumulates into `lse` ([b]) the log-sum-exp over the columns of `block` of
// the logits qs @ block^T, tile by tile; `masked` < 0 or the offset of the
// masked column of row i inside this block.
void block_lse(const torch::Tensor& qs /* [b, d] */, const torch::Tensor& block /* [n, d] */, int64_t masked,
               int64_t tile, torch::Tensor& lse /* [b] */) {
  const int64_t b = qs.size(0), n = block.size(0);
  for (int64_t r0 = 0; r0 < b; r0 += tile) {
    const int64_t R = std::min(tile, b - r0);
    auto qc = qs.narrow(0, r0, R);      // [R, d]
    auto lse_c = lse.narrow(0, r0, R);  // [R]
    for (int64_t c0 = 0; c0 < n; c0 += tile) {
      const int64_t T = std::min(tile, n - c0);
      auto logits = torch::mm(qc, block.narrow(0, c0, T).t());  // [R, T]
      if (masked >= 0) detail::tile_diagonal(logits, r0, c0, masked).fill_(-kInf);
      lse_c.copy_(torch::logaddexp(lse_c, logits.logsumexp(1)));
    }
  }
}

// Backward of one key block. With p recomputed tile by tile as
// exp(logits - lse), accumulates P_sum += p @ block ([b, d]) and, when `p_rows`
// is given, the row sums of p; returns p^T @ qsg ([n, d], qsg = g * qs) when
// `want_dk`. The upstream g is folded into [b, d] operands rather than into
// every [tile x tile] entry: one elementwise pass less per tile.
torch::Tensor block_grad(const torch::Tensor& qs /* [b, d] */, const torch::Tensor& qsg /* [b, d] */,
                         const torch::Tensor& block /* [n, d] */, int64_t masked, int64_t tile,
                         const torch::Tensor& lse /* [b] */, torch::Tensor& P_sum /* [b, d] */, bool want_dk,
                         torch::Tensor* p_rows /* [b] or null */) {
  const int64_t b = qs.size(0), n = block.size(0);
  torch::Tensor dk = want_dk ? torch::zeros_like(block) : torch::Tensor();  // [n, d]
  for (int64_t c0 = 0; c0 < n; c0 += tile) {
    const int64_t T = std::min(tile, n - c0);
    auto kt = block.narrow(0, c0, T);  // [T, d]
    for (int64_t r0 = 0; r0 < b; r0 += tile) {
      const int64_t R = std::min(tile, b - r0);
      auto p = torch::mm(qs.narrow(0, r0, R), kt.t());  // [R, T] logits, then in place p
      if (masked >= 0) detail::tile_diagonal(p, r0, c0, masked).fill_(-kInf);
      p.sub_(lse.narrow(0, r0, R).unsqueeze(1)).exp_();
      P_sum.narrow(0, r0, R).addmm_(p, kt);
      if (want_dk) dk.narrow(0, c0, T).addmm_(p.t(), qsg.narrow(0, r0, R));
      if (p_rows) p_rows->narrow(0, r0, R).add_(p.sum(1));
    }
  }
  return dk;
}

// l_i = lse_i - s q_i.k_{p+i} over all key blocks (see tiled_info_nce).
class InfoNce : public torch::autograd::Function<InfoNce> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q /* [b, d] */,
                               const torch::Tensor& k /* [n_r, d] */, const torch::Tensor& scale /* [] */,
                               const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<NcePlan>& plan) {
    auto qs = q * scale;  // [b, d]; scaling the narrow operand, as the materialised loss does
    auto lse = torch::full({q.size(0)}, -kInf, q.options());  // [b], without the bias
    detail::ring_for_each_block(plan->comm, plan->counts, k, [&](int64_t owner, const torch::Tensor& block) {
      const bool own = !plan->comm || owner == plan->comm->rank();
      block_lse(qs, block, own ? plan->masked_offset : -1, plan->tile, lse);
    });
    auto positive = (qs * k.narrow(0, plan->positive_offset, q.size(0))).sum(1);  // [b]
    ctx->save_for_backward({q, k, scale, lse});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    // The bias shifts every logit of a row, the positive included: it cancels.
    return lse - positive;
  }

  // Gradient. With z_ij = s q_i.k_j (+ bias), p_ij = exp(z_ij - lse_i) (0 on a
  // masked column) and upstream g_i, l_i = lse_i - z_{i,p(i)} gives
  //   dl_i/dz_ij = p_ij - [j = p(i)],  G_ij := g_i (p_ij - [j = p(i)]).
  // Then dq_i = s sum_j G_ij k_j = s A_i, dk_j = s sum_i G_ij q_i,
  // ds = sum_ij G_ij q_i.k_j = sum_i A_i.q_i and dbias = sum_ij G_ij. The
  // softmax part of G is recomputed tile by tile from the saved LSE; the
  // one-hot part touches only the positive pairs and is applied once per
  // backward. g_i multiplies whole rows, so it is applied to [b, d] operands:
  // A = g * (sum_j p_ij k_j - k_{p(i)}) and dk = p^T (g * s q) - (g * s q) at p(i).
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(),
                "tiled_info_nce(): double backward (create_graph=true) is not supported");
    auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& k = saved[1];
    const auto& scale = saved[2];
    const auto& lse = saved[3];
    auto plan = c10::static_intrusive_pointer_cast<NcePlan>(ctx->saved_data["plan"].toCapsule());
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto g = grads[0].contiguous();  // [b]
    const int64_t b = q.size(0);
    const bool want_dk = ctx->needs_input_grad(1);
    const bool want_bias = has_bias && ctx->needs_input_grad(3);

    auto qs = q * scale;                   // [b, d]
    auto qsg = qs * g.unsqueeze(1);        // [b, d]
    auto P_sum = torch::zeros_like(q);     // [b, d]: sum_j p_ij k_j
    auto p_rows = torch::zeros_like(g);    // [b]: sum_j p_ij (bias only)
    auto visit = [&](int64_t owner, const torch::Tensor& block) {
      const bool own = !plan->comm || owner == plan->comm->rank();
      auto dk = block_grad(qs, qsg, block, own ? plan->masked_offset : -1, plan->tile, lse, P_sum, want_dk,
                           want_bias ? &p_rows : nullptr);
      if (own) {
        // The one-hot part of G: -g_i at (i, p(i)).
        P_sum.sub_(block.narrow(0, plan->positive_offset, b));
        if (want_dk) dk.narrow(0, plan->positive_offset, b).sub_(qsg);
      }
      return dk;
    };
    torch::Tensor dk;
    if (want_dk) {
      dk = detail::ring_for_each_block_grad(plan->comm, plan->counts, k, visit);
    } else {
      detail::ring_for_each_block(plan->comm, plan->counts, k,
                                  [&](int64_t owner, const torch::Tensor& block) { visit(owner, block); });
    }
    auto A = P_sum.mul_(g.unsqueeze(1));  // [b, d]: sum_j G_ij k_j
    auto dq = A * scale;
    auto ds = (A * q).sum().reshape(scale.sizes());
    torch::Tensor dbias;
    if (want_bias) dbias = (g * p_rows).sum() - g.sum();
    return {dq, dk, ds, dbias, torch::Tensor()};
  }
};

int64_t world_of(const CommunicatorPtr& comm) { return comm ? comm->world_size() : 1; }

torch::Tensor apply_nce(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                        const torch::Tensor& bias, const CommunicatorPtr& comm, std::vector<int64_t> counts,
                        int64_t positive_offset, int64_t masked_offset, int64_t tile) {
  auto plan = c10::make_intrusive<NcePlan>();
  plan->comm = world_of(comm) > 1 ? comm : nullptr;
  plan->counts = std::move(counts);
  plan->positive_offset = positive_offset;
  plan->masked_offset = masked_offset;
  plan->tile = tile;
  c10::optional<torch::Tensor> opt_bias;
  if (bias.defined()) opt_bias = bias;
  return InfoNce::apply(q, k, scale, opt_bias, plan);
}

}  // namespace

// ---------------------------------------------------------------------------

torch::Tensor tiled_info_nce(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                             const c10::optional<torch::Tensor>& bias, const InfoNceOptions& options) {
  const char* caller = "tiled_info_nce";
  detail::ArgChecker check(caller);
  check.features(q, "q").features(k, "k");
  if (check.error().empty()) {
    check.require(q.size(1) == k.size(1), "arguments 'q' and 'k' must have the same width, but got ", q.size(1),
                  " and ", k.size(1));
    check.require(q.scalar_type() == k.scalar_type(), "arguments 'q' and 'k' must have the same dtype, but got ",
                  q.scalar_type(), " and ", k.scalar_type());
    check.require(options.positive_offset() >= 0 && options.positive_offset() + q.size(0) <= k.size(0),
                  "argument 'positive_offset' must leave room for every row's positive: need 0 <= ",
                  options.positive_offset(), " and ", options.positive_offset(), " + ", q.size(0),
                  " <= k.size(0) = ", k.size(0));
    check.require(options.masked_offset() < 0 || options.masked_offset() + q.size(0) <= k.size(0),
                  "argument 'masked_offset' must leave room for every row's masked column: ",
                  options.masked_offset(), " + ", q.size(0), " > k.size(0) = ", k.size(0));
    check.require(options.masked_offset() < 0 || options.masked_offset() != options.positive_offset(),
                  "argument 'masked_offset' must differ from 'positive_offset' (a row's positive cannot be masked)");
  }
  check.scalar(scale, "scale");
  if (bias.has_value()) check.scalar(*bias, "bias");
  check.require(options.tile_size() >= 0, "argument 'tile_size' must be >= 0 (0 = automatic), but got ",
                options.tile_size());
  check.require(options.tile_bytes() > 0, "argument 'tile_bytes' must be positive, but got ",
                options.tile_bytes());
  const auto& comm = options.comm();
  std::vector<int64_t> counts;
  if (world_of(comm) > 1) {
    counts = detail::exchange_row_counts(check.error().empty() ? k : torch::Tensor(), comm, caller, "k",
                                         check.error());
  } else {
    check.throw_if_failed();
    counts = {k.size(0)};
  }
  const int64_t tile = detail::tile_side(options.tile_size(), options.tile_bytes(), q.element_size());
  return apply_nce(q, k, scale.to(q.scalar_type()), bias.has_value() ? *bias : torch::Tensor(), comm, counts,
                   options.positive_offset(), options.masked_offset(), tile);
}


}  // namespace contrax
