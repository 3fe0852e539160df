// Cost model of the loss engine's paths (see contrax/check/plan.h). The counts follow
// the code in src/engine/ and the front ends (src/losses/infonce.cpp,
// src/losses/grouped.cpp); tests/check/loss_plan_test.cpp checks the byte counts against the
// communicator's counters of a real call and the routing against the losses'
// own choice.
#include "contrax/check/plan.h"

#include <iomanip>
#include <sstream>
#include <utility>

#include "check/plan_maxsim.h"
#include "contrax/engine/workspace.h"
#include "engine/lse_kernels.h"
#include "engine/panels.h"
#include "engine/prefix_block.h"
#include "engine/prologue.h"
#include "util/check.h"
#include "util/cuda_side.h"

namespace contrax {

namespace {

void check_plan_options(const PlanOptions& o) {
  const std::string& loss = o.loss();
  TORCH_CHECK(loss == "clip" || loss == "infonce" || loss == "grouped" || loss == "nt_xent" || loss == "moco_v3" ||
                  loss == "siglip" || loss == "maxsim",
              "plan_loss(): argument 'loss' must be clip, infonce, grouped, nt_xent, moco_v3, siglip or maxsim, but "
              "got '", loss, "'");
  TORCH_CHECK(o.group() >= 1, "plan_loss(): argument 'group' must be >= 1, but got ", o.group());
  TORCH_CHECK(o.group() == 1 || loss == "grouped" || loss == "maxsim",
              "plan_loss(): argument 'group' applies to losses 'grouped' and 'maxsim' only, but loss is '", loss, "'");
  if (loss == "maxsim") {
    TORCH_CHECK(o.query_tokens() > 0 && o.document_tokens() > 0,
                "plan_loss(): arguments 'query_tokens' and 'document_tokens' must be positive, but got ",
                o.query_tokens(), " and ", o.document_tokens());
    TORCH_CHECK(o.token_panel_bytes() > 0, "plan_loss(): argument 'token_panel_bytes' must be positive, but got ",
                o.token_panel_bytes());
    TORCH_CHECK(o.matryoshka_dims().empty(),
                "plan_loss(): argument 'matryoshka' applies to the dot-product losses, not to 'maxsim'");
  }
  TORCH_CHECK(o.batch() > 0, "plan_loss(): argument 'batch' must be positive, but got ", o.batch());
  TORCH_CHECK(o.width() > 0, "plan_loss(): argument 'width' must be positive, but got ", o.width());
  TORCH_CHECK(o.world() > 0, "plan_loss(): argument 'world' must be positive, but got ", o.world());
  TORCH_CHECK(o.tile_size() >= -1,
              "plan_loss(): argument 'tile_size' must be >= 0 (the tile side; 0 chooses it from tile_bytes), but got ",
              o.tile_size());
  TORCH_CHECK(c10::isFloatingType(o.dtype()), "plan_loss(): argument 'dtype' must be a floating type, but got ",
              o.dtype());
  TORCH_CHECK(o.panel_bytes() >= 0, "plan_loss(): argument 'panel_bytes' must be >= 0 (0: automatic), but got ",
              o.panel_bytes());
  detail::ArgChecker check("plan_loss");
  detail::check_matryoshka(check, o.matryoshka(), o.width());
  check.throw_if_failed();
  TORCH_CHECK(o.gpu_memory() >= 0,
              "plan_loss(): argument 'gpu_memory' must be >= 0 (bytes; 0: this machine's GPU), but got ",
              o.gpu_memory());
}

// The panel budget of a plan and where it comes from (PlanOptions::gpu_memory).
std::pair<int64_t, std::string> planned_budget(const PlanOptions& o) {
  if (o.panel_bytes() > 0) return {o.panel_bytes(), "panel_bytes (--panel-bytes)"};
  if (!o.device().is_cuda() || loss_panel_bytes() > 0) {
    return {detail::panel_budget(o.device()), o.device().is_cuda() ? "the loss panel budget set here" : ""};
  }
  if (o.gpu_memory() > 0) {
    return {detail::default_panel_bytes(o.gpu_memory()),
            c10::str("a GPU of ", static_cast<double>(o.gpu_memory()) / 1e9, " GB (--gpu-memory)")};
  }
  if (detail::cuda_device_count() > 0) return {detail::panel_budget(o.device()), "this machine's GPU"};
  return {detail::default_panel_bytes(kReferenceGpuMemory),
          "an 80 GB GPU (A100, H100), assumed: none is visible here; --gpu-memory to plan for another"};
}

// The bytes of the O(B) statistics a forward exchanges once per block call:
// the column log-sum-exps of symmetric CLIP, every row's of NT-Xent.
int64_t statistics_bytes(const PlanOptions& o, int64_t b, int64_t e) {
  const int64_t W = o.world();
  if (o.loss() == "clip") return (W - 1) * o.batch() * e;
  if (o.loss() == "nt_xent") return (W - 1) * 2 * b * e;
  return 0;
}

// Per loss: the GEMM units, bytes sent and feature bytes of each path, and
// the old algorithm's GEMM units. `b`: the largest rank's rows; `e`: bytes per
// element of the compute dtype (logits, log-sum-exps, gradient sums); `f`: of
// the operand dtype (features gathered or sent around the ring, and the
// gradients returned to them: engine/precision.h).
int64_t count_costs(const PlanOptions& o, int64_t b, int64_t e, int64_t f, bool fused, PathCost& mat,
                    PathCost& tiled, PathCost& ring) {
  const std::string& loss = o.loss();
  const int64_t W = o.world(), B = o.batch(), d = o.width();
  const int64_t gather = (W - 1) * b * d * f;    // one [b, d] tower all-gathered
  const int64_t partials = (W - 1) * b * d * e;  // the ring's gradient partials, as many rows
  int64_t old_gemms = 0;
  if (loss == "clip" || loss == "infonce") {
    const bool sym = loss == "clip";
    // Materialised: S = A B^T, dA = G B, dB = G^T A. Tiled: + one recomputation of S.
    mat.gemms = 3;
    tiled.gemms = ring.gemms = 4;
    const int64_t lse = statistics_bytes(o, b, e);  // the column log-sum-exps (symmetric)
    mat.bytes_sent_forward = tiled.bytes_sent_forward = gather + lse;
    mat.bytes_sent_backward = tiled.bytes_sent_backward = (B - b) * d * f;  // reduce-scatter of dB_all
    ring.bytes_sent_forward = gather + lse;                                 // W-1 hops of a block
    ring.bytes_sent_backward = gather + partials;                           // blocks again, with partials
    // B_all in the operand dtype; dB_all is its fp32 product, then cast (both
    // held for a moment). The ring: two messages of a block (operands) and a
    // partial (fp32), the visit's contribution and the rank's own gradient.
    mat.feature_bytes = tiled.feature_bytes = B * d * (f + e);
    ring.feature_bytes = 2 * b * d * (f + e) + 2 * b * d * e;
    old_gemms = sym ? 6 : 3;
  } else if (loss == "grouped") {
    // One direction over [B g] candidates: S = Q C_all^T, dQ = G C_all, dC_all =
    // G^T Q, each g units; tiled recomputes S. The candidate tower is gathered
    // and its gradient reduce-scattered; no column statistics.
    const int64_t g = o.group(), cgather = g * gather;
    mat.gemms = 3 * g;
    tiled.gemms = ring.gemms = 4 * g;
    mat.bytes_sent_forward = tiled.bytes_sent_forward = cgather;
    mat.bytes_sent_backward = tiled.bytes_sent_backward = (B - b) * g * d * f;
    ring.bytes_sent_forward = cgather;
    ring.bytes_sent_backward = cgather + g * partials;
    mat.feature_bytes = tiled.feature_bytes = B * g * d * (f + e);
    ring.feature_bytes = 2 * b * g * d * (f + e) + 2 * b * g * d * e;
    old_gemms = 3 * g;
  } else if (loss == "nt_xent") {
    // Materialised: S = Z_r Z_all^T ([2b x 2B]: 4 units), dZ_r = G Z_all (4
    // units). Tiled and ring recompute S in the backward (4 more). Z travels
    // without gradient: gathered once, or around the ring in the forward and
    // again in the backward (no gradient blocks); then every row's lse.
    mat.gemms = 8;
    tiled.gemms = ring.gemms = 12;
    const int64_t z = 2 * gather, lse = statistics_bytes(o, b, e);
    mat.bytes_sent_forward = tiled.bytes_sent_forward = ring.bytes_sent_forward = z + lse;
    mat.bytes_sent_backward = tiled.bytes_sent_backward = 0;  // no backward collective
    ring.bytes_sent_backward = z;                             // the blocks once more
    mat.feature_bytes = tiled.feature_bytes = 2 * B * d * f;
    ring.feature_bytes = 4 * b * d * f;  // the block in hand and the arriving one
    old_gemms = 12;
  } else if (loss == "siglip") {
    // S = A B^T, dA = H B, dB = H^T A. Tiled recomputes S in the backward,
    // except with the fused kernel and gathered keys, whose forward runs the
    // gradient's GEMMs. B is gathered with gradient (or travels the ring);
    // no column statistics.
    mat.gemms = 3;
    tiled.gemms = fused ? 3 : 4;
    ring.gemms = 4;
    mat.bytes_sent_forward = tiled.bytes_sent_forward = ring.bytes_sent_forward = gather;
    mat.bytes_sent_backward = tiled.bytes_sent_backward = (B - b) * d * f;
    ring.bytes_sent_backward = gather + partials;
    mat.feature_bytes = tiled.feature_bytes = B * d * (f + e);
    ring.feature_bytes = 2 * b * d * (f + e);
    old_gemms = 3;
  } else {  // moco_v3: two directions, keys without gradient
    mat.gemms = 4;
    tiled.gemms = ring.gemms = 6;
    mat.bytes_sent_forward = tiled.bytes_sent_forward = 2 * gather;
    ring.bytes_sent_forward = 2 * gather;
    ring.bytes_sent_backward = 2 * gather;  // the key blocks again, for the recomputation
    mat.feature_bytes = tiled.feature_bytes = 2 * B * d * f;
    ring.feature_bytes = 4 * b * d * f;
    old_gemms = 4;
  }
  return old_gemms;
}

// The logits blocks one rank walks: `count` blocks of `rows` x `cols`.
// Gathered keys: one block of every key per direction (NT-Xent: per view of
// the rows, engine/tiled_blocks.cpp; MoCo v3: per direction). The ring visits
// every rank's block instead, W of them with b columns each (b g grouped, 2b
// NT-Xent).
struct Blocks {
  int64_t count = 1, rows = 0, cols = 0;
};
Blocks walked_blocks(const PlanOptions& o, int64_t b, bool ring) {
  const std::string& loss = o.loss();
  const int64_t W = ring ? o.world() : 1, B = o.batch();
  const int64_t keys = ring ? b : B;  // one block's key rows
  if (loss == "grouped") return {W, b, keys * o.group()};
  if (loss == "nt_xent") return {2 * W, b, 2 * keys};
  if (loss == "moco_v3") return {2 * W, b, keys};
  return {W, b, keys};
}

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / std::max<int64_t>(y, 1); }

// The launch model of a forward + backward (see PathCost::launches): a fixed
// count and one per panel of the forward's walk (the backward walks as many),
// with the ATen forms of the element-wise passes or with the fused CUDA panel
// kernels. fp32 features, no labels, no bias, the losses' default
// normalisation; W = 1, and the ring at W = 2, its panels those of the W
// blocks it walks (the blocks' sends and receives are no ATen operator: on
// NCCL they are its own kernels, not counted). Its rows, and what one panel
// launches, are the table of docs/engine.md ("The launch model"), which
// panels_test reads and checks against this model, and the model against
// launches counted on the CPU walking as CUDA does (support/op_counter.h; the
// fused kernels under the SIMT emulator; the ring on thread ranks). The
// grouped loss is InfoNCE's row.
enum class Walked { kTiled, kMaterialised, kRing };
struct LaunchModel {
  const char* loss;
  Walked path;
  bool fused;
  int64_t fixed, per_panel;
};
constexpr Walked kT = Walked::kTiled, kM = Walked::kMaterialised, kR = Walked::kRing;
constexpr LaunchModel kLaunchModels[] = {
    {"clip", kT, false, 27, 27},    {"clip", kM, false, 27, 25},    {"clip", kT, true, 29, 7},
    {"clip", kM, true, 29, 6},      {"infonce", kT, false, 22, 16}, {"infonce", kM, false, 22, 14},
    {"infonce", kT, true, 22, 7},   {"infonce", kM, true, 22, 6},   {"nt_xent", kT, false, 63, 21},
    {"nt_xent", kM, false, 78, 16}, {"nt_xent", kT, true, 62, 12},  {"nt_xent", kM, true, 78, 16},
    {"moco_v3", kT, false, 93, 15}, {"moco_v3", kM, false, 87, 14}, {"moco_v3", kT, true, 93, 6},
    {"moco_v3", kM, true, 87, 6},   {"siglip", kT, false, 19, 12},  {"siglip", kM, false, 19, 12},
    {"siglip", kT, true, 19, 6},    {"siglip", kM, true, 19, 6},
    // the ring (W = 2)
    {"clip", kR, false, 44, 28},    {"clip", kR, true, 47, 9},      {"infonce", kR, false, 27, 17},
    {"infonce", kR, true, 28, 9},   {"nt_xent", kR, false, 70, 20}, {"nt_xent", kR, true, 70, 11},
    {"moco_v3", kR, false, 96, 16}, {"moco_v3", kR, true, 98, 8}, {"siglip", kR, false, 23, 11},
    {"siglip", kR, true, 24, 9},
};

int64_t estimate_launches(const PlanOptions& o, Walked path, int64_t panels, bool fused) {
  const std::string loss = o.loss() == "grouped" ? "infonce" : o.loss();
  LaunchModel m{nullptr, path, fused, 0, 0};
  for (const auto& row : kLaunchModels) {
    if (row.loss == loss && row.path == path && row.fused == fused) m = row;
  }
  TORCH_INTERNAL_ASSERT(m.loss != nullptr, "no launch model for loss '", o.loss(), "'");
  // Reduced operands (fp16/bf16 features; derived from the code, not counted:
  // the CPU has no mixed-dtype GEMM and widens instead): the gradients cast
  // back to the features' dtype, 2 fixed launches.
  const bool reduced = detail::operand_dtype(o.dtype(), o.device()) != detail::compute_dtype(o.dtype());
  if (reduced) {
    m.fixed += 2;
    // A materialised panel's G cast with c folded, and dk's accumulating GEMM
    // (the fused tiled panel writes G in the operand dtype itself).
    if (path == Walked::kMaterialised && loss != "nt_xent" && loss != "siglip") m.per_panel += 2;
  }
  return m.fixed + m.per_panel * panels;
}

// The walk of each path: steps, their shape, the workspace held at once and
// the launches.
void walk_costs(const PlanOptions& o, int64_t b, bool fused, int64_t budget, PathCost& mat, PathCost& tiled,
                PathCost& ring) {
  const auto dev = o.device().type();
  const int64_t e = c10::elementSize(detail::compute_dtype(o.dtype()));
  const auto walk =
      detail::make_walk(dev, o.dtype(), o.width(), std::max<int64_t>(o.tile_size(), 0), o.tile_bytes(), budget);
  for (auto* c : {&tiled, &ring}) {
    const auto blocks = walked_blocks(o, b, c == &ring);
    const auto step = walk.step(blocks.rows, blocks.cols);
    c->panel_rows = std::min(step.rows, blocks.rows);
    c->panel_cols = std::min(step.cols, blocks.cols);
    c->panels = blocks.count * ceil_div(blocks.rows, step.rows) * ceil_div(blocks.cols, step.cols);
    c->workspace_bytes = walk.panels ? detail::panel_workspace_bytes(dev, o.dtype(), {c->panel_rows, c->panel_cols},
                                                                     o.width())
                                     : c->logits_bytes;
    const bool on_ring = c == &ring && o.world() > 1;
    c->launches = !walk.panels ? -1 : estimate_launches(o, on_ring ? Walked::kRing : Walked::kTiled, c->panels, fused);
    if (walk.panels) c->logits_bytes = c->panel_rows * c->panel_cols * e;  // one panel
  }
  // The materialised buffer, walked in panels of every column: NT-Xent's one
  // [2b x 2B] buffer, MoCo v3's two [b x B] ones.
  auto blocks = walked_blocks(o, b, false);
  if (o.loss() == "nt_xent") blocks = {1, 2 * b, blocks.cols};
  // SigLIP's materialised block is one step of every row (siglip.cpp).
  const int64_t R = o.loss() == "siglip"
                        ? std::max<int64_t>(b, 1)
                        : detail::buffer_panel_rows(dev, o.dtype(), blocks.rows, blocks.cols, o.width(), budget);
  mat.panel_rows = R;
  mat.panel_cols = blocks.cols;
  mat.panels = blocks.count * ceil_div(blocks.rows, R);
  // Beside the buffer, a panel's temporaries: what a panel holds beyond its
  // own logits (none with the CPU's fused passes).
  const int64_t panel = detail::panel_workspace_bytes(dev, o.dtype(), {R, blocks.cols}, o.width());
  mat.workspace_bytes = mat.logits_bytes + panel - R * blocks.cols * e;
  mat.launches = detail::panels_on(dev) ? estimate_launches(o, Walked::kMaterialised, mat.panels, fused) : -1;
}

// Whether CLIP / InfoNCE / grouped prefixes share one pass (engine/prefix_block.h)
// on the materialised path: the CPU, features in the compute dtype.
bool shared_prefixes(const PlanOptions& o) {
  const auto& l = o.loss();
  return (l == "clip" || l == "infonce" || l == "grouped") && detail::prefix_pass_candidate(o.device(), o.dtype());
}

// Matryoshka prefixes (engine/scorer.h): the loss's own block runs on each
// prefix's cut, one after another. With P prefixes whose widths sum to S:
// GEMM work scales by S/d; the materialised path holds P logits buffers; each
// walk is taken P times (its launches too, plus 4 per prefix and feature set
// for the cut's normalisation, not counted); the gathered features travel
// once but the statistics once per prefix, and the ring's blocks once per
// prefix (S/d of the bytes); each prefix keeps its normalised cut of the keys
// for the backward. The shared pass (shared_prefixes) instead holds one
// buffer, a logits panel and the P - 1 narrower prefixes' recomputed panels
// (prefix_panel_rows, prefix_recompute_rows), and its GEMMs are the single
// product's three plus the backward's recomputation of the second widest
// prefix (m_(P-1)/d of a [b x B x d] product per block, the narrower ones on
// the way); it keeps the features, not their cuts.
void scorer_costs(const PlanOptions& o, int64_t b, int64_t e, int64_t f, PathCost& mat, PathCost& tiled,
                  PathCost& ring) {
  const auto prefixes = detail::matryoshka_prefixes(o.matryoshka(), o.width());
  if (prefixes.empty()) return;
  const int64_t P = static_cast<int64_t>(prefixes.size()), d = o.width();
  int64_t S = 0;
  for (const auto& x : prefixes) S += x.dim;
  const double share = static_cast<double>(S) / static_cast<double>(d);
  const double recomputed = P > 1 ? static_cast<double>(prefixes[P - 2].dim) / static_cast<double>(d) : 0.0;
  const int64_t stats = statistics_bytes(o, b, e);
  const auto scaled = [&](int64_t bytes) { return static_cast<int64_t>(static_cast<double>(bytes) * share); };
  const bool shared = shared_prefixes(o);
  for (auto* c : {&mat, &tiled, &ring}) {
    const bool one_pass = shared && c == &mat;
    // The shared pass: the forward's product and the backward's two over the
    // width once, plus the narrower prefixes recomputed (m_(P-1)/d of one).
    c->gemm_flops *= one_pass ? 1.0 + recomputed / 3.0 : share;
    c->panels *= P;
    if (c->launches >= 0) c->launches *= P;
    const auto keys = walked_blocks(o, b, c == &ring);
    if (!one_pass) c->feature_bytes += (keys.cols + b) * S * f;
  }
  if (shared) {
    const auto keys = walked_blocks(o, b, false);
    // The logits panel and the backward's panels of the recomputed prefixes.
    const int64_t R = detail::prefix_panel_rows(o.device().type(), o.dtype(), b, keys.cols, d);
    const int64_t panels = (R + (P - 1) * detail::prefix_recompute_rows(R, b, P)) * keys.cols * e;
    mat.logits_bytes += panels;
    mat.workspace_bytes += panels;
  } else {
    mat.logits_bytes *= P;
    mat.workspace_bytes += (P - 1) * (mat.logits_bytes / P);
  }
  for (auto* c : {&mat, &tiled}) c->bytes_sent_forward += (P - 1) * stats;
  ring.bytes_sent_forward = scaled(ring.bytes_sent_forward - stats) + P * stats;
  ring.bytes_sent_backward = scaled(ring.bytes_sent_backward);
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / 1048576.0 << " MiB";
  return os.str();
}

}  // namespace

