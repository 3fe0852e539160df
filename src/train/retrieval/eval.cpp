// Retrieval metrics with ties broken in expectation, the held-out evaluation
// set, and the evaluation of towers and BM25 on it (see eval.h).
#include "contrax/train/retrieval/eval.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <unordered_map>

namespace contrax::train {

RetrievalMetrics retrieval_metrics(const torch::Tensor& scores_in, const torch::Tensor& target_in) {
  TORCH_CHECK(scores_in.dim() == 2, "retrieval_metrics(): argument 'scores' must be [queries, passages], but got shape ",
              scores_in.sizes());
  TORCH_CHECK(target_in.dim() == 1 && target_in.size(0) == scores_in.size(0),
              "retrieval_metrics(): argument 'target' must be [", scores_in.size(0), "], but got shape ",
              target_in.sizes());
  const int64_t Q = scores_in.size(0), P = scores_in.size(1);
  RetrievalMetrics m;
  m.queries = Q;
  m.passages = P;
  if (Q == 0) return m;
  auto target = target_in.to(torch::kLong);
  TORCH_CHECK(target.min().item<int64_t>() >= 0 && target.max().item<int64_t>() < P,
              "retrieval_metrics(): argument 'target' must hold columns in [0, ", P, ")");
  auto scores = scores_in.to(torch::kDouble);
  auto correct = scores.gather(1, target.unsqueeze(1));            // [Q, 1]
  auto greater = (scores > correct).sum(1);                        // [Q]
  auto ties = (scores == correct).sum(1) - 1;                      // [Q], the correct one excluded
  auto ga = greater.accessor<int64_t, 1>();
  auto ta = ties.accessor<int64_t, 1>();
  // harmonic[k] = sum_{r=1..k} 1/r
  std::vector<double> harmonic(P + 2, 0.0);
  for (int64_t k = 1; k <= P + 1; ++k) harmonic[k] = harmonic[k - 1] + 1.0 / static_cast<double>(k);
  double r1 = 0, r10 = 0, mrr = 0;
  for (int64_t i = 0; i < Q; ++i) {
    const double g = static_cast<double>(ga[i]), t = static_cast<double>(ta[i]);
    auto recall = [&](double k) { return std::clamp((k - g) / (t + 1), 0.0, 1.0); };
    r1 += recall(1);
    r10 += recall(10);
    mrr += (harmonic[ga[i] + ta[i] + 1] - harmonic[ga[i]]) / (t + 1);
  }
  m.recall_at_1 = r1 / static_cast<double>(Q);
  m.recall_at_10 = r10 / static_cast<double>(Q);
  m.mrr = mrr / static_cast<double>(Q);
  return m;
}

RetrievalEvalSet make_eval_set(const RetrievalCorpus& c, int64_t limit) {
  RetrievalEvalSet s;
  const int64_t n = limit < 0 ? static_cast<int64_t>(c.heldout.size())
                              : std::min<int64_t>(limit, static_cast<int64_t>(c.heldout.size()));
  std::unordered_map<int64_t, int64_t> column;  // passage id -> column
  std::vector<int64_t> target;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = c.heldout[k];
    const auto it = column.emplace(c.passage_id[i], static_cast<int64_t>(s.passage_synsets.size()));
    if (it.second) s.passage_synsets.push_back(i);
    s.query_synsets.push_back(i);
    target.push_back(it.first->second);
  }
  s.target = torch::tensor(target, torch::kLong);
  if (target.empty()) s.target = torch::zeros({0}, torch::kLong);
  return s;
}

