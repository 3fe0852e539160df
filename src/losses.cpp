// Front ends of the contrastive losses (CLIP/InfoNCE, NT-Xent, MoCo v3) and the
// momentum-encoder helpers.
//
// Each loss validates its arguments locally, shares the verdict with every
// rank while exchanging row counts (so one rank's bad input is an error on all
// ranks, not a hang), chooses the memory path from those counts (so every rank
// chooses the same), gathers what it needs in one collective and hands over to
// the engine (contrax/detail/engine.h), which returns L_r = (W/B) * sum_{i in r}
// l_i so that data-parallel gradient averaging gives the exact global-batch
// gradient. fp16/bf16 features are computed in fp32 (the loss comes back fp32).
#include "contrax/losses.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "contrax/collectives.h"
#include "contrax/detail/check.h"
#include "contrax/detail/engine.h"
#include "contrax/grouped.h"
#include "contrax/tiled.h"

namespace contrax {

namespace {

int64_t world_of(const CommunicatorPtr& comm) { return comm ? comm->world_size() : 1; }

torch::Tensor maybe_normalize(const torch::Tensor& x, bool normalize) {
  return normalize ? detail::safe_normalize(x) : x;
}

// Gathers `local` (with or without gradient) and checks that every rank agrees
// on the arguments first. Returns the gathered rows, counts and offset.
// `checked` is the user's argument named `arg` (what error messages describe);
// `local` is what is gathered (e.g. both towers side by side), same rows.
std::vector<int64_t> exchange_checked(const torch::Tensor& checked, const CommunicatorPtr& comm, const char* caller,
                                      const char* arg, const std::string& local_error) {
  auto counts = detail::exchange_row_counts(checked, comm, caller, arg, local_error);
  int64_t total = 0;
  for (auto c : counts) total += c;
  TORCH_CHECK(total > 0, caller, "(): the global batch is empty (every rank passed 0 rows)");
  return counts;
}

Gathered gather_checked(const std::vector<int64_t>& counts, const torch::Tensor& local, const CommunicatorPtr& comm,
                        bool with_grad) {
  // The counts are now known to be consistent; the gathers below re-check
  // only in debug-worthy cases, so skip their exchange by using the raw path.
  Gathered g;
  g.counts = counts;
  const int64_t W = world_of(comm);
  if (W == 1) {
    g.all = with_grad ? local : local.detach();
    return g;
  }
  for (int64_t s = 0; s < comm->rank(); ++s) g.offset += counts[s];
  if (with_grad) {
    g.all = detail::gather_rows_with_grad(local, comm, counts);
  } else {
    torch::NoGradGuard no_grad;
    g.all = comm->all_gather_rows(local.detach(), counts, "all_gather_no_grad");
  }
  return g;
}

// Decides, identically on every rank (from the exchanged counts), whether to
// take the tiled path. `blocks` is how many [b x B] logits blocks the
// materialised loss keeps alive (2 for two directions or two views).
template <typename Options>
bool use_tiled(const Options& o, const std::vector<int64_t>& counts, int64_t element_size, int64_t blocks) {
  int64_t B = 0, bmax = 0;
  for (auto c : counts) {
    B += c;
    bmax = std::max(bmax, c);
  }
  return detail::route_tiled(o.path(), o.tile_size(), o.ring(), bmax * B * element_size * blocks,
                             o.max_logits_bytes());
}

template <typename Options>
TiledOptions tiled_of(const Options& o) {
  return TiledOptions().tile_size(std::max<int64_t>(o.tile_size(), 0)).tile_bytes(o.tile_bytes()).ring(o.ring());
}

// The memory-path options every InfoNCE-family loss shares; "" when valid.
template <typename Options>
std::string check_path_options(const Options& o, const char* caller) {
  if (o.tile_size() < -1) {
    return c10::str(caller,
                    "(): argument 'tile_size' must be >= 0 (the tile side; 0 chooses it from tile_bytes), but got ",
                    o.tile_size());
  }
  if (o.tile_bytes() <= 0)
    return c10::str(caller, "(): argument 'tile_bytes' must be positive, but got ", o.tile_bytes());
  if (o.max_logits_bytes() <= 0) {
    return c10::str(caller, "(): argument 'max_logits_bytes' must be positive, but got ", o.max_logits_bytes());
  }
  const bool materialised = o.path() == MemoryPath::kMaterialised || o.tile_size() == -1;
  if (o.tile_size() == -1 && o.path() == MemoryPath::kTiled) {
    return c10::str(caller,
                    "(): 'tile_size' -1 (the deprecated spelling of path kMaterialised) contradicts path kTiled");
  }
  if (o.ring() && materialised) {
    return c10::str(caller, "(): 'ring' needs the tiled path, but the path is materialised (",
                    o.tile_size() == -1 ? "'tile_size' is -1" : "'path' is kMaterialised", ")");
  }
  if (o.tile_size() == -1) {
    TORCH_WARN_ONCE(caller,
                    "(): tile_size(-1) is deprecated and will be removed in the next release; use "
                    "path(contrax::MemoryPath::kMaterialised) (tile_size is the tile side on the tiled path)");
  }
  return "";
}

// `labels` must be an int64 vector of `rows` entries on `device` (name: `arg`).
void check_labels(detail::ArgChecker& check, const torch::Tensor& labels, const char* arg, int64_t rows,
                  const torch::Device& device) {
  if (!labels.defined()) return;
  check.require(labels.scalar_type() == torch::kLong, "argument '", arg, "' must be an int64 tensor, but got dtype ",
                labels.scalar_type());
  check.require(labels.dim() == 1 && labels.size(0) == rows, "argument '", arg, "' must have shape [", rows,
                "] (one label per row on this rank), but got ", labels.sizes());
  check.require(labels.device() == device, "argument '", arg, "' must be on the features' device (", device,
                "), but got ", labels.device());
}

// The commonest porting mistake: open_clip and Inf-CL pass the scale itself
// (1/0.07 = 14.3, or 100) where Contrax takes its log. Reading the value needs a
// host sync, so parameters off the CPU are looked at only in the first calls of
// a process (the mistake is made once, at construction, and shows at once).
void warn_if_scale_not_log(const torch::Tensor& logit_scale, double max_logit_scale) {
  static std::atomic<int64_t> device_checks{0};
  if (!logit_scale.defined() || logit_scale.dim() != 0 || !c10::isFloatingType(logit_scale.scalar_type())) return;
  if (!logit_scale.device().is_cpu() && device_checks.fetch_add(1) >= 16) return;
  const double v = logit_scale.detach().item<double>();
  if (!(v > std::log(max_logit_scale) + 1.0)) return;
  TORCH_WARN_ONCE("logit_scale=", v, " is the log of the scale (Contrax clamps exp(logit_scale) at ", max_logit_scale,
                  "): pass log(1/0.07)=2.66, not 1/0.07=14.3 as open_clip/Inf-CL do");
}

// Every rank's labels in rank order (`counts` rows each); `local` undefined: undefined.
torch::Tensor gather_labels(const torch::Tensor& local, const CommunicatorPtr& comm,
                            const std::vector<int64_t>& counts) {
  if (!local.defined() || world_of(comm) == 1) return local;
  return comm->all_gather_rows(local.contiguous(), counts, "labels_all_gather");
}

std::vector<int64_t> scaled(std::vector<int64_t> counts, int64_t g) {
  for (auto& c : counts) c *= g;
  return counts;
}

// kSum = B times kMean for the losses that reduce by scaling (NT-Xent, MoCo v3).
torch::Tensor sum_from_mean(const torch::Tensor& mean_form, const std::vector<int64_t>& counts) {
  int64_t B = 0;
  for (auto c : counts) B += c;
  return mean_form * static_cast<double>(B);
}

}  // namespace

// ---------------------------------------------------------------------------

namespace {

// Path-option checks of the forced tiled entry points (tiled_*_loss).
void check_tiled(detail::ArgChecker& check, const TiledOptions& tiled) {
  check.require(tiled.tile_size() >= 0, "argument 'tile_size' must be >= 0 (0 = automatic), but got ",
                tiled.tile_size());
  check.require(tiled.tile_bytes() > 0, "argument 'tile_bytes' must be positive, but got ", tiled.tile_bytes());
}

// Each loss has one implementation; `forced` is the tiled entry point's
// TiledOptions (tiled path, whatever the size), null for the automatic front end.
template <typename Options>
std::string path_error(const detail::ArgChecker& check_in, const Options& options, const TiledOptions* forced,
                       const char* caller) {
  if (!check_in.error().empty()) return check_in.error();
  if (!forced) return check_path_options(options, caller);
  detail::ArgChecker check(caller);
  check_tiled(check, *forced);
  return check.error();
}

torch::Tensor clip_impl(const char* caller, const torch::Tensor& a, const torch::Tensor& b,
                        const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                        const ClipLossOptions& options, const TiledOptions* forced) {
  detail::ArgChecker check(caller);
  check.paired_features(a, "a", b, "b");
  check.scalar(logit_scale, "logit_scale");
  if (logit_bias.has_value()) check.scalar(*logit_bias, "logit_bias");
  check.positive(options.max_logit_scale(), "max_logit_scale");
  if (check.error().empty()) check_labels(check, options.labels(), "labels", a.size(0), a.device());
  check.require(options.labels().defined() || options.label_mode() == LabelMode::kMultiPositive,
                "argument 'label_mode' (kMaskDuplicates) needs 'labels'");
  const std::string error = path_error(check, options, forced, caller);
  if (error.empty()) warn_if_scale_not_log(logit_scale, options.max_logit_scale());

  const auto& comm = options.comm();
  auto counts = exchange_checked(options.symmetric() ? a : b, comm, caller, options.symmetric() ? "a" : "b", error);
  const auto ct = detail::compute_dtype(a.scalar_type());  // fp16/bf16: fp32
  // One [b x B] buffer whichever the direction (see contrax/detail/engine.h).
  const bool tiled = forced || use_tiled(options, counts, c10::elementSize(ct), detail::logits_blocks("clip"));
  const TiledOptions t = forced ? *forced : tiled_of(options);
  auto a_n = maybe_normalize(a.to(ct), options.normalize());  // [b, d]
  auto b_n = maybe_normalize(b.to(ct), options.normalize());  // [b, d]
  auto scale = detail::clamped_scale(logit_scale, options.max_logit_scale()).to(ct);
  torch::Tensor bias;
  if (logit_bias.has_value()) bias = logit_bias->to(ct);
  auto layout = detail::make_layout(comm, counts);
  const int64_t tile = detail::tile_side(t.tile_size(), t.tile_bytes(), c10::elementSize(ct));
  detail::BlockSpec spec;
  spec.symmetric = options.symmetric();
  spec.reduction = options.reduction();
  spec.label_mode = options.label_mode();
  if (options.labels().defined()) {
    spec.row_labels = options.labels();
    spec.col_labels = gather_labels(options.labels(), comm, counts);  // [B]
  }
  if (tiled && t.ring() && layout.world > 1) {
    return detail::tiled_clip_block_loss(a_n, b_n, scale, bias, layout, spec, tile, /*ring=*/true);
  }
  // Only the text tower is gathered (with gradient: its backward reduce-scatters
  // dB_all to the owners); the image-to-text direction is the column softmax of
  // the same block.
  auto b_all = gather_checked(counts, b_n, comm, /*with_grad=*/true).all;  // [B, d]
  if (tiled) return detail::tiled_clip_block_loss(a_n, b_all, scale, bias, layout, spec, tile, false);
  return detail::clip_block_loss(a_n, b_all, scale, bias, layout, spec);
}

torch::Tensor grouped_impl(const char* caller, const torch::Tensor& queries, const torch::Tensor& candidates,
                           const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                           const GroupedLossOptions& options) {
  detail::ArgChecker check(caller);
  check.features(queries, "queries").features(candidates, "candidates");
  int64_t g = 0;  // candidates per query; 0 on a rank with no queries (any g fits)
  if (check.error().empty()) {
    const int64_t b = queries.size(0), n = candidates.size(0);
    check.require(queries.size(1) == candidates.size(1),
                  "arguments 'queries' and 'candidates' must have the same width, but got ", queries.size(1), " and ",
                  candidates.size(1));
    check.require(queries.scalar_type() == candidates.scalar_type(),
                  "arguments 'queries' and 'candidates' must have the same dtype, but got ", queries.scalar_type(),
                  " and ", candidates.scalar_type());
    check.require(queries.device() == candidates.device(),
                  "arguments 'queries' and 'candidates' must be on the same device, but got ", queries.device(),
                  " and ", candidates.device());
    if (b > 0) {
      check.require(n >= b && n % b == 0, "argument 'candidates' must have g * queries.size(0) rows (g >= 1 per ",
                    "query: its positive, then g-1 hard negatives), but got ", n, " rows for ", b, " queries");
      if (n >= b && n % b == 0) g = n / b;
    } else {
      check.require(n == 0, "argument 'candidates' must be empty on a rank with no queries, but got ", n, " rows");
    }
  }
  check.scalar(logit_scale, "logit_scale");
  if (logit_bias.has_value()) check.scalar(*logit_bias, "logit_bias");
  check.positive(options.max_logit_scale(), "max_logit_scale");
  if (check.error().empty()) {
    check_labels(check, options.labels(), "labels", queries.size(0), queries.device());
    check_labels(check, options.candidate_labels(), "candidate_labels", candidates.size(0), queries.device());
  }
  check.require(!options.candidate_labels().defined() || options.labels().defined(),
                "argument 'candidate_labels' needs 'labels' (the id of each query's positive)");
  check.require(!options.labels().defined() || options.candidate_labels().defined() || g <= 1,
                "argument 'labels' needs 'candidate_labels' when there are hard negatives (g = ", g,
                " candidates per query): the id of every candidate");
  check.require(options.labels().defined() || options.label_mode() == LabelMode::kMaskDuplicates,
                "argument 'label_mode' (kMultiPositive) needs 'labels'");
  const std::string error = path_error(check, options, nullptr, caller);
  if (error.empty()) warn_if_scale_not_log(logit_scale, options.max_logit_scale());

  const auto& comm = options.comm();
  std::vector<int64_t> gs;
  auto counts = detail::exchange_row_counts(queries, comm, caller, "queries", error, g, &gs);
  int64_t total = 0;
  g = 0;  // the first non-empty rank's g, the same on every rank (and known to an empty one)
  for (size_t s = 0; s < counts.size(); ++s) {
    total += counts[s];
    if (gs[s] > 0 && g == 0) g = gs[s];
  }
  TORCH_CHECK(total > 0, caller, "(): the global batch is empty (every rank passed 0 queries)");
  for (size_t s = 0; s < gs.size(); ++s) {
    TORCH_CHECK(gs[s] == 0 || gs[s] == g, caller,
                "(): argument 'candidates' must hold the same number of candidates per query (g) on every rank, ",
                "but g is ", gs[s], " on rank ", s, " and ", g, " on rank ",
                std::find(gs.begin(), gs.end(), g) - gs.begin());
  }
  const auto ct = detail::compute_dtype(queries.scalar_type());
  // One [b x B g] buffer: g [b x B] blocks.
  const bool tiled = use_tiled(options, counts, c10::elementSize(ct), g);
  auto q_n = maybe_normalize(queries.to(ct), options.normalize());     // [b, d]
  auto c_n = maybe_normalize(candidates.to(ct), options.normalize());  // [b g, d]
  auto scale = detail::clamped_scale(logit_scale, options.max_logit_scale()).to(ct);
  torch::Tensor bias;
  if (logit_bias.has_value()) bias = logit_bias->to(ct);
  auto layout = detail::make_layout(comm, counts);
  const auto key_counts = scaled(counts, g);
  const int64_t tile =
      detail::tile_side(std::max<int64_t>(options.tile_size(), 0), options.tile_bytes(), c10::elementSize(ct));
  detail::BlockSpec spec;
  spec.group = g;
  spec.reduction = options.reduction();
  spec.label_mode = options.label_mode();
  if (options.labels().defined()) {
    spec.row_labels = options.labels();
    auto cl = options.candidate_labels().defined() ? options.candidate_labels() : options.labels();  // g == 1
    spec.col_labels = gather_labels(cl, comm, key_counts);                                           // [B g]
  }
  if (tiled && options.ring() && layout.world > 1) {
    return detail::tiled_clip_block_loss(q_n, c_n, scale, bias, layout, spec, tile, /*ring=*/true);
  }
  auto c_all = gather_checked(key_counts, c_n, comm, /*with_grad=*/true).all;  // [B g, d]
  if (tiled) return detail::tiled_clip_block_loss(q_n, c_all, scale, bias, layout, spec, tile, false);
  return detail::clip_block_loss(q_n, c_all, scale, bias, layout, spec);
}

torch::Tensor nt_xent_impl(const char* caller, const torch::Tensor& z1, const torch::Tensor& z2,
                           const NTXentLossOptions& options, const TiledOptions* forced) {
  detail::ArgChecker check(caller);
  check.features(z1, "z1").features(z2, "z2");
  if (check.error().empty()) check.same_as(z2, "z2", z1, "z1");
  check.positive(options.temperature(), "temperature");
  const std::string error = path_error(check, options, forced, caller);
  const auto& comm = options.comm();
  auto counts = exchange_checked(z1, comm, caller, "z1", error);
  // kSum = B times the mean form (the per-example loss is the mean of its two views').
  auto reduce = [&](const torch::Tensor& mean_form) {
    return options.reduction() == Reduction::kSum ? sum_from_mean(mean_form, counts) : mean_form;
  };
  const auto ct = detail::compute_dtype(z1.scalar_type());
  // One [2b x 2B] buffer: four [b x B] blocks.
  const bool tiled = forced || use_tiled(options, counts, c10::elementSize(ct), detail::logits_blocks("nt_xent"));
  const TiledOptions t = forced ? *forced : tiled_of(options);
  auto z1n = maybe_normalize(z1.to(ct), options.normalize());  // [b, d]
  auto z2n = maybe_normalize(z2.to(ct), options.normalize());  // [b, d]
  auto layout = detail::make_layout(comm, counts);
  const int64_t tile = detail::tile_side(t.tile_size(), t.tile_bytes(), c10::elementSize(ct));
  // kSum is kMean scaled (reduce); kNone is the engine's.
  const auto r = options.reduction() == Reduction::kNone ? Reduction::kNone : Reduction::kMean;
  auto z = torch::cat({z1n, z2n}, 0);  // [2b, d]
  if (tiled && t.ring() && layout.world > 1) {
    return reduce(
        detail::tiled_nt_xent_block_loss(z, torch::Tensor(), 1.0 / options.temperature(), layout, tile, r, true));
  }
  const int64_t d = z1.size(1);
  // Z is gathered once, without gradient: the engine's backward needs no
  // collective (each rank's gradient for its own rows is complete).
  torch::Tensor z_all = z.detach();  // [2B, d] = [z1_all; z2_all]
  if (layout.world > 1) {
    auto all = gather_checked(counts, torch::cat({z1n, z2n}, 1), comm, /*with_grad=*/false).all;  // [B, 2d]
    z_all = torch::cat({all.narrow(1, 0, d), all.narrow(1, d, d)}, 0);
  }
  if (tiled) return reduce(detail::tiled_nt_xent_block_loss(z, z_all, 1.0 / options.temperature(), layout, tile, r));
  return reduce(detail::nt_xent_block_loss(z, z_all, 1.0 / options.temperature(), layout, r, options.normalize()));
}

torch::Tensor moco_impl(const char* caller, const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                        const torch::Tensor& k2, const MocoV3LossOptions& options, const TiledOptions* forced) {
  detail::ArgChecker check(caller);
  check.features(q1, "q1").features(q2, "q2").features(k1, "k1").features(k2, "k2");
  if (check.error().empty()) {
    check.same_as(q2, "q2", q1, "q1").same_as(k1, "k1", q1, "q1").same_as(k2, "k2", q1, "q1");
  }
  check.positive(options.temperature(), "temperature");
  const std::string error = path_error(check, options, forced, caller);
  const auto& comm = options.comm();
  const double T = options.temperature();
  auto counts = exchange_checked(k1, comm, caller, "k1", error);
  const auto ct = detail::compute_dtype(q1.scalar_type());
  // Two [b x B] buffers: the two directions have different keys.
  const bool tiled = forced || use_tiled(options, counts, c10::elementSize(ct), detail::logits_blocks("moco_v3"));
  const TiledOptions t = forced ? *forced : tiled_of(options);
  auto layout = detail::make_layout(comm, counts);
  const int64_t tile = detail::tile_side(t.tile_size(), t.tile_bytes(), c10::elementSize(ct));

  // Keys come from the momentum encoder: constants for this loss, so they are
  // gathered (or passed around the ring) without gradient.
  torch::Tensor k1n, k2n;
  {
    torch::NoGradGuard no_grad;
    k1n = maybe_normalize(k1.detach().to(ct), options.normalize());
    k2n = maybe_normalize(k2.detach().to(ct), options.normalize());
  }
  auto inv_t = torch::scalar_tensor(1.0 / T, torch::TensorOptions().dtype(ct).device(q1.device()));
  auto q1n = maybe_normalize(q1.to(ct), options.normalize());
  auto q2n = maybe_normalize(q2.to(ct), options.normalize());
  const bool ring = tiled && t.ring() && layout.world > 1;
  torch::Tensor k1_keys = k1n, k2_keys = k2n;  // own blocks (ring) or all keys
  if (!ring) {
    auto g = gather_checked(counts, torch::cat({k1n, k2n}, 1), comm, /*with_grad=*/false);
    const int64_t d = q1.size(1);
    k1_keys = g.all.narrow(1, 0, d);  // [B, d]
    k2_keys = g.all.narrow(1, d, d);  // [B, d]
  }
  detail::BlockSpec spec;  // one direction, no labels
  spec.reduction = options.reduction();
  auto ctr = [&](const torch::Tensor& q, const torch::Tensor& k) {
    if (tiled) return detail::tiled_clip_block_loss(q, k, inv_t, torch::Tensor(), layout, spec, tile, ring);
    return detail::clip_block_loss(q, k, inv_t, torch::Tensor(), layout, spec);
  };
  return (ctr(q1n, k2_keys) + ctr(q2n, k1_keys)) * (2.0 * T);
}

}  // namespace

torch::Tensor clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias, const ClipLossOptions& options) {
  return clip_impl("clip_loss", a, b, logit_scale, logit_bias, options, nullptr);
}