LossPlan plan_loss(const PlanOptions& o) {
  check_plan_options(o);
  const std::string& loss = o.loss();
  LossPlan p;
  p.options = o;
  const int64_t W = o.world(), B = o.batch(), d = o.width();
  const int64_t b = (B + W - 1) / W;  // the largest rank
  p.rows_per_rank = b;
  const int64_t e = c10::elementSize(detail::compute_dtype(o.dtype()));
  const int64_t f = c10::elementSize(detail::operand_dtype(o.dtype(), o.device()));
  const double unit = 2.0 * static_cast<double>(b) * static_cast<double>(B) * static_cast<double>(d);
  // grouped_loss's buffer is [b x B g]: g blocks (its routing counts them so);
  // maxsim_loss's scores likewise.
  const int64_t blocks = loss == "grouped" || loss == "maxsim" ? o.group() : detail::logits_blocks(loss);
  const int64_t tile = detail::tile_side(std::max<int64_t>(o.tile_size(), 0), o.tile_bytes(), e);
  const int64_t tile_bytes = std::min(tile, b) * std::min(tile, B) * e;
  PathCost mat{"materialised"}, tiled{"tiled"}, ring{"ring"};
  ring.available = W > 1;
  // The fused kernels where a walk in panels would take them (the switch, a
  // device that has them; the CPU's emulated stand-in for CUDA too).
  if (loss == "maxsim") {
    p.old_gemms = detail::maxsim_costs(o, b, mat, tiled, ring);  // MaxSim's own steps on every device
  } else {
    p.fused = detail::panels_on(o.device().type()) && detail::fused_passes(o.device().type()) &&
              !(o.device().is_cpu() && !detail::emulated_panel_kernels_installed());
    p.old_gemms = count_costs(o, b, e, f, p.fused, mat, tiled, ring);
    mat.logits_bytes = blocks * b * B * e;
    tiled.logits_bytes = ring.logits_bytes = 2 * tile_bytes;  // a tile and one temporary
    for (auto* c : {&mat, &tiled, &ring}) c->gemm_flops = static_cast<double>(c->gemms) * unit;
    const auto [budget, source] = planned_budget(o);
    if (o.device().is_cuda()) p.panel_budget = budget, p.budget_source = source;
    walk_costs(o, b, p.fused, budget, mat, tiled, ring);
    scorer_costs(o, b, e, f, mat, tiled, ring);
  }
  p.paths = {mat, tiled, ring};

  // The losses' own routing, on the largest rank (P logits blocks per block
  // with prefixes, 1 for the shared pass: engine/scorer.h).
  const auto n_prefixes = static_cast<int64_t>(detail::matryoshka_prefixes(o.matryoshka(), d).size());
  const int64_t prefixes = n_prefixes == 0 || shared_prefixes(o) ? 1 : n_prefixes;
  const bool tiled_route =
      detail::route_tiled(o.path(), o.tile_size(), o.ring(), b * B * e * blocks * prefixes, o.max_logits_bytes());
  p.chosen = !tiled_route ? "materialised" : o.ring() && W > 1 ? "ring" : "tiled";
  return p;
}