namespace {

constexpr int64_t kEmbedChunk = 1024;

torch::Tensor embed_all(BagTower tower, const Ragged& features, const std::vector<int64_t>& rows) {
  torch::NoGradGuard ng;
  const auto dtype = tower->embedding.scalar_type();
  std::vector<torch::Tensor> parts;
  for (size_t s = 0; s < rows.size(); s += kEmbedChunk) {
    std::vector<int64_t> part(rows.begin() + s, rows.begin() + std::min(rows.size(), s + kEmbedChunk));
    parts.push_back(tower->forward(feature_batch(features, part, dtype)));
  }
  return parts.empty() ? torch::zeros({0, tower->options.out_dim()}, dtype) : torch::cat(parts);
}

// Token embeddings [N, T, d] of `rows` (T the most tokens of any) and their
// valid tokens, bool [N, T].
std::pair<torch::Tensor, torch::Tensor> embed_tokens(BagTower tower, const TokenBags& bags,
                                                     const std::vector<int64_t>& rows) {
  torch::NoGradGuard ng;
  const auto dtype = tower->embedding.scalar_type();
  int64_t T = 1;
  for (auto r : rows) T = std::max(T, bags.size(r));
  std::vector<torch::Tensor> parts, masks;
  for (size_t s = 0; s < rows.size(); s += kEmbedChunk) {
    std::vector<int64_t> part(rows.begin() + s, rows.begin() + std::min(rows.size(), s + kEmbedChunk));
    const auto b = token_feature_batch(bags, part, dtype);
    const int64_t pad = T - b[3].size(1);
    parts.push_back(torch::constant_pad_nd(tower->forward(b), {0, 0, 0, pad}));
    masks.push_back(torch::constant_pad_nd(b[3], {0, pad}, 0));
  }
  if (parts.empty()) {
    return {torch::zeros({0, T, tower->options.out_dim()}, dtype), torch::zeros({0, T}, torch::kBool)};
  }
  return {torch::cat(parts), torch::cat(masks)};
}

// Runs `f` with both towers in eval mode, then restores their modes.
template <typename F>
auto in_eval_mode(BagTower qt, BagTower pt, F f) {
  const bool qtrain = qt->is_training(), ptrain = pt->is_training();
  qt->eval();
  pt->eval();
  auto out = f();
  qt->train(qtrain);
  pt->train(ptrain);
  return out;
}

}  // namespace

RetrievalMetrics evaluate_towers(BagTower qt, BagTower pt, const RetrievalCorpus& c, const RetrievalEvalSet& set) {
  return evaluate_towers_at_widths(qt, pt, c, set, {qt->options.out_dim()})[0];
}

std::vector<RetrievalMetrics> evaluate_towers_at_widths(BagTower qt, BagTower pt, const RetrievalCorpus& c,
                                                        const RetrievalEvalSet& set,
                                                        const std::vector<int64_t>& widths) {
  const int64_t d = qt->options.out_dim();
  for (auto m : widths) {
    TORCH_CHECK(m >= 1 && m <= d, "evaluate_towers_at_widths(): every width must be in [1, ", d, "], but got ", m);
  }
  auto [q, p] = in_eval_mode(qt, pt, [&] {
    return std::make_pair(embed_all(qt, c.query_features, set.query_synsets).to(torch::kDouble),
                          embed_all(pt, c.passage_features, set.passage_synsets).to(torch::kDouble));
  });
  std::vector<RetrievalMetrics> out;
  for (auto m : widths) {
    if (m == d) {  // the towers' own unit rows, as they are
      out.push_back(retrieval_metrics(torch::matmul(q, p.t()), set.target));
      continue;
    }
    namespace F = torch::nn::functional;
    const auto unit = F::NormalizeFuncOptions().dim(1).eps(1e-12);
    auto qm = F::normalize(q.narrow(1, 0, m), unit), pm = F::normalize(p.narrow(1, 0, m), unit);
    out.push_back(retrieval_metrics(torch::matmul(qm, pm.t()), set.target));
  }
  return out;
}