torch::Tensor tiled_clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                              const c10::optional<torch::Tensor>& logit_bias, const ClipLossOptions& options,
                              const TiledOptions& tiled) {
  return clip_impl("tiled_clip_loss", a, b, logit_scale, logit_bias, options, &tiled);
}

torch::Tensor grouped_loss(const torch::Tensor& queries, const torch::Tensor& candidates,
                           const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                           const GroupedLossOptions& options) {
  return grouped_impl("grouped_loss", queries, candidates, logit_scale, logit_bias, options);
}

torch::Tensor nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, const NTXentLossOptions& options) {
  return nt_xent_impl("nt_xent_loss", z1, z2, options, nullptr);
}

torch::Tensor tiled_nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, const NTXentLossOptions& options,
                                 const TiledOptions& tiled) {
  return nt_xent_impl("tiled_nt_xent_loss", z1, z2, options, &tiled);
}

torch::Tensor moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                           const torch::Tensor& k2, const MocoV3LossOptions& options) {
  return moco_impl("moco_v3_loss", q1, q2, k1, k2, options, nullptr);
}

torch::Tensor tiled_moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                                 const torch::Tensor& k2, const MocoV3LossOptions& options, const TiledOptions& tiled) {
  return moco_impl("tiled_moco_v3_loss", q1, q2, k1, k2, options, &tiled);
}

