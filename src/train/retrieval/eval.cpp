// Retrieval metrics with ties broken in expectation, the held-out evaluation
// set, and the evaluation of towers and BM25 on it (see eval.h).
#include "contrax/train/retrieval/eval.h"

#include <algorithm>
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

torch::Tensor embed_all(BagTower tower, const Ragged& features, const std::vector<int64_t>& rows) {
  torch::NoGradGuard ng;
  const auto dtype = tower->embedding.scalar_type();
  std::vector<torch::Tensor> parts;
  constexpr int64_t kChunk = 1024;
  for (size_t s = 0; s < rows.size(); s += kChunk) {
    std::vector<int64_t> part(rows.begin() + s, rows.begin() + std::min(rows.size(), s + kChunk));
    parts.push_back(tower->forward(feature_batch(features, part, dtype)));
  }
  return parts.empty() ? torch::zeros({0, tower->options.out_dim()}, dtype) : torch::cat(parts);
}

}  // namespace

RetrievalMetrics evaluate_towers(BagTower qt, BagTower pt, const RetrievalCorpus& c, const RetrievalEvalSet& set) {
  const bool qtrain = qt->is_training(), ptrain = pt->is_training();
  qt->eval();
  pt->eval();
  auto q = embed_all(qt, c.query_features, set.query_synsets);
  auto p = embed_all(pt, c.passage_features, set.passage_synsets);
  qt->train(qtrain);
  pt->train(ptrain);
  return retrieval_metrics(torch::matmul(q.to(torch::kDouble), p.to(torch::kDouble).t()), set.target);
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
