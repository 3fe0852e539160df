// Textbook single-device losses, used as the ground truth for exactness checks.
// Deliberately naive: full [B x B] (or [2B x 2B]) logits and mean reductions.
#include "contrax/losses/reference.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace contrax::reference {
namespace F = torch::nn::functional;

namespace {
torch::Tensor unit(const torch::Tensor& x, bool normalize) {
  return normalize ? x / x.norm(2, 1, true).clamp_min(1e-12) : x;
}
torch::Tensor diag_labels(int64_t n, const torch::Tensor& like) {
  return torch::arange(n, torch::TensorOptions().dtype(torch::kLong).device(like.device()));
}
}  // namespace

torch::Tensor clip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias, bool symmetric, double max_scale,
                        bool normalize) {
  auto an = unit(a, normalize), bn = unit(b, normalize);
  auto logits = torch::matmul(an, bn.t()) * torch::clamp_max(torch::exp(logit_scale), max_scale);
  if (logit_bias.has_value()) logits = logits + *logit_bias;
  auto labels = diag_labels(a.size(0), a);
  auto l_ab = F::cross_entropy(logits, labels);
  if (!symmetric) return l_ab;
  return (l_ab + F::cross_entropy(logits.t(), labels)) / 2;
}

torch::Tensor nt_xent_loss(const torch::Tensor& z1, const torch::Tensor& z2, double temperature, bool normalize) {
  const int64_t B = z1.size(0);
  auto z = torch::cat({unit(z1, normalize), unit(z2, normalize)}, 0);  // [2B, d]
  auto sim = torch::matmul(z, z.t()) / temperature;                     // [2B, 2B]
  auto eye = torch::eye(2 * B, torch::TensorOptions().dtype(torch::kBool).device(z.device()));
  sim = sim.masked_fill(eye, -std::numeric_limits<double>::infinity());
  auto idx = diag_labels(2 * B, z);
  auto labels = torch::where(idx < B, idx + B, idx - B);
  return F::cross_entropy(sim, labels);
}

torch::Tensor moco_v3_loss(const torch::Tensor& q1, const torch::Tensor& q2, const torch::Tensor& k1,
                           const torch::Tensor& k2, double temperature, bool normalize) {
  auto ctr = [&](const torch::Tensor& q, const torch::Tensor& k) {
    auto logits = torch::matmul(unit(q, normalize), unit(k.detach(), normalize).t()) / temperature;
    return F::cross_entropy(logits, diag_labels(q.size(0), q)) * (2 * temperature);
  };
  return ctr(q1, k2) + ctr(q2, k1);
}

torch::Tensor siglip_loss(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                          const c10::optional<torch::Tensor>& logit_bias, bool normalize) {
  const int64_t B = a.size(0);
  auto logits = torch::matmul(unit(a, normalize), unit(b, normalize).t()) * torch::exp(logit_scale);
  if (logit_bias.has_value()) logits = logits + *logit_bias;
  auto z = 2 * torch::eye(B, logits.options()) - 1;
  return -F::logsigmoid(z * logits).sum() / B;
}

torch::Tensor info_nce_rows(const torch::Tensor& logits, const torch::Tensor& positive, const torch::Tensor& masked) {
  auto kept = masked.defined() ? logits.masked_fill(masked, -std::numeric_limits<double>::infinity()) : logits;
  auto pos_mean = torch::where(positive, logits, torch::zeros_like(logits)).sum(1) / positive.sum(1).to(logits.dtype());
  return torch::logsumexp(kept, 1) - pos_mean;
}

namespace {
// Positive set and mask of one direction from the designated positives and
// the label equality.
std::pair<torch::Tensor, torch::Tensor> label_structure(const torch::Tensor& designated, const torch::Tensor& equal,
                                                        LabelMode mode) {
  if (!equal.defined()) return {designated, torch::Tensor()};
  if (mode == LabelMode::kMultiPositive) return {designated.logical_or(equal), torch::Tensor()};
  return {designated, equal.logical_and(designated.logical_not())};
}
}  // namespace

