// Evaluating retrieval: recall@1, recall@10 and MRR of the held-out ranking
// task, one protocol and one evaluation set for every system (the trained
// towers, the random-init towers, BM25 on words and on character n-grams).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "contrax/train/retrieval/bm25.h"
#include "contrax/train/retrieval/towers.h"
#include "contrax/train/retrieval/wordnet.h"

namespace contrax::train {

/// recall@1, recall@10 and MRR of a ranking task.
struct RetrievalMetrics {
  double recall_at_1 = 0;   ///< fraction of queries whose correct passage is ranked first
  double recall_at_10 = 0;  ///< fraction of queries whose correct passage is among the first ten
  double mrr = 0;           ///< mean reciprocal rank of the correct passage
  int64_t queries = 0;      ///< number of queries Q
  int64_t passages = 0;     ///< number of passages P
};

/// Metrics of scores [Q, P] (higher is better) where query i's correct
/// passage is column target[i] (int64 [Q]). Ties are broken uniformly at
/// random, in expectation: with g passages scoring strictly higher than the
/// correct one and t others scoring equal, its rank is uniform on
/// g+1 .. g+t+1, so recall\@k = clamp((k - g) / (t + 1), 0, 1) and the
/// reciprocal rank is the mean of 1/r over that range. (A lexical score is 0
/// for most passages, so "ties count for the query" would flatter it, and
/// "against" would wrong it.)
RetrievalMetrics retrieval_metrics(const torch::Tensor& scores, const torch::Tensor& target);

/// The held-out ranking task: every held-out gloss against the DISTINCT
/// held-out passages (by passage id); a query is correct when the passage
/// string of its own synset is ranked first (whichever synset it came from).
struct RetrievalEvalSet {
  std::vector<int64_t> query_synsets;    ///< [Q] synset index of each query
  std::vector<int64_t> passage_synsets;  ///< [P] one synset per distinct passage
  torch::Tensor target;                  ///< int64 [Q]: column of each query's correct passage
};

/// The first `limit` held-out synsets (-1: all).
RetrievalEvalSet make_eval_set(const RetrievalCorpus& corpus, int64_t limit = -1);

/// The towers' ranking: cosine similarity of query and passage embeddings.
RetrievalMetrics evaluate_towers(BagTower query_tower, BagTower passage_tower, const RetrievalCorpus& corpus,
                                 const RetrievalEvalSet& set);

/// The towers' ranking at each prefix width of `widths` (each in [1, out_dim]):
/// cosine similarity of the embeddings' first m dimensions, re-normalised (a
/// Matryoshka model's prefixes). At the full width, evaluate_towers' metrics.
std::vector<RetrievalMetrics> evaluate_towers_at_widths(BagTower query_tower, BagTower passage_tower,
                                                        const RetrievalCorpus& corpus, const RetrievalEvalSet& set,
                                                        const std::vector<int64_t>& widths);

/// MaxSim scores [Q, P]: for each query, the sum over its valid tokens of the
/// best dot product with a passage's valid tokens. queries [Q, Lq, d] with
/// query_mask bool [Q, Lq]; passages [P, Ld, d] with passage_mask bool
/// [P, Ld] (every passage at least one valid token). Only the passages' valid
/// tokens are scored, a chunk of queries at a time, each chunk's token scores
/// at most about `chunk_bytes`.
torch::Tensor maxsim_score_matrix(const torch::Tensor& queries, const torch::Tensor& query_mask,
                                  const torch::Tensor& passages, const torch::Tensor& passage_mask,
                                  int64_t chunk_bytes = int64_t{64} << 20);

/// The token towers' ranking by MaxSim (the corpus made with token_features):
/// every gloss word's embedding against every lemma word's.
RetrievalMetrics evaluate_token_towers(BagTower query_tower, BagTower passage_tower, const RetrievalCorpus& corpus,
                                       const RetrievalEvalSet& set);

/// BM25 rankings: "word" (gloss words vs lemma words) or "chargram"
/// (character 3-5-grams of both).
RetrievalMetrics evaluate_bm25(const RetrievalCorpus& corpus, const RetrievalEvalSet& set, const std::string& terms,
                               const Bm25Options& options = {});

}  // namespace contrax::train
