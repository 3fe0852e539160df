// The two-tower dense-retrieval recipe of `contrax train --recipe retrieval`:
// towers, the lexical baseline (BM25), the retrieval metrics, the evaluation
// shared by every system, and the data-parallel training loop.
//
// Training: each rank takes its contiguous slice of the global batch of
// training synsets (ShardedSampler), embeds their glosses with the query
// tower and, with the passage tower, g = 1 + hard_negatives passages per
// query (its own lemma list, then hard negatives drawn from its
// co-hyponyms, see wordnet.h), and minimises `grouped_loss`: every candidate
// of every rank is a negative of every query, and candidates whose passage
// string equals the query's (same passage id) are masked out, not negatives
// (LabelMode::kMaskDuplicates). The logit scale is learnable (its log).
// `query_chunk_size > 0` runs each step through the gradient cache with the
// passages in chunks of `passage_chunk_size`. Checkpoints, metrics.jsonl,
// resume and the non-finite guard work as in trainer.h.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "contrax/communicator.h"
#include "contrax/train/wordnet.h"

namespace contrax {
namespace train {

// ---------------------------------------------------------------------------
// Towers

/// A hashed feature bag encoder: the mean of the features' embeddings,
/// layer-normalised (h), then z = skip(h) + fc2(GELU(fc1(h))), L2-normalised.
/// The layer norm keeps h at unit scale whatever the bag's length and the
/// embeddings' size; the linear skip lets a lexical match pass straight through.
struct BagTowerOptions {
  BagTowerOptions(int64_t buckets = int64_t{1} << 15) : buckets_(buckets) {}
  TORCH_ARG(int64_t, buckets);
  TORCH_ARG(int64_t, embed_dim) = 64;
  TORCH_ARG(int64_t, hidden_dim) = 256;
  TORCH_ARG(int64_t, out_dim) = 128;
  /// Standard deviation of the initial feature embeddings.
  TORCH_ARG(double, init_std) = 0.1;
};

class BagTowerImpl : public torch::nn::Module {
 public:
  explicit BagTowerImpl(const BagTowerOptions& options = {});
  /// x = {ids int64 [n, L], weights [n, L]} (feature_batch's output) -> [n, out_dim], unit rows.
  torch::Tensor forward(const std::vector<torch::Tensor>& x);
  BagTowerOptions options;
  torch::Tensor embedding;  // [buckets, embed_dim]
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, skip{nullptr};
};
TORCH_MODULE(BagTower);

/// The learnable log of the logit scale (0-dim), in a module of its own so
/// that its gradient is averaged over ranks by its own DataParallel.
class LogitScaleImpl : public torch::nn::Module {
 public:
  explicit LogitScaleImpl(double init_log_scale);
  torch::Tensor forward() { return value; }
  torch::Tensor value;
};
TORCH_MODULE(LogitScale);

// ---------------------------------------------------------------------------
// Lexical baseline

/// Okapi BM25 over bags of terms.
///   score(q, d) = sum over DISTINCT terms t of q: idf(t) * tf(t,d) (k1 + 1) / (tf(t,d) + k1 (1 - b + b |d| / avgdl))
///   idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5))   (never negative)
/// with N documents, n_t of them containing t, |d| the document's term count.
struct Bm25Options {
  TORCH_ARG(double, k1) = 1.2;
  TORCH_ARG(double, b) = 0.75;
};

class Bm25 {
 public:
  explicit Bm25(const std::vector<std::vector<std::string>>& documents, const Bm25Options& options = {});
  /// Scores of one query against every document: double [N].
  torch::Tensor scores(const std::vector<std::string>& query) const;
  /// double [queries.size(), N].
  torch::Tensor score_matrix(const std::vector<std::vector<std::string>>& queries) const;
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

// ---------------------------------------------------------------------------
// Metrics and evaluation

/// recall@1, recall@10 and MRR of a ranking task.
struct RetrievalMetrics {
  double recall_at_1 = 0;
  double recall_at_10 = 0;
  double mrr = 0;
  int64_t queries = 0;
  int64_t passages = 0;
};

/// Metrics of scores [Q, P] (higher is better) where query i's correct
/// passage is column target[i] (int64 [Q]). Ties are broken uniformly at
/// random, in expectation: with g passages scoring strictly higher than the
/// correct one and t others scoring equal, its rank is uniform on
/// g+1 .. g+t+1, so recall@k = clamp((k - g) / (t + 1), 0, 1) and the
/// reciprocal rank is the mean of 1/r over that range. (A lexical score is 0
/// for most passages, so "ties count for the query" would flatter it, and
/// "against" would wrong it.)
RetrievalMetrics retrieval_metrics(const torch::Tensor& scores, const torch::Tensor& target);

/// The held-out ranking task: every held-out gloss against the DISTINCT
/// held-out passages (by passage id); a query is correct when the passage
/// string of its own synset is ranked first (whichever synset it came from).
struct RetrievalEvalSet {
  std::vector<int64_t> query_synsets;    // [Q] synset indices
  std::vector<int64_t> passage_synsets;  // [P] one synset per distinct passage
  torch::Tensor target;                  // int64 [Q]: column of the query's passage
};

/// The first `limit` held-out synsets (-1: all).
RetrievalEvalSet make_eval_set(const RetrievalCorpus& corpus, int64_t limit = -1);

/// The towers' ranking: cosine similarity of query and passage embeddings.
RetrievalMetrics evaluate_towers(BagTower query_tower, BagTower passage_tower, const RetrievalCorpus& corpus,
                                 const RetrievalEvalSet& set);

/// BM25 rankings: "word" (gloss words vs lemma words) or "chargram"
/// (character 3-5-grams of both).
RetrievalMetrics evaluate_bm25(const RetrievalCorpus& corpus, const RetrievalEvalSet& set, const std::string& terms,
                               const Bm25Options& options = {});

// ---------------------------------------------------------------------------
// Training

/// Options of `train_retrieval`; the defaults are the default
/// `contrax train --recipe retrieval` run.
struct RetrievalOptions {
  TORCH_ARG(int64_t, epochs) = 3;
  TORCH_ARG(int64_t, max_steps) = -1;
  TORCH_ARG(int64_t, stop_at_step) = -1;
  /// Global batch of queries.
  TORCH_ARG(int64_t, batch_size) = 512;
  /// > 0: gradient cache; queries in chunks of this many rows.
  TORCH_ARG(int64_t, query_chunk_size) = 0;
  /// Passage chunk rows of the gradient cache (<= 0: query_chunk_size * g).
  TORCH_ARG(int64_t, passage_chunk_size) = 0;
  /// Hard negatives per query (g = 1 + this candidates per query).
  TORCH_ARG(int64_t, hard_negatives) = 1;
  TORCH_ARG(double, lr) = 1e-2;
  /// AdamW's decoupled decay (each step shrinks the weights by lr x 0.2 =
  /// 0.2 %): the regulariser that keeps the towers from memorising the 113k
  /// training pairs (measured: recall@10 0.4534 at 1e-4, 0.4757 at 0.2; see
  /// docs/benchmarks.md).
  TORCH_ARG(double, weight_decay) = 0.2;
  TORCH_ARG(int64_t, warmup_steps) = 20;
  /// Initial temperature: logit_scale starts at log(1 / temperature).
  TORCH_ARG(double, temperature) = 0.07;
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(torch::Dtype, dtype) = torch::kFloat;
  TORCH_ARG(std::string, run_dir) = "";
  TORCH_ARG(int64_t, checkpoint_every) = 200;
  TORCH_ARG(bool, resume) = false;
  TORCH_ARG(int64_t, log_every) = 10;
  TORCH_ARG(std::function<void(const std::string&)>, log) = nullptr;
  TORCH_ARG(int64_t, skip_nonfinite) = 0;
  TORCH_ARG(std::function<bool()>, stop_requested) = nullptr;
  /// Towers: 2^15 buckets of 128-dim features (each tower's table is 4M
  /// floats: its dense gradient is all-reduced every step), 256 hidden, 128
  /// out. (64-dim features: recall@10 0.4173; 256: no better, 2.6x the time.)
  TORCH_ARG(BagTowerOptions, query_tower) = BagTowerOptions().embed_dim(128);
  TORCH_ARG(BagTowerOptions, passage_tower) = BagTowerOptions().embed_dim(128);
};

struct RetrievalTrainResult {
  int64_t start_step = 0;
  int64_t steps = 0;
  int64_t total_steps = 0;
  int64_t epochs_done = 0;
  bool interrupted = false;
  double train_s = 0;
  double examples_per_s = 0;  // queries per second
  std::vector<double> losses;
  int64_t skipped_steps = 0;
  int64_t bytes_sent = 0;
  double logit_scale = 0;  // exp of the learnt log scale
  BagTower query_tower{nullptr}, passage_tower{nullptr};  // eval mode
};

/// The towers and scale as built from `options.seed()` before any training
/// (the random-init baseline uses the same function).
void build_towers(const RetrievalOptions& options, BagTower& query_tower, BagTower& passage_tower,
                  LogitScale& logit_scale);

/// Runs the training loop collectively on every rank of `comm` (null: world 1).
///
///   auto corpus = contrax::train::make_retrieval_corpus(contrax::train::load_wordnet("/usr/share/wordnet"));
///   auto r = contrax::train::train_retrieval(comm, corpus, contrax::train::RetrievalOptions().epochs(2));
RetrievalTrainResult train_retrieval(const CommunicatorPtr& comm, const RetrievalCorpus& corpus,
                                     const RetrievalOptions& options);

/// Steps of the run: max_steps when > 0, else epochs x ceil(train / batch).
int64_t retrieval_total_steps(const RetrievalOptions& options, int64_t train_size);

}  // namespace train
}  // namespace contrax