// ---------------------------------------------------------------------------

void momentum_update(torch::nn::Module& target, const torch::nn::Module& online, double momentum) {
  TORCH_CHECK(momentum >= 0.0 && momentum <= 1.0, "momentum_update(): argument 'momentum' must be in [0, 1], but got ",
              momentum);
  auto tp = target.named_parameters(/*recurse=*/true);
  auto op = online.named_parameters(/*recurse=*/true);
  TORCH_CHECK(tp.size() == op.size(), "momentum_update(): arguments 'target' and 'online' must have the same ",
              "parameters, but target has ", tp.size(), " and online has ", op.size());
  torch::NoGradGuard no_grad;
  for (const auto& item : op) {
    auto* t = tp.find(item.key());
    TORCH_CHECK(t != nullptr, "momentum_update(): parameter '", item.key(), "' of 'online' is missing in 'target'");
    TORCH_CHECK(t->sizes() == item.value().sizes(), "momentum_update(): parameter '", item.key(), "' has shape ",
                t->sizes(), " in 'target' but ", item.value().sizes(), " in 'online'");
    t->mul_(momentum).add_(item.value(), 1.0 - momentum);
  }
}

double momentum_schedule(double base, int64_t step, int64_t total_steps) {
  TORCH_CHECK(base >= 0.0 && base <= 1.0, "momentum_schedule(): argument 'base' must be in [0, 1], but got ", base);
  TORCH_CHECK(total_steps > 0, "momentum_schedule(): argument 'total_steps' must be positive, but got ", total_steps);
  const double t = std::min<double>(std::max<int64_t>(step, 0), total_steps) / static_cast<double>(total_steps);
  return 1.0 - (1.0 - base) * (std::cos(M_PI * t) + 1.0) * 0.5;
}

// ---------------------------------------------------------------------------

ClipLossImpl::ClipLossImpl(ClipLossOptions options_, double init_scale, bool with_bias) : options(std::move(options_)) {
  TORCH_CHECK(init_scale > 0.0, "ClipLoss(): argument 'init_scale' must be positive, but got ", init_scale);
  logit_scale = register_parameter("logit_scale", torch::tensor(std::log(init_scale)));
  if (with_bias) logit_bias = register_parameter("logit_bias", torch::tensor(0.0));
}

torch::Tensor ClipLossImpl::forward(const torch::Tensor& a, const torch::Tensor& b) {
  auto scale = logit_scale.to(a.scalar_type());
  c10::optional<torch::Tensor> bias;
  if (logit_bias.defined()) bias = logit_bias.to(a.scalar_type());
  return clip_loss(a, b, scale, bias, options);
}

torch::Tensor NTXentLossImpl::forward(const torch::Tensor& z1, const torch::Tensor& z2) {
  return nt_xent_loss(z1, z2, options);
}

torch::Tensor MocoV3LossImpl::forward(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                                      const torch::Tensor& k2) {
  return moco_v3_loss(q1, q2, k1, k2, options);
}

}  // namespace contrax
