// maxsim_loss's cost on each memory path (see check/plan_maxsim.h). The counts
// follow src/losses/maxsim.cpp, engine/maxsim.h and engine/maxsim_tiles.h;
// tests/check/loss_plan_test.cpp checks the bytes against the communicator's
// counters of real calls and the steps against the steps walked.
//
// With b queries on the rank, N = B g documents (n = b g this rank's), Lq
// and Ld tokens of width d, e bytes per element (MaxSim computes in the
// compute dtype, the documents too), P = Ld d + Ld the entries of a packed
// document row (tokens and mask, engine/maxsim_tiles.h):
// * GEMMs: one token product [b Lq x N Ld x d] forward and one in the
//   backward (recomputed), whose arg-max products add 2 b Lq N d flops; the
//   dense einsum form takes three (its forward, and its backward's two).
// * Bytes: materialised, the tokens gathered with gradient (reduce-scattered
//   back) and their masks as bytes; tiled, the packed rows gathered with
//   gradient; ring, the packed blocks W - 1 hops forward, and again in the
//   backward beside their gradient partials.
// * Held: materialised, the [b x N] scores and one panel of token work;
//   tiled and ring, one step's [R x C] logits and its token work (pair_step
//   within token_panel_bytes, engine/panels.h), besides the documents: every
//   rank's and their gradient (gathered), or two messages of a block and
//   a partial, the visit's contribution and the rank's own gradient (ring,
//   comm/collectives.cpp).
#include "check/plan_maxsim.h"

#include <algorithm>
#include <limits>

#include "engine/maxsim_tiles.h"
#include "engine/panels.h"
#include "engine/precision.h"

namespace contrax::detail {

namespace {

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / std::max<int64_t>(y, 1); }

// A walk over `rows` x `cols` pairs in `blocks` blocks, steps within the budget
// (at most `cap` a side): its steps, their shape, and what a step holds (its
// logits, plus its token work).
void walk(PathCost& c, int64_t blocks, int64_t rows, int64_t cols, int64_t pair_bytes, int64_t budget, int64_t cap,
          int64_t e) {
  const auto step = pair_step(rows, cols, pair_bytes, budget, cap);
  c.panel_rows = std::min(step.rows, std::max<int64_t>(rows, 1));
  c.panel_cols = std::min(step.cols, std::max<int64_t>(cols, 1));
  c.panels = blocks * ceil_div(rows, step.rows) * ceil_div(cols, step.cols);
  c.logits_bytes = c.panel_rows * c.panel_cols * e;
  c.workspace_bytes = c.logits_bytes + c.panel_rows * c.panel_cols * pair_bytes;
}

}  // namespace

int64_t maxsim_costs(const PlanOptions& o, int64_t b, PathCost& mat, PathCost& tiled, PathCost& ring) {
  const int64_t W = o.world(), g = o.group(), d = o.width(), Lq = o.query_tokens(), Ld = o.document_tokens();
  const int64_t e = static_cast<int64_t>(c10::elementSize(compute_dtype(o.dtype())));
  const int64_t N = o.batch() * g, n = b * g, P = Ld * d + Ld;
  const double token = 2.0 * static_cast<double>(b * Lq) * static_cast<double>(N * Ld) * static_cast<double>(d);
  for (auto* c : {&mat, &tiled, &ring}) {
    c->gemms = 2;
    c->gemm_flops = 2 * token + 2.0 * static_cast<double>(b * Lq) * static_cast<double>(N * d);
    c->launches = -1;  // not modelled
  }
  mat.bytes_sent_forward = (W - 1) * n * Ld * (d * e + 1);
  mat.bytes_sent_backward = (N - n) * Ld * d * e;
  tiled.bytes_sent_forward = ring.bytes_sent_forward = (W - 1) * n * P * e;
  tiled.bytes_sent_backward = (N - n) * P * e;
  ring.bytes_sent_backward = 2 * (W - 1) * n * P * e;
  mat.feature_bytes = N * Ld * (2 * d * e + 1);
  tiled.feature_bytes = 2 * N * P * e;
  ring.feature_bytes = 6 * n * P * e;  // two messages of a block and a partial, a contribution, its own
  // The materialised scores, walked in panels of Lq Ld e a pair (the
  // backward's, of Lq max(Ld, d) e, are held at the peak).
  const int64_t budget = o.token_panel_bytes(), pair = maxsim_pair_bytes(Lq, Ld, d, e);
  const int64_t none = std::numeric_limits<int64_t>::max();
  walk(mat, 1, b, N, Lq * Ld * e, budget, none, e);
  const auto back = pair_step(b, N, pair, budget, none);
  mat.logits_bytes = b * N * e;
  mat.workspace_bytes = mat.logits_bytes + std::min(b, back.rows) * std::min(N, back.cols) * pair;
  const int64_t tile = tile_side(std::max<int64_t>(o.tile_size(), 0), o.tile_bytes(), e);
  walk(tiled, 1, b, N, pair, budget, tile, e);
  walk(ring, W, b, n, pair, budget, tile, e);
  return 3;
}

}  // namespace contrax::detail