torch::Tensor maxsim_score_matrix(const torch::Tensor& q, const torch::Tensor& qmask, const torch::Tensor& p,
                                  const torch::Tensor& pmask, int64_t chunk_bytes) {
  TORCH_CHECK(q.dim() == 3 && p.dim() == 3 && q.size(2) == p.size(2), "maxsim_score_matrix(): queries and passages "
              "must be [Q, Lq, d] and [P, Ld, d], but got ", q.sizes(), " and ", p.sizes());
  TORCH_CHECK(qmask.sizes() == q.sizes().slice(0, 2) && pmask.sizes() == p.sizes().slice(0, 2),
              "maxsim_score_matrix(): the masks must be [Q, Lq] and [P, Ld], but got ", qmask.sizes(), " and ",
              pmask.sizes());
  const int64_t Q = q.size(0), Lq = q.size(1), P = p.size(0), d = q.size(2);
  auto tokens = p.reshape({-1, d}).index({pmask.reshape({-1})});                                  // [N, d]
  auto owner = torch::arange(P, torch::kLong).unsqueeze(1).expand({P, p.size(1)}).reshape({-1});  // [P Ld]
  owner = owner.index({pmask.reshape({-1})});                                                     // [N]
  TORCH_CHECK(P == 0 || pmask.any(1).all().item<bool>(), "maxsim_score_matrix(): every passage needs a valid token");
  const int64_t N = tokens.size(0);
  const int64_t per_query = std::max<int64_t>(1, Lq * (N + P) * q.element_size());
  const int64_t chunk = std::max<int64_t>(1, chunk_bytes / per_query);
  std::vector<torch::Tensor> rows;
  for (int64_t s = 0; s < Q; s += chunk) {
    const int64_t c = std::min(chunk, Q - s);
    auto t = torch::matmul(q.narrow(0, s, c).reshape({c * Lq, d}), tokens.t());  // [c Lq, N]
    auto best = torch::full({c * Lq, P}, -std::numeric_limits<double>::infinity(), t.options())
                    .scatter_reduce_(1, owner.unsqueeze(0).expand({c * Lq, N}), t, "amax");  // [c Lq, P]
    auto valid = qmask.narrow(0, s, c).reshape({c * Lq, 1}).to(t.scalar_type());
    rows.push_back((best * valid).view({c, Lq, P}).sum(1));  // [c, P]
  }
  return rows.empty() ? torch::zeros({0, P}, q.options()) : torch::cat(rows);
}

RetrievalMetrics evaluate_token_towers(BagTower qt, BagTower pt, const RetrievalCorpus& c,
                                       const RetrievalEvalSet& set) {
  TORCH_CHECK(c.query_tokens.rows() == static_cast<int64_t>(c.synsets.size()),
              "evaluate_token_towers(): the corpus has no token features (make it with token_features(true))");
  auto [q, p] = in_eval_mode(qt, pt, [&] {
    return std::make_pair(embed_tokens(qt, c.query_tokens, set.query_synsets),
                          embed_tokens(pt, c.passage_tokens, set.passage_synsets));
  });
  return retrieval_metrics(maxsim_score_matrix(q.first.to(torch::kDouble), q.second, p.first.to(torch::kDouble),
                                               p.second),
                           set.target);
}

RetrievalMetrics evaluate_bm25(const RetrievalCorpus& c, const RetrievalEvalSet& set, const std::string& terms,
                               const Bm25Options& options) {
  TORCH_CHECK(terms == "word" || terms == "chargram", "evaluate_bm25(): argument 'terms' must be 'word' or "
              "'chargram', but got '", terms, "'");
  auto tok = [&](const std::string& s) { return terms == "word" ? words_of(s) : char_ngram_terms(s); };
  std::vector<std::vector<std::string>> docs, queries;
  for (auto i : set.passage_synsets) docs.push_back(tok(c.passages[i]));
  for (auto i : set.query_synsets) queries.push_back(tok(c.queries[i]));
  Bm25 bm25(docs, options);
  return retrieval_metrics(bm25.score_matrix(queries), set.target);
}

}  // namespace contrax::train