std::string to_string(const LossPlan& p) {
  std::ostringstream os;
  const auto& o = p.options;
  const bool maxsim = o.loss() == "maxsim";
  os << "plan: " << o.loss()
     << (o.loss() == "grouped" || maxsim ? " (g = " + std::to_string(o.group()) + ")" : std::string())
     << ", B = " << o.batch() << " (" << p.rows_per_rank << " rows on the largest rank), d = " << o.width()
     << ", W = " << o.world() << ", " << o.dtype() << (o.device().is_cuda() ? " on CUDA" : "") << "\n";
  if (maxsim) {
    os << "scorer: MaxSim, " << o.query_tokens() << " query tokens x " << o.document_tokens()
       << " document tokens (token panels of " << mib(o.token_panel_bytes()) << "; GEMMs in units of one "
       << "[b Lq x B g Ld x d] token product; workspace: the scores or a step's logits, and its token work)\n";
  } else if (const auto prefixes = detail::matryoshka_prefixes(o.matryoshka(), o.width()); !prefixes.empty()) {
    os << "scorer: Matryoshka prefixes";
    for (size_t i = 0; i < prefixes.size(); ++i) os << (i ? ", " : " ") << prefixes[i].dim;
    os << (shared_prefixes(o) ? " (one shared pass over the width: the slices' products accumulate in one buffer)\n"
                              : " (each the loss's own block on the prefix's cut, one after another)\n");
  } else {
    os << "scorer: one dot product of the whole width\n";
  }
  os << "steps: "
     << (maxsim                   ? "queries x documents within the token panel budget"
         : o.device().is_cuda() ? "row panels of every column of a block"
                                : "square tiles")
     << " (each walked once forward, once backward); launches: GPU kernel launches of a forward + backward "
        "(estimate, "
     << (p.fused ? "the fused CUDA kernels" : "ATen forms") << ")\n";
  if (p.panel_budget > 0) os << "panel budget: " << mib(p.panel_budget) << ", for " << p.budget_source << "\n";
  os << "| path | logits held | features held | GEMMs (" << (maxsim ? "token products" : "[b x B x d] units")
     << ") | GFLOP | sent fwd | sent bwd | steps "
        "(rows x cols) | workspace | launches |\n";
  os << "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& c : p.paths) {
    if (!c.available) {
      os << "| " << c.path << " | needs W > 1 | | | | | | | | |\n";
      continue;
    }
    os << "| " << c.path << (c.path == p.chosen ? " (chosen)" : "") << " | " << mib(c.logits_bytes) << " | "
       << mib(c.feature_bytes) << " | " << c.gemms << " | " << std::fixed << std::setprecision(1) << c.gemm_flops / 1e9
       << " | " << mib(c.bytes_sent_forward) << " | " << mib(c.bytes_sent_backward) << " | " << c.panels << " ("
       << c.panel_rows << " x " << c.panel_cols << ") | " << mib(c.workspace_bytes) << " | "
       << (c.launches < 0 ? std::string("-") : std::to_string(c.launches)) << " |\n";
  }
  os << "old algorithm: " << p.old_gemms << " GEMM units\n";
  return os.str();
}

