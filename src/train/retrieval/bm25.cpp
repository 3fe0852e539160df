// Okapi BM25 and character n-gram terms (see bm25.h).
#include "contrax/train/retrieval/bm25.h"

#include <cmath>
#include <unordered_set>

#include "contrax/train/retrieval/wordnet.h"

namespace contrax::train {

Bm25::Bm25(const std::vector<std::vector<std::string>>& docs, const Bm25Options& o) : options_(o) {
  TORCH_CHECK(o.k1() >= 0 && o.b() >= 0 && o.b() <= 1, "Bm25: k1 must be >= 0 and b in [0, 1], but got k1 ", o.k1(),
              ", b ", o.b());
  double total = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    std::unordered_map<std::string, double> tf;
    for (const auto& t : docs[d]) tf[t] += 1;
    for (const auto& [t, c] : tf) postings_[t].emplace_back(static_cast<int64_t>(d), c);
    lengths_.push_back(static_cast<double>(docs[d].size()));
    total += static_cast<double>(docs[d].size());
  }
  avgdl_ = docs.empty() ? 0 : total / static_cast<double>(docs.size());
}

torch::Tensor Bm25::scores(const std::vector<std::string>& query) const {
  auto out = torch::zeros({size()}, torch::kDouble);
  auto a = out.accessor<double, 1>();
  const double N = static_cast<double>(size());
  std::unordered_set<std::string> seen;
  for (const auto& t : query) {
    if (!seen.insert(t).second) continue;
    const auto it = postings_.find(t);
    if (it == postings_.end()) continue;
    const double n = static_cast<double>(it->second.size());
    const double idf = std::log(1.0 + (N - n + 0.5) / (n + 0.5));
    for (const auto& [d, tf] : it->second) {
      const double norm = avgdl_ > 0 ? lengths_[d] / avgdl_ : 0.0;
      a[d] += idf * tf * (options_.k1() + 1) / (tf + options_.k1() * (1 - options_.b() + options_.b() * norm));
    }
  }
  return out;
}

torch::Tensor Bm25::score_matrix(const std::vector<std::vector<std::string>>& queries) const {
  std::vector<torch::Tensor> rows;
  rows.reserve(queries.size());
  for (const auto& q : queries) rows.push_back(scores(q));
  return rows.empty() ? torch::zeros({0, size()}, torch::kDouble) : torch::stack(rows);
}

std::vector<std::string> char_ngram_terms(const std::string& text, int64_t min_n, int64_t max_n) {
  std::vector<std::string> out;
  for (const auto& word : words_of(text)) {
    const std::string m = "<" + word + ">";
    out.push_back(m);
    for (int64_t n = min_n; n <= max_n; ++n) {
      for (int64_t i = 0; i + n <= static_cast<int64_t>(m.size()); ++i) {
        if (n < static_cast<int64_t>(m.size())) out.push_back(m.substr(i, n));
      }
    }
  }
  return out;
}

}  // namespace contrax::train
