// The contrastive-loss engine's materialised path: one logits buffer per rank,
// turned in place into the gradient G in backward (see contrax/detail/engine.h
// for the two ideas and the gradient convention).
#include "contrax/detail/engine.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <optional>

#include "contrax/collectives.h"
#include "contrax/detail/lse_kernels.h"
#include "contrax/memory.h"

namespace contrax::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kInf = std::numeric_limits<double>::infinity();

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

// ---------------------------------------------------------------------------
// CLIP / InfoNCE / grouped on one row block: the shared structure.
//
// Notation (BlockSpec): S = s Q K^T + bias over this rank's b rows and all N
// columns; pos(i) = (off + i) g the designated positive; P_ij the positive set
// (designated, or equal labels in kMultiPositive, where n_i = sum_j P_ij and,
// for columns, m_j = sum_{all rows i} P_ij); duplicates masked to -inf in
// kMaskDuplicates. Per-row losses
//   l^row_i = lse_row_i - sum_j Y_ij S_ij,        Y_ij = P_ij / n_i
//   l^col_j = lse_col_j - sum_i Yc_ij S_ij,       Yc_ij = P_ij / m_j   (symmetric)
// (without labels or with kMaskDuplicates P is the designated entry alone and
// n = m = 1), l_i = l^row_i, or (l^row_i + l^col_{off+i}) / 2 when symmetric.
//
// Backward. The effective objective of rank r's backward is sum_i w_i l_i with
// w_i = (upstream of L_r) dL_r/dl_i: c W/B (kMean), c W (kSum), g_i (kNone).
// Under the gradient convention (engine.h) the gradient held for rank r's rows
// must be W dL/dx_r with L = (1/W) sum_r <upstream_r, out_r>, i.e. the gradient
// of sum_{all rows u} w_u l_u. With a masked entry constant (-inf: P = 0 there)
// and Y constant (labels),
//   d/dS_ij sum_u w_u l_u = h [w_i (exp(S_ij - lse_row_i) - Y_ij)
//                              + w_j (exp(S_ij - lse_col_j) - Yc_ij)]   (second term if symmetric)
// with h = 1/2 when symmetric, else 1. The column term needs w_j of the column's
// owner: for kMean/kSum it is the same c on every rank (every rank
// backpropagates its L_r with the same factor, as data-parallel training does);
// for kNone the upstream g is all-gathered in backward (O(B)); the
// one-directional losses need nothing. Then, as before,
//   dq = s G k_all,  dk_all = s G^T q,  ds = sum(q * (G k_all)),  dbias = sum G.
// Summed over ranks these are W times the global gradients, as required.

// The designated positives inside a tile of local rows [r0, r0 + R) and global
// columns [c0, c0 + C): `n` entries starting at tile entry (row, col), one row
// down and g columns right each (pos(i) = (off + i) g).
struct PositiveRun {
  int64_t row = 0, col = 0, n = 0;
};

PositiveRun positives_in(int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t offset, int64_t g) {
  auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  const int64_t lo = std::max(r0, ceil_div(c0, g) - offset);
  const int64_t hi = std::min(r0 + R, ceil_div(c0 + C, g) - offset);
  if (hi <= lo) return {};
  return {lo - r0, (offset + lo) * g - c0, hi - lo};
}

// The run as a 1-D view of the 2-D tile `t` (any row stride, unit column stride
// or not): writable in place.
torch::Tensor run_view(const torch::Tensor& t, const PositiveRun& p, int64_t g) {
  if (p.n == 0) return torch::empty({0}, t.options());
  return t.as_strided({p.n}, {t.stride(0) + g * t.stride(1)},
                      t.storage_offset() + p.row * t.stride(0) + p.col * t.stride(1));
}

struct BlockPlan : torch::CustomClassHolder {
  EngineLayout layout;
  BlockSpec spec;
  double inv_temperature = 1.0;            // NT-Xent
  std::optional<double> shift;             // bound M of |S|, every softmax's shift: the buffer holds exp(S - M)
  Reduction reduction = Reduction::kMean;  // NT-Xent
  bool consumed = false;                   // the buffer has become G: a second backward would be wrong

  bool labeled() const { return spec.row_labels.defined(); }
  bool multi() const { return labeled() && spec.label_mode == LabelMode::kMultiPositive; }
  int64_t n_cols() const { return layout.total * spec.group; }
};

void check_single_backward(BlockPlan& plan, const char* caller) {
  TORCH_CHECK(!torch::GradMode::is_enabled(), caller, "(): double backward (create_graph=true) is not supported");
  TORCH_CHECK(!plan.consumed, caller,
              "(): backward ran twice through the same graph; the materialised loss turns its logits buffer into "
              "the gradient in place, so retain_graph=true cannot reuse it (compute the loss again instead)");
  plan.consumed = true;
}

// Whether a known bound M of the logits (|S| <= M) can be every softmax's
// exact shift in dtype `t`: then E = exp(S - M) >= e^(-2M) must stay a normal
// number (fp32: down to e^-87; fp64: e^-708), with a margin.
bool bound_fits(double M, c10::ScalarType t) {
  const double range = t == torch::kDouble ? 700.0 : 80.0;
  return bounded_shift_enabled() && M >= 0 && std::isfinite(M) && 2.0 * M <= range;
}

// exp(M - lse) (times w when defined): the factor that turns a buffer entry
// E = exp(S - M) into w exp(S - lse). At most e^(2M): every lse is >= -M.
torch::Tensor shift_factors(double M, const torch::Tensor& lse, const torch::Tensor& w) {
  auto f = (M - lse).exp_();
  return w.defined() ? f.mul_(w) : f;
}

