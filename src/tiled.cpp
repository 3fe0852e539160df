// Tiled InfoNCE: online log-sum-exp over logits tiles with recomputation in the
// backward, the ring driver that moves key blocks between neighbours, and the
// tiled CLIP / NT-Xent / MoCo v3 losses built on them (see contrax/tiled.h).
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

void ring_for_each_block(const CommunicatorPtr& comm, const std::vector<int64_t>& counts,
                         const torch::Tensor& local,
                         const std::function<void(int64_t, const torch::Tensor&)>& visit,
                         const std::string& stat_name) {
  const int64_t W = comm ? comm->world_size() : 1;
  if (W == 1) {
    visit(comm ? comm->rank() : 0, local);
    return;
  }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W);
  const int64_t r = comm->rank();
  torch::Tensor cur = local;
  for (int64_t t = 0; t < W; ++t) {
    const int64_t owner = (r - t + W) % W;
    Communicator::Pending pending;
    if (t < W - 1) {
      auto shape = cur.sizes().vec();
      shape[0] = counts[(r - t - 1 + W) % W];
      pending = comm->ring_exchange_async(cur, shape, 1, stat_name);
    }
    visit(owner, cur);
    if (pending.valid()) cur = pending.wait();
  }
}

torch::Tensor ring_for_each_block_grad(const CommunicatorPtr& comm, const std::vector<int64_t>& counts,
                                       const torch::Tensor& local,
                                       const std::function<torch::Tensor(int64_t, const torch::Tensor&)>& visit,
                                       const std::string& stat_name) {
  const int64_t W = comm ? comm->world_size() : 1;
  if (W == 1) return visit(comm ? comm->rank() : 0, local);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W);
  const int64_t r = comm->rank();
  auto count = [&](int64_t s) { return counts[((s % W) + W) % W]; };
  // Schedule (identical on every rank, so the exchanges match): at step t rank r
  // holds the key block of owner r - t. The partial gradient of block o starts
  // at rank o + 1, picks up each holder's contribution and, after the visit at
  // rank o - 1, makes one last hop home. Step t therefore sends the block in
  // hand (t <= W-2, needed by rank+1 at step t+1) and the finished partial of
  // the previous step's block (t >= 2); step W sends only that partial.
  torch::Tensor cur = local, own, partial;
  for (int64_t t = 0; t <= W; ++t) {
    const bool send_block = t <= W - 2;
    const bool send_partial = t >= 2;
    Communicator::Pending pending;
    int64_t recv_block_rows = 0, recv_partial_rows = 0;
    if (send_block || send_partial) {
      std::vector<torch::Tensor> parts;
      if (send_block) parts.push_back(cur);
      if (send_partial) parts.push_back(partial);
      auto message = parts.size() == 1 ? parts[0] : torch::cat(parts, 0);
      // What rank r-1 sends: its block in hand (owner r-1-t) and its partial
      // for owner r-1-(t-1) = r-t, which is the block this rank visits now.
      recv_block_rows = send_block ? count(r - t - 1) : 0;
      recv_partial_rows = send_partial ? count(r - t) : 0;
      auto shape = local.sizes().vec();
      shape[0] = recv_block_rows + recv_partial_rows;
      pending = comm->ring_exchange_async(message, shape, 1, stat_name);
    }
    torch::Tensor contribution;
    if (t < W) {
      contribution = visit((r - t + W) % W, cur);
      TORCH_INTERNAL_ASSERT(contribution.sizes() == cur.sizes(), "ring visit returned a gradient of the wrong shape");
    }
    torch::Tensor received, partial_in;
    if (pending.valid()) {
      received = pending.wait();
      partial_in = received.narrow(0, recv_block_rows, recv_partial_rows);
    }
    if (t == 0) {
      own = contribution;
    } else if (t == 1) {
      partial = contribution;
    } else if (t < W) {
      partial = contribution + partial_in;
    } else {
      own = own + partial_in;
    }
    if (send_block) cur = received.narrow(0, 0, recv_block_rows);
  }
  return own;
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

bool ring_active(const CommunicatorPtr& comm, const TiledOptions& tiled) { return tiled.ring() && world_of(comm) > 1; }

torch::Tensor maybe_normalize(const torch::Tensor& x, bool normalize) {
  namespace F = torch::nn::functional;
  return normalize ? F::normalize(x, F::NormalizeFuncOptions().dim(1)) : x;
}

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

// Counts exchanged (with every rank told about any local argument error) and
// the offset of this rank's rows.
struct Layout {
  std::vector<int64_t> counts;
  int64_t offset = 0;
  int64_t total = 0;
};

