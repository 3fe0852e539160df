// The late-interaction front end (contrax/losses/maxsim.h): it checks its
// arguments, agrees on rows, documents per query and the longest document
// across ranks, pads its documents to the longest, and takes the memory path
// the prologue chose: materialised, it gathers every rank's documents (with
// gradient), scores this rank's queries against them by MaxSim in bounded
// panels (engine/maxsim.h) and hands the [b x B g] scores to the engine's
// InfoNCE on a score block (engine/score_block.h); tiled or ring, the
// engine's tiled block walks them with MaxSim as its scorer
// (engine/maxsim_tiles.h).
#include "contrax/losses/maxsim.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/maxsim.h"
#include "engine/maxsim_tiles.h"
#include "engine/score_block.h"

namespace contrax {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The bool [rows, L] mask `name`, or all valid when undefined.
torch::Tensor mask_or_all(detail::ArgChecker& check, const torch::Tensor& mask, const char* name,
                          const torch::Tensor& tokens, const char* what, bool every_row_valid = true) {
  if (!check.error().empty()) return {};
  if (!mask.defined()) return torch::ones({tokens.size(0), tokens.size(1)}, tokens.options().dtype(torch::kBool));
  check.require(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.size(0) == tokens.size(0) &&
                    mask.size(1) == tokens.size(1),
                "argument '", name, "' must be a bool tensor [", tokens.size(0), ", ", tokens.size(1), "] (one entry ",
                "per token of '", what, "'), but got ", mask.scalar_type(), " ", mask.sizes());
  if (!check.error().empty()) return {};
  check.require(mask.device() == tokens.device(), "argument '", name, "' must be on ", tokens.device(),
                ", but got ", mask.device());
  if (!every_row_valid) return mask;
  const auto empty_rows = mask.any(1).logical_not().nonzero().view(-1);
  check.require(empty_rows.numel() == 0, "argument '", name, "' must leave every row of '", what,
                "' at least one valid token, but row ", empty_rows.numel() ? empty_rows[0].item<int64_t>() : 0,
                " has none");
  return mask;
}

void check_tokens(detail::ArgChecker& check, const torch::Tensor& t, const char* name) {
  if (!check.error().empty()) return;
  check.require(t.defined() && t.dim() == 3, "argument '", name, "' must be a 3-D tensor [rows, tokens, width], ",
                "but got ", t.defined() ? c10::str("shape ", t.sizes()) : std::string("an undefined tensor"));
  if (!check.error().empty()) return;
  check.require(c10::isFloatingType(t.scalar_type()), "argument '", name,
                "' must be a floating-point tensor, but got dtype ", t.scalar_type());
  check.require(t.size(1) >= 1, "argument '", name, "' must have at least one token per row, but got ", t.sizes());
}

// The materialised route: every rank's documents `d` [rows, Ld, width] (Ld
// the longest of any rank's), their masks and floors gathered (the documents
// with gradient), this rank's queries scored against them by MaxSim in
// bounded panels, and InfoNCE over the [b x B g] scores.
torch::Tensor gathered_maxsim_loss(const torch::Tensor& q, const torch::Tensor& weight, torch::Tensor d,
                                   torch::Tensor d_mask, torch::Tensor floor, const torch::Tensor& scale,
                                   const detail::Prologue& p, const detail::BlockSpec& spec,
                                   const MaxSimLossOptions& options) {
  const auto& comm = options.comm();
  if (p.layout.world > 1) {
    const auto key_counts = p.layout.key_counts(spec.group);
    const int64_t longest = d.size(1), width = d.size(2);
    d = detail::gather_rows(d.reshape({d.size(0), longest * width}), comm, key_counts, /*with_grad=*/true)
            .view({-1, longest, width});  // [B g, Ld, d]
    d_mask = detail::gather_rows(d_mask.to(torch::kUInt8), comm, key_counts, /*with_grad=*/false).to(torch::kBool);
    if (floor.defined()) floor = detail::gather_rows(floor.unsqueeze(1), comm, key_counts, false).squeeze(1);
  }
  auto scores = detail::maxsim_scores(q, weight, d, d_mask, floor, options.panel_bytes(), p.layout);  // [b, B g]
  return detail::score_block_loss(scores * scale, p, spec);
}

}  // namespace