std::string to_json(const LossPlan& p) {
  std::ostringstream os;
  const auto& o = p.options;
  os << "{\"loss\": \"" << o.loss() << "\", \"group\": " << o.group() << ", \"batch\": " << o.batch()
     << ", \"width\": " << o.width() << ", \"world\": " << o.world() << ", \"rows_per_rank\": " << p.rows_per_rank
     << ", \"chosen\": \"" << p.chosen << "\", \"old_gemms\": " << p.old_gemms
     << ", \"fused\": " << (p.fused ? "true" : "false") << ", \"panel_budget\": " << p.panel_budget
     << ", \"budget_source\": \"" << p.budget_source << "\", ";
  if (o.loss() == "maxsim") {
    os << "\"query_tokens\": " << o.query_tokens() << ", \"document_tokens\": " << o.document_tokens()
       << ", \"token_panel_bytes\": " << o.token_panel_bytes() << ", ";
  }
  os << "\"matryoshka_dims\": [";
  const auto prefixes = detail::matryoshka_prefixes(o.matryoshka(), o.width());
  for (size_t i = 0; i < prefixes.size(); ++i) os << (i ? ", " : "") << prefixes[i].dim;
  os << "], \"paths\": [";
  for (size_t i = 0; i < p.paths.size(); ++i) {
    const auto& c = p.paths[i];
    os << (i ? ", " : "") << "{\"path\": \"" << c.path << "\", \"available\": " << (c.available ? "true" : "false")
       << ", \"logits_bytes\": " << c.logits_bytes << ", \"feature_bytes\": " << c.feature_bytes
       << ", \"gemms\": " << c.gemms << ", \"gemm_flops\": " << std::setprecision(17) << c.gemm_flops
       << ", \"bytes_sent_forward\": " << c.bytes_sent_forward << ", \"bytes_sent_backward\": " << c.bytes_sent_backward
       << ", \"panels\": " << c.panels << ", \"panel_rows\": " << c.panel_rows << ", \"panel_cols\": " << c.panel_cols
       << ", \"workspace_bytes\": " << c.workspace_bytes << ", \"launches\": " << c.launches << "}";
  }
  os << "]}";
  return os.str();
}

}  // namespace contrax