Layout exchange_layout(const torch::Tensor& local, const CommunicatorPtr& comm, const char* caller, const char* arg,
                       const std::string& local_error) {
  Layout l;
  l.counts = detail::exchange_row_counts(local, comm, caller, arg, local_error);
  const int64_t r = comm ? comm->rank() : 0;
  for (size_t s = 0; s < l.counts.size(); ++s) {
    if (static_cast<int64_t>(s) < r) l.offset += l.counts[s];
    l.total += l.counts[s];
  }
  TORCH_CHECK(l.total > 0, caller, "(): the global batch is empty (every rank passed 0 rows)");
  return l;
}

torch::Tensor gather_all(const torch::Tensor& local, const CommunicatorPtr& comm, const Layout& layout,
                         bool with_grad) {
  if (world_of(comm) == 1) return with_grad ? local : local.detach();
  if (with_grad) return detail::gather_rows_with_grad(local, comm, layout.counts);
  torch::NoGradGuard no_grad;
  return comm->all_gather_rows(local.detach(), layout.counts, "all_gather_no_grad");
}

void check_tiled(detail::ArgChecker& check, const TiledOptions& tiled) {
  check.require(tiled.tile_size() >= 0, "argument 'tile_size' must be >= 0 (0 = automatic), but got ",
                tiled.tile_size());
  check.require(tiled.tile_bytes() > 0, "argument 'tile_bytes' must be positive, but got ", tiled.tile_bytes());
}

std::vector<int64_t> scaled_counts(std::vector<int64_t> counts, int64_t factor) {
  for (auto& c : counts) c *= factor;
  return counts;
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

torch::Tensor tiled_clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                              const c10::optional<torch::Tensor>& logit_bias, const ClipLossOptions& options,
                              const TiledOptions& tiled) {
  const char* caller = "tiled_clip_loss";
  detail::ArgChecker check(caller);
  check.paired_features(a, "a", b, "b");
  check.scalar(logit_scale, "logit_scale");
  if (logit_bias.has_value()) check.scalar(*logit_bias, "logit_bias");
  check.positive(options.max_logit_scale(), "max_logit_scale");
  check_tiled(check, tiled);
  const bool ok = check.error().empty();
  const auto& comm = options.comm();
  auto a_n = ok ? maybe_normalize(a, options.normalize()) : a;
  auto b_n = ok ? maybe_normalize(b, options.normalize()) : b;
  const int64_t d = ok ? a.size(1) : 0;
  auto both = ok ? torch::cat({a_n, b_n}, 1) : torch::Tensor();  // [b, 2d]
  auto layout = exchange_layout(both, comm, caller, "a", check.error());
  const int64_t W = world_of(comm);
  const int64_t tile = detail::tile_side(tiled.tile_size(), tiled.tile_bytes(), a.element_size());
  auto scale = logit_scale.exp().clamp_max(options.max_logit_scale()).to(a.scalar_type());
  auto bias = logit_bias.has_value() ? *logit_bias : torch::Tensor();

  torch::Tensor total;
  if (ring_active(comm, tiled)) {
    total = apply_nce(a_n, b_n, scale, bias, comm, layout.counts, 0, -1, tile).sum();
    if (options.symmetric()) {
      total = (total + apply_nce(b_n, a_n, scale, bias, comm, layout.counts, 0, -1, tile).sum()) * 0.5;
    }
  } else {
    auto all = gather_all(options.symmetric() ? both : b_n, comm, layout, true);
    auto b_all = options.symmetric() ? all.narrow(1, d, d) : all;  // [B, d]
    total = apply_nce(a_n, b_all, scale, bias, nullptr, {layout.total}, layout.offset, -1, tile).sum();
    if (options.symmetric()) {
      auto a_all = all.narrow(1, 0, d);  // [B, d]
      total = (total + apply_nce(b_n, a_all, scale, bias, nullptr, {layout.total}, layout.offset, -1, tile).sum()) *
              0.5;
    }
  }
  return total * (static_cast<double>(W) / static_cast<double>(layout.total));
}