torch::Tensor maxsim_loss(const torch::Tensor& queries, const torch::Tensor& documents,
                          const c10::optional<torch::Tensor>& logit_scale, const MaxSimLossOptions& options) {
  detail::NoAutocast no_autocast;
  const char* caller = "maxsim_loss";
  detail::ArgChecker check(caller);
  check_tokens(check, queries, "queries");
  check_tokens(check, documents, "documents");
  int64_t g = 0;
  if (check.error().empty()) {
    const int64_t b = queries.size(0), n = documents.size(0);
    check.same_kind(queries, "queries", documents, "documents");
    if (check.error().empty()) g = check.rows_per_query(b, n, "documents");
  }
  auto q_mask = mask_or_all(check, options.query_mask(), "query_mask", queries, "queries");
  // A document of padding alone scores padding_score for every query token:
  // only -inf needs a valid token in every document.
  auto d_mask = mask_or_all(check, options.document_mask(), "document_mask", documents, "documents",
                            std::isinf(options.padding_score()));
  check.require(!std::isnan(options.padding_score()) && options.padding_score() < kInf,
                "argument 'padding_score' must be -inf or a finite number, but got ", options.padding_score());
  if (logit_scale.has_value()) check.scalar(*logit_scale, "logit_scale");
  check.positive(options.temperature(), "temperature");
  check.positive(options.max_logit_scale(), "max_logit_scale");
  check.require(options.panel_bytes() > 0, "argument 'panel_bytes' must be positive, but got ",
                options.panel_bytes());
  detail::check_memory_path(check, options.memory());
  check.require(!options.symmetric() || g <= 1, "argument 'symmetric' needs one document per query, but got g = ", g,
                " (hard negatives have no query of their own)");

  // Rows, then documents per query and the longest document, agreed by every
  // rank in one exchange (g in the high half of the extra, Ld in the low).
  const auto& comm = options.comm();
  const int64_t Ld = check.error().empty() ? documents.size(1) : 0;
  std::vector<int64_t> extras;
  auto counted = check.error().empty() ? queries.select(1, 0) : torch::Tensor();
  auto counts = detail::agree_on_rows(caller, counted, "queries", comm, check.error(), "queries", (g << 32) | Ld,
                                      &extras);
  int64_t group = 0, longest = 0;
  for (size_t s = 0; s < extras.size(); ++s) {
    const int64_t gs = extras[s] >> 32;
    longest = std::max<int64_t>(longest, extras[s] & 0xffffffff);
    TORCH_CHECK(gs == 0 || group == 0 || gs == group, caller, "(): argument 'documents' must hold the same number ",
                "of documents per query (g) on every rank, but g is ", gs, " on rank ", s, " and ", group,
                " on an earlier rank");
    if (gs > 0) group = gs;
  }
  // The routing's measure: the [b x B g] scores, g blocks of [b x B].
  const auto p = detail::make_prologue(caller, comm, counts, counted, options.memory(), group);
  auto q = queries.to(p.dtype);  // MaxSim computes in the compute dtype (engine/precision.h)
  auto d = documents.to(p.dtype);
  if (Ld < longest) {  // padded with invalid tokens to the longest document of any rank
    d = torch::constant_pad_nd(d, {0, 0, 0, longest - Ld});
    d_mask = torch::constant_pad_nd(d_mask, {0, longest - Ld}, 0);
  }
  // A finite padding_score floors each query token's score against a
  // document with padding of its own (before the alignment above, whose
  // tokens never count).
  torch::Tensor floor;
  if (std::isfinite(options.padding_score())) {
    const auto own_padding = options.document_mask().defined() ? options.document_mask().logical_not().any(1)
                                                               : torch::zeros({documents.size(0)}, d_mask.options());
    floor = torch::where(own_padding, options.padding_score(), -kInf).to(p.dtype);  // [b g]
  }
  // Each query token's weight: its mask, over the query's token count with
  // normalize_scores (every query has a valid token).
  auto weight = q_mask.to(p.dtype);  // [b, Lq]
  if (options.normalize_scores()) weight = weight / weight.sum(1, /*keepdim=*/true);
  auto scale = logit_scale.has_value()
                   ? detail::clamped_scale(*logit_scale, options.max_logit_scale()).to(p.dtype)
                   : torch::scalar_tensor(1.0 / options.temperature(), q.options());
  detail::BlockSpec spec;
  spec.symmetric = options.symmetric();
  spec.group = std::max<int64_t>(group, 1);
  spec.reduction = options.reduction();
  if (p.tiled) return detail::tiled_maxsim_loss(q, weight, d, d_mask, floor, scale, p, spec, options.panel_bytes());
  return gathered_maxsim_loss(q, weight, d, d_mask, floor, scale, p, spec, options);
}

}  // namespace contrax
