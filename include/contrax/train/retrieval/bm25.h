// The lexical baseline of the retrieval recipe: Okapi BM25 over words or
// character n-grams, the system the trained towers are compared with.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace contrax::train {

/// Okapi BM25 over bags of terms.
///   score(q, d) = sum over DISTINCT terms t of q: idf(t) * tf(t,d) (k1 + 1) / (tf(t,d) + k1 (1 - b + b |d| / avgdl))
///   idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5))   (never negative)
/// with N documents, n_t of them containing t, |d| the document's term count.
struct Bm25Options {
  /// Term-frequency saturation k1 (>= 0).
  TORCH_ARG(double, k1) = 1.2;
  /// Length normalisation b, in [0, 1].
  TORCH_ARG(double, b) = 0.75;
};

/// A BM25 index over a fixed list of documents, each a bag of terms; scores
/// queries against every document as Bm25Options describes.
class Bm25 {
 public:
  /// Indexes `documents` (the document index is the position in the list);
  /// checks k1 >= 0 and b in [0, 1].
  explicit Bm25(const std::vector<std::vector<std::string>>& documents, const Bm25Options& options = {});
  /// Scores of one query against every document: double [N].
  torch::Tensor scores(const std::vector<std::string>& query) const;
  /// double [queries.size(), N].
  torch::Tensor score_matrix(const std::vector<std::vector<std::string>>& queries) const;
  /// Number of documents N.
  int64_t size() const { return static_cast<int64_t>(lengths_.size()); }

 private:
  Bm25Options options_;
  std::vector<double> lengths_;
  double avgdl_ = 0;
  // term -> (document, tf) postings, and idf
  std::unordered_map<std::string, std::vector<std::pair<int64_t, double>>> postings_;
};

/// The character n-grams (lengths min_n..max_n) of every word of `text`, each
/// word marked "<word>": the terms of the character-gram BM25 variant.
std::vector<std::string> char_ngram_terms(const std::string& text, int64_t min_n = 3, int64_t max_n = 5);

}  // namespace contrax::train