torch::Tensor tiled_nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, const NTXentLossOptions& options,
                                 const TiledOptions& tiled) {
  const char* caller = "tiled_nt_xent_loss";
  detail::ArgChecker check(caller);
  check.features(z1, "z1").features(z2, "z2");
  if (check.error().empty()) check.same_as(z2, "z2", z1, "z1");
  check.positive(options.temperature(), "temperature");
  check_tiled(check, tiled);
  const bool ok = check.error().empty();
  const auto& comm = options.comm();
  auto z1n = ok ? maybe_normalize(z1, options.normalize()) : z1;
  auto z2n = ok ? maybe_normalize(z2, options.normalize()) : z2;
  auto layout = exchange_layout(ok ? z1n : torch::Tensor(), comm, caller, "z1", check.error());
  const int64_t W = world_of(comm);
  const int64_t b = z1.size(0), d = z1.size(1), B = layout.total;
  const int64_t tile = detail::tile_side(tiled.tile_size(), tiled.tile_bytes(), z1.element_size());
  auto scale = torch::scalar_tensor(1.0 / options.temperature(), z1.options().requires_grad(false));

  torch::Tensor total;
  if (ring_active(comm, tiled)) {
    // Own key block [other view | same view] ([2 b_r, d]): positive at column i,
    // self at column b_r + i; other ranks' blocks have neither.
    auto counts2 = scaled_counts(layout.counts, 2);
    total = apply_nce(z1n, torch::cat({z2n, z1n}, 0), scale, {}, comm, counts2, 0, b, tile).sum() +
            apply_nce(z2n, torch::cat({z1n, z2n}, 0), scale, {}, comm, counts2, 0, b, tile).sum();
  } else {
    auto all = gather_all(torch::cat({z1n, z2n}, 1), comm, layout, true);
    auto z1_all = all.narrow(1, 0, d);  // [B, d]
    auto z2_all = all.narrow(1, d, d);  // [B, d]
    // Keys [other view (B) | same view (B)]: positive at off + i, self at B + off + i.
    total = apply_nce(z1n, torch::cat({z2_all, z1_all}, 0), scale, {}, nullptr, {2 * B}, layout.offset,
                      B + layout.offset, tile).sum() +
            apply_nce(z2n, torch::cat({z1_all, z2_all}, 0), scale, {}, nullptr, {2 * B}, layout.offset,
                      B + layout.offset, tile).sum();
  }
  return total * (static_cast<double>(W) / (2.0 * static_cast<double>(B)));
}

torch::Tensor tiled_moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                                 const torch::Tensor& k2, const MocoV3LossOptions& options,
                                 const TiledOptions& tiled) {
  const char* caller = "tiled_moco_v3_loss";
  detail::ArgChecker check(caller);
  check.features(q1, "q1").features(q2, "q2").features(k1, "k1").features(k2, "k2");
  if (check.error().empty()) {
    check.same_as(q2, "q2", q1, "q1").same_as(k1, "k1", q1, "q1").same_as(k2, "k2", q1, "q1");
  }
  check.positive(options.temperature(), "temperature");
  check_tiled(check, tiled);
  const bool ok = check.error().empty();
  const auto& comm = options.comm();
  const double T = options.temperature();
  // Keys come from the momentum encoder: constants of this loss.
  torch::Tensor k1n, k2n;
  if (ok) {
    torch::NoGradGuard no_grad;
    k1n = maybe_normalize(k1.detach(), options.normalize());
    k2n = maybe_normalize(k2.detach(), options.normalize());
  }
  auto layout = exchange_layout(ok ? k1n : torch::Tensor(), comm, caller, "k1", check.error());
  const int64_t W = world_of(comm);
  const int64_t d = q1.size(1);
  const int64_t tile = detail::tile_side(tiled.tile_size(), tiled.tile_bytes(), q1.element_size());
  auto scale = torch::scalar_tensor(1.0 / T, q1.options().requires_grad(false));
  auto q1n = maybe_normalize(q1, options.normalize());
  auto q2n = maybe_normalize(q2, options.normalize());

  torch::Tensor total;
  if (ring_active(comm, tiled)) {
    total = apply_nce(q1n, k2n, scale, {}, comm, layout.counts, 0, -1, tile).sum() +
            apply_nce(q2n, k1n, scale, {}, comm, layout.counts, 0, -1, tile).sum();
  } else {
    auto all = gather_all(torch::cat({k1n, k2n}, 1), comm, layout, false);
    auto k1_all = all.narrow(1, 0, d);  // [B, d]
    auto k2_all = all.narrow(1, d, d);  // [B, d]
    total = apply_nce(q1n, k2_all, scale, {}, nullptr, {layout.total}, layout.offset, -1, tile).sum() +
            apply_nce(q2n, k1_all, scale, {}, nullptr, {layout.total}, layout.offset, -1, tile).sum();
  }
  return total * (2.0 * T * static_cast<double>(W) / static_cast<double>(layout.total));
}

}  // namespace contrax