torch::Tensor clip_rows(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& logit_scale,
                        const c10::optional<torch::Tensor>& logit_bias, bool symmetric, double max_scale,
                        bool normalize, const torch::Tensor& labels, LabelMode mode) {
  auto logits = torch::matmul(unit(a, normalize), unit(b, normalize).t()) * torch::clamp_max(torch::exp(logit_scale), max_scale);
  if (logit_bias.has_value()) logits = logits + *logit_bias;
  const int64_t B = a.size(0);
  auto eye = torch::eye(B, torch::TensorOptions().dtype(torch::kBool).device(a.device()));
  torch::Tensor equal;
  if (labels.defined()) equal = labels.unsqueeze(1) == labels.unsqueeze(0);
  auto [pos, mask] = label_structure(eye, equal, mode);
  auto rows = info_nce_rows(logits, pos, mask);
  if (!symmetric) return rows;
  auto cols = info_nce_rows(logits.t(), pos.t(), mask.defined() ? mask.t() : mask);
  return (rows + cols) / 2;
}

torch::Tensor grouped_rows(const torch::Tensor& queries, const torch::Tensor& candidates,
                           const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                           double max_scale, bool normalize, const torch::Tensor& labels,
                           const torch::Tensor& candidate_labels, LabelMode mode) {
  const int64_t B = queries.size(0), N = candidates.size(0), g = N / B;
  auto logits = torch::matmul(unit(queries, normalize), unit(candidates, normalize).t()) *
                torch::clamp_max(torch::exp(logit_scale), max_scale);  // [B, N]
  if (logit_bias.has_value()) logits = logits + *logit_bias;
  auto opt = torch::TensorOptions().dtype(torch::kLong).device(queries.device());
  auto designated = torch::arange(N, opt).unsqueeze(0) == (torch::arange(B, opt) * g).unsqueeze(1);  // [B, N]
  torch::Tensor equal;
  if (labels.defined()) equal = labels.unsqueeze(1) == candidate_labels.unsqueeze(0);
  auto [pos, mask] = label_structure(designated, equal, mode);
  return info_nce_rows(logits, pos, mask);
}

torch::Tensor reduce(const torch::Tensor& rows, Reduction reduction) {
  if (reduction == Reduction::kNone) return rows;
  return reduction == Reduction::kSum ? rows.sum() : rows.mean();
}

torch::Tensor matryoshka(const std::vector<int64_t>& dims, const std::vector<double>& weights,
                         const std::vector<torch::Tensor>& features,
                         const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& loss) {
  const int64_t width = features.at(0).size(1);
  std::vector<std::pair<int64_t, double>> prefixes;
  for (size_t i = 0; i < dims.size(); ++i) prefixes.emplace_back(dims[i], weights.empty() ? 1.0 : weights[i]);
  if (std::find_if(prefixes.begin(), prefixes.end(), [&](const auto& p) { return p.first == width; }) ==
      prefixes.end()) {
    prefixes.emplace_back(width, 1.0);
  }
  torch::Tensor total = torch::zeros({}, features[0].options());
  for (const auto& [m, w] : prefixes) {
    std::vector<torch::Tensor> cut;
    for (const auto& f : features) cut.push_back(unit(f.narrow(1, 0, m), true));
    total = total + w * loss(cut);
  }
  return total;
}

torch::Tensor maxsim_scores(const torch::Tensor& queries, const torch::Tensor& query_mask,
                            const torch::Tensor& documents, const torch::Tensor& document_mask,
                            double padding_score) {
  auto t = torch::einsum("iqd,jsd->ijqs", {queries, documents});  // [n, m, Lq, Ld]
  t = t.masked_fill(document_mask.logical_not().unsqueeze(0).unsqueeze(2), padding_score);
  auto best = std::get<0>(t.max(3));                                       // [n, m, Lq]
  return (best * query_mask.unsqueeze(1).to(best.scalar_type())).sum(2);  // [n, m]
}

torch::Tensor score_rows(const torch::Tensor& logits, bool symmetric) {
  const int64_t n = logits.size(0), g = n > 0 ? logits.size(1) / n : 1;
  auto pos = torch::arange(n, logits.options().dtype(torch::kLong)) * g;
  auto rows = F::cross_entropy(logits, pos, F::CrossEntropyFuncOptions().reduction(torch::kNone));
  if (!symmetric) return rows;
  return (rows + F::cross_entropy(logits.t(), pos, F::CrossEntropyFuncOptions().reduction(torch::kNone))) / 2;
}

}  // namespace contrax::reference