// Label structure of a tile (local rows [r0, r0+R), global columns [c0, c0+C)):
// kMaskDuplicates masks the duplicates of `t` in place and returns undefined;
// kMultiPositive returns P as a [R, C] tensor of t's dtype; no labels: undefined.
torch::Tensor apply_labels(const BlockPlan& plan, torch::Tensor& t, int64_t r0, int64_t c0) {
  if (!plan.labeled()) return {};
  const int64_t R = t.size(0), C = t.size(1), g = plan.spec.group;
  auto eq = plan.spec.row_labels.narrow(0, r0, R).unsqueeze(1) ==
            plan.spec.col_labels.narrow(0, c0, C).unsqueeze(0);  // [R, C] bool, contiguous
  auto run = positives_in(r0, R, c0, C, plan.layout.offset, g);
  if (!plan.multi()) {
    run_view(eq, run, g).fill_(false);  // the designated positive is never masked
    t.masked_fill_(eq, -kInf);
    return {};
  }
  run_view(eq, run, g).fill_(true);  // ... and always a positive
  return eq.to(t.scalar_type());
}

// Forward accumulators over tiles (materialised: one chunk of rows, all
// columns). The column log-sum-exps are running ones (ColumnLse): no [N]
// vector is rebuilt per tile.
struct ForwardStats {
  torch::Tensor lse_row, pos_row, n_row;  // [b]; pos/n only for multi-positive
  torch::Tensor lse_col, pos_col, n_col;  // [N] partials over this rank's rows (symmetric); lse_col set by finish()
  std::unique_ptr<ColumnLse> cols;        // symmetric only

  // `online_cols` false: the caller sets lse_col itself (the bounded shift).
  ForwardStats(const BlockPlan& plan, int64_t b, const torch::TensorOptions& opt, bool online_cols = true) {
    const bool sym = plan.spec.symmetric, multi = plan.multi();
    const int64_t N = plan.n_cols();
    lse_row = torch::full({b}, -kInf, opt);
    if (multi) pos_row = torch::zeros({b}, opt), n_row = torch::zeros({b}, opt);
    if (sym && online_cols) cols = std::make_unique<ColumnLse>(N, opt);
    if (sym && multi) pos_col = torch::zeros({N}, opt), n_col = torch::zeros({N}, opt);
  }

