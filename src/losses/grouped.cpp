// The grouped-candidates loss (DPR / Tevatron; see contrax/losses/grouped.h): its
// argument checks, the shared prologue with g riding along the row-count
// exchange, and the engine's one-directional block over every rank's
// candidates.
#include "contrax/losses/grouped.h"

#include <algorithm>

#include "engine/engine.h"
#include "engine/scorer.h"

namespace contrax {

namespace {

// Local checks of the arguments; `g` becomes this rank's candidates per query
// (0 on a rank with no queries: any g fits).
void check_grouped(detail::ArgChecker& check, const torch::Tensor& queries, const torch::Tensor& candidates,
                   const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                   const GroupedLossOptions& options, int64_t& g) {
  check.features(queries, "queries").features(candidates, "candidates");
  if (check.error().empty()) {
    const int64_t b = queries.size(0), n = candidates.size(0);
    check.same_kind(queries, "queries", candidates, "candidates");
    if (check.error().empty()) g = check.rows_per_query(b, n, "candidates");
  }
  check.scalar(logit_scale, "logit_scale");
  if (logit_bias.has_value()) check.scalar(*logit_bias, "logit_bias");
  check.positive(options.max_logit_scale(), "max_logit_scale");
  if (check.error().empty()) {
    detail::check_labels(check, options.labels(), "labels", queries.size(0), queries.device());
    detail::check_labels(check, options.candidate_labels(), "candidate_labels", candidates.size(0),
                         queries.device());
  }
  check.require(!options.candidate_labels().defined() || options.labels().defined(),
                "argument 'candidate_labels' needs 'labels' (the id of each query's positive)");
  check.require(!options.labels().defined() || options.candidate_labels().defined() || g <= 1,
                "argument 'labels' needs 'candidate_labels' when there are hard negatives (g = ", g,
                " candidates per query): the id of every candidate");
  check.require(options.labels().defined() || options.label_mode() == LabelMode::kMaskDuplicates,
                "argument 'label_mode' (kMultiPositive) needs 'labels'");
  detail::check_memory_path(check, options.memory());
  if (check.error().empty()) detail::check_matryoshka(check, options.matryoshka(), queries.size(1));
}

// The candidates per query every rank agrees on: the first non-empty rank's g,
// which every other non-empty rank must have too.
int64_t agreed_group(const char* caller, const std::vector<int64_t>& gs) {
  int64_t g = 0;
  for (auto x : gs) {
    if (x > 0 && g == 0) g = x;
  }
  for (size_t s = 0; s < gs.size(); ++s) {
    TORCH_CHECK(gs[s] == 0 || gs[s] == g, caller,
                "(): argument 'candidates' must hold the same number of candidates per query (g) on every rank, ",
                "but g is ", gs[s], " on rank ", s, " and ", g, " on rank ",
                std::find(gs.begin(), gs.end(), g) - gs.begin());
  }
  return g;
}

}  // namespace

torch::Tensor grouped_loss(const torch::Tensor& queries, const torch::Tensor& candidates,
                           const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                           const GroupedLossOptions& options) {
  detail::NoAutocast no_autocast;
  const char* caller = "grouped_loss";
  detail::ArgChecker check(caller);
  int64_t g = 0;
  check_grouped(check, queries, candidates, logit_scale, logit_bias, options, g);
  if (check.error().empty()) detail::warn_if_scale_not_log(logit_scale, options.max_logit_scale());

  const auto& comm = options.comm();
  std::vector<int64_t> gs;
  auto counts = detail::agree_on_rows(caller, queries, "queries", comm, check.error(), "queries", g, &gs);
  g = agreed_group(caller, gs);
  // One [b x B g] buffer: g [b x B] blocks, per prefix.
  const detail::Scorer scorer(options.matryoshka(), queries, /*shared=*/true);
  const bool normalize = scorer.normalize_whole(options.normalize());
  const auto p = detail::make_prologue(caller, comm, counts, queries, options.memory(), g * scorer.blocks());
  auto q_n = detail::prepare(queries, p, normalize);     // [b, d]
  auto c_n = detail::prepare(candidates, p, normalize);  // [b g, d]
  auto scale = detail::clamped_scale(logit_scale, options.max_logit_scale()).to(p.dtype);
  const auto bias = logit_bias.has_value() ? logit_bias->to(p.dtype) : torch::Tensor();
  const auto key_counts = p.layout.key_counts(g);
  detail::BlockSpec spec;
  spec.group = g;
  spec.reduction = options.reduction();
  spec.label_mode = options.label_mode();
  if (options.labels().defined()) {
    spec.row_labels = options.labels();
    auto cl = options.candidate_labels().defined() ? options.candidate_labels() : options.labels();  // g == 1
    spec.col_labels = detail::gather_labels(cl, comm, key_counts);                                   // [B g]
  }
  auto keys = p.ring ? c_n : detail::gather_rows(c_n, comm, key_counts, /*with_grad=*/true);  // [B g, d]
  return scorer.clip_loss(p, q_n, keys, scale, bias, spec);
}

}  // namespace contrax