  // t: the (masked) tile at local rows [r0, ..), global columns [c0, ..); P as
  // apply_labels. `whole_rows`: t spans every column, so its row log-sum-exps
  // are final (copied, not merged).
  void add(const torch::Tensor& t, const torch::Tensor& P, int64_t r0, int64_t c0, bool whole_rows = false) {
    const int64_t R = t.size(0), C = t.size(1);
    auto row = cols ? cols->add(t, c0, /*rows=*/true) : tile_lse(t, /*rows=*/true, /*cols=*/false).row;
    auto lr = lse_row.narrow(0, r0, R);
    if (whole_rows) {
      lr.copy_(row);
    } else {
      lr.copy_(torch::logaddexp(lr, row));
    }
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

  void finish() {
    if (cols) lse_col = cols->lse();
  }
};

// Rows per chunk of a materialised [b x cols] logits buffer: its GEMM, its
// statistics and (in backward) its gradient and the GEMMs that consume it run
// chunk by chunk, so the element-wise passes read the chunk from cache instead
// of memory. About 8 MiB and at least 256 rows (fewer rows cost the GEMMs
// efficiency: measured 1.3x slower at 64 rows, equal from 256). Off the CPU:
// one chunk (the GPU wants the whole GEMM).
int64_t gemm_chunk_rows(int64_t b, int64_t cols, const torch::Tensor& like) {
  if (!like.device().is_cpu()) return std::max<int64_t>(b, 1);
  const int64_t rows = (int64_t{8} << 20) / std::max<int64_t>(1, cols * like.element_size());
  return std::max<int64_t>(rows, 256);
}

// The logits workspace (see contrax/memory.h). glibc serves a CPU buffer this
// large with a fresh mmap and unmaps it when it is freed, so each call paid the
// page faults of its whole buffer again: ~180 ms for NT-Xent's 512 MiB at 4096
// rows per rank (W = 2), a sixth of the call. Training calls the loss every
// step with the same shapes, so each thread keeps its largest buffer once the
// loss that used it is gone, and the next loss reuses it. A buffer still in use
// (two losses alive at once) is never handed out again: the second gets a
// fresh one, which is not kept.
constexpr int64_t kKeepBytes = int64_t{32} << 20;

struct Workspace {
  c10::Storage storage;
  c10::ScalarType dtype = c10::kFloat;
};

Workspace& thread_workspace() {
  thread_local Workspace ws;
  return ws;
}

std::atomic<bool>& keep_workspace_flag() {
  static std::atomic<bool> on{env_on("CONTRAX_KEEP_WORKSPACE")};
  return on;
}

// An uninitialised contiguous [rows, cols] buffer: the kept one when it fits.
torch::Tensor logits_buffer(int64_t rows, int64_t cols, const torch::TensorOptions& opt) {
  const auto dtype = c10::typeMetaToScalarType(opt.dtype());
  const int64_t bytes = rows * cols * static_cast<int64_t>(c10::elementSize(dtype));
  if (!opt.device().is_cpu() || bytes < kKeepBytes || !keep_workspace_flag().load(std::memory_order_relaxed)) {
    return torch::empty({rows, cols}, opt);
  }
  auto& ws = thread_workspace();
  if (ws.storage && ws.storage.use_count() > 1) return torch::empty({rows, cols}, opt);  // in use
  if (!ws.storage || ws.dtype != dtype || static_cast<int64_t>(ws.storage.nbytes()) < bytes) {
    ws.storage = c10::Storage();  // the old one goes first: never two kept buffers at once
    auto t = torch::empty({rows, cols}, opt);
    ws.storage = t.storage();
    ws.dtype = dtype;
    return t;
  }
  return torch::empty({0}, opt).set_(ws.storage, 0, {rows, cols}, {cols, 1});
}

// What the backward needs besides the inputs.
struct RowTerms {
  torch::Tensor lse_row, lse_col, inv_n_row, inv_n_col;  // inv_n: multi-positive only
};

// Finishes the forward: combines the column statistics across ranks, forms the
// per-row losses and reduces them. `designated`: [b] S_{i,pos(i)}.
torch::Tensor finish_forward(const BlockPlan& plan, ForwardStats& st, const torch::Tensor& designated, RowTerms& out) {
  const auto& L = plan.layout;
  const int64_t b = designated.size(0), N = plan.n_cols();
  st.finish();
  out.lse_row = st.lse_row;
  auto l = st.lse_row - (plan.multi() ? st.pos_row / st.n_row : designated);  // [b]
  if (plan.multi()) out.inv_n_row = st.n_row.reciprocal();
  if (plan.spec.symmetric) {
    torch::Tensor col_pos;  // [b]: the positive term of this rank's columns
    if (plan.multi()) {
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

torch::Tensor reduce_rows(const torch::Tensor& l /* [b] */, const EngineLayout& L, Reduction r) {
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

// Backward weights (see the derivation above): a 0-dim factor c applied to the
// products, and per-row / per-column weights for kNone (undefined otherwise:
// weight 1, the factor carrying c W/B or c W).
struct Weights {
  torch::Tensor c, row, col;
};

Weights backward_weights(const BlockPlan& plan, const torch::Tensor& grad, c10::ScalarType dt) {
  const auto& L = plan.layout;
  const double h = plan.spec.symmetric ? 0.5 : 1.0;
  Weights w;
  if (plan.spec.reduction == Reduction::kNone) {
    w.c = torch::scalar_tensor(h, grad.options().dtype(dt));
    w.row = grad.to(dt).contiguous();  // [b]
    if (plan.spec.symmetric) {
      // Every column's owner's upstream gradient: one O(B) gather, which is
      // why every rank must run backward with kNone.
      w.col = L.world == 1 ? w.row : L.comm->all_gather_rows(w.row, L.counts, "grad_all_gather");  // [B]
    }
    return w;
  }
  const double f = plan.spec.reduction == Reduction::kSum ? static_cast<double>(L.world)
                                                          : static_cast<double>(L.world) / static_cast<double>(L.total);
  w.c = grad.to(dt) * (f * h);
  return w;
}

// The -Y terms of G / c on the designated positives of a tile (no
// multi-positive labels): w_i, plus w_j when symmetric (1 each unweighted).
void subtract_positives(const BlockPlan& plan, const Weights& w, torch::Tensor& t, int64_t r0, int64_t c0) {
  const int64_t g = plan.spec.group;
  const bool sym = plan.spec.symmetric;
  const auto run = positives_in(r0, t.size(0), c0, t.size(1), plan.layout.offset, g);
  if (run.n == 0) return;
  auto diag = run_view(t, run, g);
  if (!w.row.defined()) {
    diag.sub_(sym ? 2.0 : 1.0);
    return;
  }
  diag.sub_(w.row.narrow(0, r0 + run.row, run.n));
  if (sym) diag.sub_(w.col.narrow(0, c0 + run.col, run.n));  // group 1: columns consecutive
}

// S tile -> G / c in place (see the derivation above). `P` as apply_labels.
void tile_gradient(const BlockPlan& plan, const RowTerms& rt, const Weights& w, torch::Tensor& t,
                   const torch::Tensor& P, int64_t r0, int64_t c0) {
  const int64_t R = t.size(0), C = t.size(1);
  const bool sym = plan.spec.symmetric;
  // w_i exp(S_ij - lse_row_i) [+ w_j exp(S_ij - lse_col_j)], fused, in place.
  softmax_grad_(t, rt.lse_row.narrow(0, r0, R), w.row.defined() ? w.row.narrow(0, r0, R) : torch::Tensor(),
                sym ? rt.lse_col.narrow(0, c0, C) : torch::Tensor(),
                sym && w.col.defined() ? w.col.narrow(0, c0, C) : torch::Tensor());
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
  subtract_positives(plan, w, t, r0, c0);
}

// ---------------------------------------------------------------------------
// The materialised form: S ([b x N]) is the only such buffer; it is masked in
// place, kept, and turned into G / c in place by the backward.
class ClipBlock : public torch::autograd::Function<ClipBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q /* [b, d] */,
                               const torch::Tensor& k_all /* [N, d] */, const torch::Tensor& scale /* [] */,
                               const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<BlockPlan>& plan) {
    const int64_t b = q.size(0), N = k_all.size(0), g = plan->spec.group;
    const bool has_bias = bias.has_value() && bias->defined();
    auto qs = q * scale;                          // [b, d]
    auto S = logits_buffer(b, N, qs.options());  // [b, N]
    // Bounded: every logit lies in [-M, M], M = s max|q_i| max|k_j| + |bias|
    // (Cauchy-Schwarz). Where 2M is within the dtype's exponent range, M is an
    // exact shift for every row and column: E = exp(S - M) >= e^(-2M) never
    // underflows, lse_row_i = M + log sum_j E_ij, and this rank's partial
    // lse_col_j = M + log sum_i E_ij (an empty sum: -inf). One exponential per
    // logit and no max pass; the buffer keeps E, and the backward needs no
    // exponential (see there). Normalised features at CLIP's initial scale
    // (1/0.07) give M = 14.3. Multi-positive labels need S itself: general path.
    if (!plan->multi() && b > 0 && N > 0) {
      double M = scale.item<double>() * q.norm(2, 1).max().item<double>() * k_all.norm(2, 1).max().item<double>();
      if (has_bias) M += std::abs(bias->item<double>());
      if (bound_fits(M, S.scalar_type())) plan->shift = M;
    }
    const bool bounded = plan->shift.has_value();
    const double M = plan->shift.value_or(0.0);
    ForwardStats st(*plan, b, S.options(), /*online_cols=*/!bounded);
    auto designated = torch::empty({b}, S.options());  // [b]: S_{i, pos(i)}
    auto col_sum = bounded && plan->spec.symmetric ? torch::zeros({N}, S.options()) : torch::Tensor();
    // GEMM chunk by chunk, each chunk's statistics while it is in cache;
    // labels work on smaller sub-chunks (their structure is a [R, N] temporary).
    const int64_t R = gemm_chunk_rows(b, N, S);
    const int64_t Rl = plan->labeled() ? chunk_rows(N, S.element_size()) : R;
    for (int64_t r0 = 0; r0 < b; r0 += R) {
      const int64_t n = std::min(R, b - r0);
      auto Sg = S.narrow(0, r0, n);
      torch::mm_out(Sg, qs.narrow(0, r0, n), k_all.t());
      if (has_bias) Sg.add_(*bias);
      designated.narrow(0, r0, n).copy_(run_view(Sg, positives_in(r0, n, 0, N, plan->layout.offset, g), g));
      for (int64_t l0 = 0; l0 < n; l0 += Rl) {
        auto Sc = Sg.narrow(0, l0, std::min(Rl, n - l0));  // [R, N]
        auto P = apply_labels(*plan, Sc, r0 + l0, 0);
        if (bounded) {
          st.lse_row.narrow(0, r0 + l0, Sc.size(0)).copy_(exp_rows_(Sc, M, col_sum).log_().add_(M));
        } else {
          st.add(Sc, P, r0 + l0, 0, /*whole_rows=*/true);
        }
      }
    }
    if (bounded && plan->spec.symmetric) st.lse_col = col_sum.log_().add_(M);  // this rank's column partials
    RowTerms rt;
    auto l = finish_forward(*plan, st, designated, rt);
    ctx->save_for_backward({q, k_all, scale});
    ctx->saved_data["S"] = S;
    ctx->saved_data["lse_row"] = rt.lse_row;
    if (rt.lse_col.defined()) ctx->saved_data["lse_col"] = rt.lse_col;
    if (rt.inv_n_row.defined()) ctx->saved_data["inv_n_row"] = rt.inv_n_row;
    if (rt.inv_n_col.defined()) ctx->saved_data["inv_n_col"] = rt.inv_n_col;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return reduce_rows(l, plan->layout, plan->spec.reduction);
  }

  static RowTerms saved_terms(AutogradContext* ctx) {
    RowTerms rt;
    auto get = [&](const char* key) {
      return ctx->saved_data.count(key) ? ctx->saved_data[key].toTensor() : torch::Tensor();
    };
    rt.lse_row = get("lse_row");
    rt.lse_col = get("lse_col");
    rt.inv_n_row = get("inv_n_row");
    rt.inv_n_col = get("inv_n_col");
    return rt;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto plan = c10::static_intrusive_pointer_cast<BlockPlan>(ctx->saved_data["plan"].toCapsule());
    check_single_backward(*plan, "clip_loss");
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
    const auto w = backward_weights(*plan, grads[0], S.scalar_type());
    const bool want_dk = ctx->needs_input_grad(1);
    const bool want_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(3);

    // Chunk by chunk, as the forward: S -> G / c in place (multi-positive
    // labels on sub-chunks, for their [R, N] structure), then the chunk's rows
    // of Gk = (G / c) k_all while it is in cache. dk = (G / c)^T q s c is one
    // GEMM afterwards: accumulated per chunk it would read and write the whole
    // [N, d] result once per chunk (512 MiB of traffic at W = 4, b = 4096),
    // while the one GEMM is compute-bound and streams G once. The scalar c goes
    // on the [b, d] and [N, d] products instead of on the [b, N] buffer.
    //
    // Bounded (the buffer holds E = exp(S - M)): exp(S_ij - lse_row_i) =
    // E_ij exp(M - lse_row_i) and exp(S_ij - lse_col_j) = E_ij exp(M - lse_col_j),
    // so G / c = E (a_i + b_j) - Y with a = w_row exp(M - lse_row) and
    // b = w_col exp(M - lse_col) (0 one-directional). Both factors are at most
    // e^(2M) (every lse is >= -M): finite.
    auto Gk = torch::empty({b, d}, S.options());  // [b, d]
    auto g_sum = want_bias ? torch::zeros({}, S.options()) : torch::Tensor();
    torch::Tensor fa, fb;  // bounded: [b], [N]
    if (plan->shift) {
      fa = shift_factors(*plan->shift, rt.lse_row, w.row);
      fb = plan->spec.symmetric ? shift_factors(*plan->shift, rt.lse_col, w.col) : torch::zeros({N}, S.options());
    }
    const int64_t R = gemm_chunk_rows(b, N, S);
    const int64_t Rl = plan->multi() ? chunk_rows(N, S.element_size()) : R;
    for (int64_t r0 = 0; r0 < b; r0 += R) {
      const int64_t n = std::min(R, b - r0);
      auto Sg = S.narrow(0, r0, n);
      if (plan->shift) {
        scale_rows_plus_cols_(Sg, fa.narrow(0, r0, n), fb);
        subtract_positives(*plan, w, Sg, r0, 0);
      } else {
        for (int64_t l0 = 0; l0 < n; l0 += Rl) {
          auto Sc = Sg.narrow(0, l0, std::min(Rl, n - l0));
          torch::Tensor P;
          if (plan->multi()) {
            auto scratch = Sc;  // multi-positive masks nothing: only P is wanted
            P = apply_labels(*plan, scratch, r0 + l0, 0);
          }
          tile_gradient(*plan, rt, w, Sc, P, r0 + l0, 0);
        }
      }
      auto gk = Gk.narrow(0, r0, n);
      torch::mm_out(gk, Sg, k_all);
      if (want_bias) g_sum.add_(Sg.sum());
    }
    torch::Tensor dk;
    if (want_dk) dk = torch::mm(S.t(), q * (scale * w.c));  // [N, d]
    Gk.mul_(w.c);                                           // G k_all
    auto dq = Gk * scale;
    torch::Tensor ds, dbias;
    if (ctx->needs_input_grad(2)) ds = (Gk * q).sum().reshape(scale.sizes());
    if (want_bias) dbias = g_sum * w.c;
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
// NT-Xent's backward weights. kMean/kSum: a 0-dim factor c (W/(2B) g / T, as
// before). kNone: the per-example upstream g_i weighs each of the example's two
// view rows by g_i / 2 (an example's loss is the mean of its views'); the
// transposed term of the gradient (P_vw, see below) needs the weight of every
// row v, so the upstream gradients are all-gathered (O(B)), and then
//   G~_wv = w_w (exp(S_wv - lse_w) - Y_wv) + w_v (exp(S_wv - lse_v) - Y_wv),
// with w_{pos(w)} = w_w: the positive entry loses 2 w_w. c = 1/T.
struct NtWeights {
  torch::Tensor c, row, all;  // row: [2b], all: [2B] (kNone only)
};

NtWeights nt_weights(const BlockPlan& plan, const torch::Tensor& grad, c10::ScalarType dt) {
  const auto& L = plan.layout;
  const double B = static_cast<double>(L.total);
  NtWeights w;
  if (plan.reduction != Reduction::kNone) {
    w.c = grad.to(dt) * (static_cast<double>(L.world) / (2.0 * B) * plan.inv_temperature);
    return w;
  }
  auto half = grad.to(dt).contiguous() * 0.5;                                                   // [b]
  auto all = L.world == 1 ? half : L.comm->all_gather_rows(half, L.counts, "grad_all_gather");  // [B]
  w.row = torch::cat({half, half});
  w.all = torch::cat({all, all});
  w.c = torch::scalar_tensor(plan.inv_temperature, grad.options().dtype(dt));
  return w;
}

// Per-row NT-Xent losses [2b] -> what the loss returns.
torch::Tensor nt_reduce(const torch::Tensor& l /* [2b] */, const BlockPlan& plan) {
  const auto& L = plan.layout;
  if (plan.reduction == Reduction::kNone) return l.view({2, -1}).mean(0);  // [b]
  return l.sum() * (static_cast<double>(L.world) / (2.0 * static_cast<double>(L.total)));
}

class NtXentBlock : public torch::autograd::Function<NtXentBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& z /* [2b, d] */,
                               const torch::Tensor& z_all /* [2B, d] */, const c10::intrusive_ptr<BlockPlan>& plan) {
    const auto& L = plan->layout;
    const int64_t b2 = z.size(0), b = b2 / 2, B = L.total;
    auto zs = z * plan->inv_temperature;               // [2b, d]
    auto S = logits_buffer(b2, 2 * B, zs.options());  // [2b, 2B]
    auto idx = self_and_positive(b, L, z.device());
    auto lse = torch::empty({b2}, S.options());       // [2b]
    auto positive = torch::empty({b2}, S.options());  // [2b]: S_{u, pos(u)}
    // GEMM chunk by chunk; each chunk's self columns masked, its positives
    // read and its rows' log-sum-exps taken while it is in cache. Bounded
    // (unit rows: every S_uv lies in [-1/T, 1/T]): 1/T is a safe shift for
    // every row, so one pass turns the chunk into E = exp(S - 1/T) (no
    // underflow: 2/T is within the dtype's exponent range) and sums it; the
    // backward then needs no exponential at all (see there).
    const int64_t R = gemm_chunk_rows(b2, 2 * B, S);
    for (int64_t r0 = 0; r0 < b2; r0 += R) {
      const int64_t n = std::min(R, b2 - r0);
      auto Sc = S.narrow(0, r0, n);
      torch::mm_out(Sc, zs.narrow(0, r0, n), z_all.t());
      const auto rows = idx[0].narrow(0, 0, n);
      Sc.index_put_({rows, idx[1].narrow(0, r0, n)}, -kInf);
      positive.narrow(0, r0, n).copy_(Sc.index({rows, idx[2].narrow(0, r0, n)}));
      if (plan->shift) {
        lse.narrow(0, r0, n).copy_(exp_rows_(Sc, *plan->shift).log_().add_(*plan->shift));
      } else {
        lse.narrow(0, r0, n).copy_(tile_lse(Sc, /*rows=*/true, /*cols=*/false).row);
      }
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
    return nt_reduce(lse - positive, *plan);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto plan = c10::static_intrusive_pointer_cast<BlockPlan>(ctx->saved_data["plan"].toCapsule());
    check_single_backward(*plan, "nt_xent_loss");
    const auto& L = plan->layout;
    auto z_all = ctx->get_saved_variables()[0];
    // The buffer leaves the graph now: it becomes the gradient below and is
    // freed (or returned to the workspace) when this backward returns, not
    // when the caller drops the loss (often only after the next forward).
    auto S = ctx->saved_data["S"].toTensor();
    ctx->saved_data.erase("S");
    auto lse = ctx->saved_data["lse"].toTensor();
    auto lse_all = ctx->saved_data["lse_all"].toTensor();
    const int64_t b2 = S.size(0), b = b2 / 2, d = z_all.size(1);
    const auto w = nt_weights(*plan, grads[0], S.scalar_type());
    auto idx = self_and_positive(b, L, S.device());
    auto minus = w.row.defined() ? w.row * 2.0 : torch::full({b2}, 2.0, S.options());  // [2b]
    // Chunk by chunk, as the forward: w_u exp(S_uv - lse_u) + w_v exp(S_uv - lse_v)
    // (P and the rows of P^T this rank needs) fused in place, 0 on the self
    // column; the positives lose 2 w_u; then the chunk's rows of G~ Z while it
    // is in cache. The scalar c (which holds 1/T) goes on the [2b, d] product.
    // Bounded, the buffer holds E = exp(S - 1/T), and both terms are E times
    // a factor: exp(S_uv - lse_u) = E_uv exp(1/T - lse_u) and
    // exp(S_uv - lse_v) = E_uv exp(1/T - lse_v), so G~ = E (a_u + b_v) with
    // a = w exp(1/T - lse), b = w_all exp(1/T - lse_all) (each <= e^(2/T):
    // finite, as 2/T is within the exponent range).
    torch::Tensor a, bc;  // bounded: [2b], [2B]
    if (plan->shift) {
      a = shift_factors(*plan->shift, lse, w.row);
      bc = shift_factors(*plan->shift, lse_all, w.all);
    }
    auto dz = torch::empty({b2, d}, S.options());  // [2b, d]
    const int64_t R = gemm_chunk_rows(b2, S.size(1), S);
    for (int64_t r0 = 0; r0 < b2; r0 += R) {
      const int64_t n = std::min(R, b2 - r0);
      auto Sc = S.narrow(0, r0, n);
      if (plan->shift) {
        scale_rows_plus_cols_(Sc, a.narrow(0, r0, n), bc);
      } else {
        softmax_grad_(Sc, lse.narrow(0, r0, n), w.row.defined() ? w.row.narrow(0, r0, n) : torch::Tensor(), lse_all,
                      w.all);
      }
      const auto rows = idx[0].narrow(0, 0, n), pos = idx[2].narrow(0, r0, n);
      Sc.index_put_({rows, pos}, Sc.index({rows, pos}) - minus.narrow(0, r0, n));
      auto out = dz.narrow(0, r0, n);
      torch::mm_out(out, Sc, z_all);
    }
    return {dz.mul_(w.c), torch::Tensor(), torch::Tensor()};
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

  // Rows of every rank's key block (g per row) and their first global column.
  std::vector<int64_t> key_counts() const {
    auto c = layout.counts;
    for (auto& x : c) x *= spec.group;
    return c;
  }
  std::vector<int64_t> key_starts() const {
    auto c = key_counts();
    std::vector<int64_t> s(c.size(), 0);
    for (size_t i = 1; i < c.size(); ++i) s[i] = s[i - 1] + c[i - 1];
    return s;
  }
};

// Visits every key block: the gathered keys as one block at column 0, or the
// ring's blocks with their global first column.
void for_each_key_block(const TiledPlan& plan, const torch::Tensor& k,
                        const std::function<void(int64_t owner, int64_t col0, const torch::Tensor&)>& visit) {
  const auto& L = plan.layout;
  if (!plan.ring) return visit(L.rank, 0, k);
  const auto starts = plan.key_starts();
  ring_for_each_block(L.comm, plan.key_counts(), k,
                      [&](int64_t owner, const torch::Tensor& block) { visit(owner, starts[owner], block); });
}

// CLIP / InfoNCE / grouped, tiled: ClipBlock's forward statistics and gradient
// (see the derivation above ClipBlock), one [tile x tile] block at a time; the
// label structure is recomputed per tile from the labels (O(R + C) each).
class TiledClipBlock : public torch::autograd::Function<TiledClipBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q /* [b, d] */,
                               const torch::Tensor& k /* [N, d], or [b g, d] in ring mode */,
                               const torch::Tensor& scale /* [] */, const c10::optional<torch::Tensor>& bias /* [] */,
                               const c10::intrusive_ptr<TiledPlan>& plan) {
    const auto& L = plan->layout;
    const int64_t b = q.size(0), tile = plan->tile, g = plan->spec.group, d = q.size(1);
    const bool has_bias = bias.has_value() && bias->defined();
    auto qs = q * scale;  // [b, d]
    ForwardStats st(*plan, b, qs.options());
    for_each_key_block(*plan, k, [&](int64_t, int64_t col0, const torch::Tensor& block) {
      for (int64_t r0 = 0; r0 < b; r0 += tile) {
        const int64_t R = std::min(tile, b - r0);
        for (int64_t c0 = 0; c0 < block.size(0); c0 += tile) {
          const int64_t C = std::min(tile, block.size(0) - c0);
          auto t = torch::mm(qs.narrow(0, r0, R), block.narrow(0, c0, C).t());  // [R, C]
          if (has_bias) t.add_(*bias);
          auto P = apply_labels(*plan, t, r0, col0 + c0);
          st.add(t, P, r0, col0 + c0);
        }
      }
    });
    // The designated positives: every g-th row of this rank's own candidates.
    auto own = plan->ring ? k : k.narrow(0, L.offset * g, b * g);         // [b g, d]
    auto designated = (qs * own.reshape({b, g, d}).select(1, 0)).sum(1);  // [b]
    if (has_bias) designated = designated + *bias;
    RowTerms rt;
    auto l = finish_forward(*plan, st, designated, rt);
    ctx->save_for_backward({q, k, scale});
    ctx->saved_data["lse_row"] = rt.lse_row;
    if (rt.lse_col.defined()) ctx->saved_data["lse_col"] = rt.lse_col;
    if (rt.inv_n_row.defined()) ctx->saved_data["inv_n_row"] = rt.inv_n_row;
    if (rt.inv_n_col.defined()) ctx->saved_data["inv_n_col"] = rt.inv_n_col;
    ctx->saved_data["has_bias"] = has_bias;
    if (has_bias) ctx->saved_data["bias"] = bias->detach();
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return reduce_rows(l, L, plan->spec.reduction);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(), "clip_loss(): double backward (create_graph=true) is not supported");
    auto plan = c10::static_intrusive_pointer_cast<TiledPlan>(ctx->saved_data["plan"].toCapsule());
    const auto& L = plan->layout;
    auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& k = saved[1];
    const auto& scale = saved[2];
    const auto rt = ClipBlock::saved_terms(ctx);
    torch::Tensor bias;
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    if (has_bias) bias = ctx->saved_data["bias"].toTensor();
    const int64_t b = q.size(0), tile = plan->tile;
    const bool want_dk = ctx->needs_input_grad(1);
    const bool want_bias = has_bias && ctx->needs_input_grad(3);
    const auto w = backward_weights(*plan, grads[0], q.scalar_type());
    auto qs = q * scale;            // [b, d]
    auto A = torch::zeros_like(q);  // [b, d]: sum_j G_ij k_j
    auto g_sum = torch::zeros({}, q.options());
    auto visit = [&](int64_t, int64_t col0, const torch::Tensor& block) {
      torch::Tensor dk = want_dk ? torch::zeros_like(block) : torch::Tensor();  // [n, d]
      for (int64_t c0 = 0; c0 < block.size(0); c0 += tile) {
        const int64_t C = std::min(tile, block.size(0) - c0);
        auto kt = block.narrow(0, c0, C);  // [C, d]
        for (int64_t r0 = 0; r0 < b; r0 += tile) {
          const int64_t R = std::min(tile, b - r0);
          auto t = torch::mm(qs.narrow(0, r0, R), kt.t());  // [R, C], then in place G
          if (has_bias) t.add_(bias);
          auto P = apply_labels(*plan, t, r0, col0 + c0);
          tile_gradient(*plan, rt, w, t, P, r0, col0 + c0);
          t.mul_(w.c);
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
      const auto counts = plan->key_counts();
      const auto starts = plan->key_starts();
      if (want_dk) {
        dk = ring_for_each_block_grad(L.comm, counts, k, [&](int64_t owner, const torch::Tensor& block) {
          return visit(owner, starts[owner], block);
        });
      } else {
        ring_for_each_block(L.comm, counts, k,
                            [&](int64_t owner, const torch::Tensor& block) { visit(owner, starts[owner], block); });
      }
    }
    auto dq = A * scale;
    torch::Tensor ds;
    if (ctx->needs_input_grad(2)) ds = (A * q).sum().reshape(scale.sizes());
    return {dq, dk, ds, want_bias ? g_sum : torch::Tensor(), torch::Tensor()};
  }
};

// NT-Xent, tiled: NtXentBlock's gradient entry by entry, over the gathered Z
// (one block, no gradient) or, on the ring, over every rank's block
// [z1_s; z2_s] as it passes. Either way the backward needs no gradient
// collective: G~ (above NtXentBlock) of rank r's rows is computed from its own
// rows' logits and every row's lse (all-gathered, O(B)), so the ring's
// backward sends the (gradient-free) blocks around once more and nothing else.
// Row tiles never straddle the two views, so a tile's self and positive
// entries are each one diagonal (tile_diag's offset, per view v of the rows):
//   gathered Z, columns [z1_all; z2_all]: self off + p (view 1) and
//     B + off + p - b (view 2); positive B + off + p and off + p - b;
//   ring, the own block [z1_r; z2_r] (columns in local order): self p,
//     positive p + b (view 1) and p - b (view 2); other blocks have neither.
class TiledNtXentBlock : public torch::autograd::Function<TiledNtXentBlock> {
 public:
  struct Diagonals {
    bool any = false;                    // does this block hold self/positive columns?
    int64_t self_off[2] = {0, 0}, pos_off[2] = {0, 0};  // per view of the rows
  };

  static Diagonals diagonals(const TiledPlan& plan, int64_t owner) {
    const auto& L = plan.layout;
    const int64_t b = L.counts[L.rank];
    Diagonals d;
    if (!plan.ring) {
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
  // [z1_s; z2_s] of 2 b_s rows starting at key row col0 = 2 off_s (the plan
  // counts two key rows per example), [v[off_s : off_s + b_s]; v[B + off_s : ...]].
  static torch::Tensor block_cols(const TiledPlan& plan, int64_t col0, const torch::Tensor& block,
                                  const torch::Tensor& v /* [2B] */) {
    if (!plan.ring || !v.defined()) return v;
    const int64_t off = col0 / 2, bs = block.size(0) / 2;
    return torch::cat({v.narrow(0, off, bs), v.narrow(0, plan.layout.total + off, bs)});
  }

  static void for_each_tile(int64_t b, int64_t n_cols, int64_t tile,
                            const std::function<void(int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t v)>& fn) {
    for (int64_t v = 0; v < 2; ++v) {
      for (int64_t r0 = v * b; r0 < (v + 1) * b; r0 += tile) {
        const int64_t R = std::min(tile, (v + 1) * b - r0);
        for (int64_t c0 = 0; c0 < n_cols; c0 += tile) fn(r0, R, c0, std::min(tile, n_cols - c0), v);
      }
    }
  }

  // keys: the gathered Z ([2B, d]) or, on the ring, this rank's own block
  // ([2b, d] = z without gradient).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& z /* [2b, d] */, const torch::Tensor& keys,
                               const c10::intrusive_ptr<TiledPlan>& plan) {
    const auto& L = plan->layout;
    const int64_t b2 = z.size(0), b = b2 / 2, B = L.total;
    auto zs = z * plan->inv_temperature;  // [2b, d]
    auto lse = torch::full({b2}, -kInf, zs.options());
    for_each_key_block(*plan, keys, [&](int64_t owner, int64_t, const torch::Tensor& block) {
      const auto dg = diagonals(*plan, owner);
      for_each_tile(b, block.size(0), plan->tile, [&](int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t v) {
        auto t = torch::mm(zs.narrow(0, r0, R), block.narrow(0, c0, C).t());  // [R, C]
        if (dg.any) tile_diag(t, r0, c0, dg.self_off[v]).fill_(-kInf);
        auto lr = lse.narrow(0, r0, R);
        lr.copy_(torch::logaddexp(lr, tile_lse(t, /*rows=*/true, /*cols=*/false).row));
      });
    });
    // S_{u, pos(u)}: view-1 row i against view-2 row i of the same example.
    auto zd = z.detach();
    auto swapped = torch::cat({zd.narrow(0, b, b), zd.narrow(0, 0, b)});  // [2b, d]
    auto positive = (zs * swapped).sum(1);                                 // [2b]
    torch::Tensor lse_all = lse;
    if (L.world > 1) {
      auto pairs = L.comm->all_gather_rows(lse.view({2, b}).t().contiguous(), L.counts, "lse_all_gather");  // [B, 2]
      lse_all = pairs.t().reshape({2 * B});
    }
    ctx->save_for_backward({z, keys});
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["lse_all"] = lse_all;
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return nt_reduce(lse - positive, *plan);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(), "nt_xent_loss(): double backward (create_graph=true) is not supported");
    auto plan = c10::static_intrusive_pointer_cast<TiledPlan>(ctx->saved_data["plan"].toCapsule());
    auto saved = ctx->get_saved_variables();
    const auto& z = saved[0];
    const auto& keys = saved[1];
    auto lse = ctx->saved_data["lse"].toTensor();
    auto lse_all = ctx->saved_data["lse_all"].toTensor();
    const int64_t b = z.size(0) / 2;
    const auto w = nt_weights(*plan, grads[0], z.scalar_type());
    auto zs = z * plan->inv_temperature;
    auto A = torch::zeros_like(z);  // [2b, d]
    for_each_key_block(*plan, keys, [&](int64_t owner, int64_t col0, const torch::Tensor& block) {
      const auto dg = diagonals(*plan, owner);
      const auto lse_cols = block_cols(*plan, col0, block, lse_all);
      const auto w_cols = block_cols(*plan, col0, block, w.all);
      for_each_tile(b, block.size(0), plan->tile, [&](int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t v) {
        auto zt = block.narrow(0, c0, C);
        auto t = torch::mm(zs.narrow(0, r0, R), zt.t());  // [R, C], then in place G
        if (dg.any) tile_diag(t, r0, c0, dg.self_off[v]).fill_(-kInf);
        softmax_grad_(t, lse.narrow(0, r0, R), w.row.defined() ? w.row.narrow(0, r0, R) : torch::Tensor(),
                      lse_cols.narrow(0, c0, C), w_cols.defined() ? w_cols.narrow(0, c0, C) : torch::Tensor());
        auto pos = dg.any ? tile_diag(t, r0, c0, dg.pos_off[v]) : t.narrow(0, 0, 0).select(1, 0);
        if (pos.numel() > 0) {
          if (w.row.defined()) {
            // The diagonal's first row: max(0, -(pos_off + r0 - c0)) within the tile.
            const int64_t first = std::max<int64_t>(0, -(dg.pos_off[v] + r0 - c0));
            pos.sub_(w.row.narrow(0, r0 + first, pos.numel()) * 2.0);
          } else {
            pos.sub_(2.0);
          }
        }
        A.narrow(0, r0, R).addmm_(t.mul_(w.c), zt);
      });
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

c10::ScalarType compute_dtype(c10::ScalarType t) { return (t == c10::kHalf || t == c10::kBFloat16) ? c10::kFloat : t; }

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

bool route_tiled(MemoryPath path, int64_t tile_size, bool ring, int64_t logits_bytes, int64_t max_logits_bytes) {
  if (path == MemoryPath::kTiled || ring) return true;
  if (path == MemoryPath::kMaterialised || tile_size == -1) return false;
  return tile_size > 0 || logits_bytes > max_logits_bytes;
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
                              const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec) {
  TORCH_INTERNAL_ASSERT(spec.group >= 1 && (!spec.symmetric || spec.group == 1));
  auto plan = c10::make_intrusive<BlockPlan>();
  plan->layout = layout;
  plan->spec = spec;
  c10::optional<torch::Tensor> opt_bias;
  if (bias.defined()) opt_bias = bias;
  return ClipBlock::apply(q, k_all, scale, opt_bias, plan);
}

torch::Tensor tiled_clip_block_loss(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                                    const torch::Tensor& bias, const EngineLayout& layout, const BlockSpec& spec,
                                    int64_t tile, bool ring) {
  TORCH_INTERNAL_ASSERT(spec.group >= 1 && (!spec.symmetric || spec.group == 1));
  auto plan = c10::make_intrusive<TiledPlan>();
  plan->layout = layout;
  plan->spec = spec;
  plan->tile = tile;
  plan->ring = ring && layout.world > 1;
  c10::optional<torch::Tensor> opt_bias;
  if (bias.defined()) opt_bias = bias;
  return TiledClipBlock::apply(q, k, scale, opt_bias, plan);
}

torch::Tensor tiled_nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& keys, double inv_temperature,
                                       const EngineLayout& layout, int64_t tile, Reduction reduction, bool ring) {
  auto plan = c10::make_intrusive<TiledPlan>();
  plan->layout = layout;
  plan->reduction = reduction;
  plan->inv_temperature = inv_temperature;
  plan->tile = tile;
  plan->ring = ring && layout.world > 1;
  plan->spec.group = 2;  // key rows per example (its two views): a ring block is [z1_s; z2_s]
  return TiledNtXentBlock::apply(z, plan->ring ? z.detach() : keys, plan);
}

torch::Tensor nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& z_all, double inv_temperature,
                                 const EngineLayout& layout, Reduction reduction, bool unit_rows) {
  auto plan = c10::make_intrusive<BlockPlan>();
  plan->layout = layout;
  plan->reduction = reduction;
  plan->inv_temperature = inv_temperature;
  // Unit rows: |S| <= 1/T (in fp32 usable for T >= 0.025).
  if (unit_rows && bound_fits(inv_temperature, z.scalar_type())) plan->shift = inv_temperature;
  return NtXentBlock::apply(z, z_all, plan);
}

}  // namespace contrax::detail

namespace contrax {

void set_keep_loss_workspace(bool keep) {
  detail::keep_workspace_flag().store(keep);
  if (!keep) release_loss_workspace();
}

bool keep_loss_workspace() { return detail::keep_workspace_flag().load(); }

int64_t loss_workspace_bytes() {
  const auto& st = detail::thread_workspace().storage;
  return st ? static_cast<int64_t>(st.nbytes()) : 0;
}

void release_loss_workspace() { detail::thread_workspace().storage = c10::Storage(); }

}  // namespace contrax
