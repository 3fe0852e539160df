// The two-tower dense-retrieval recipe of `contrax train retrieval`, in the
// loop every recipe shares (common/loop.h: schedule, checkpoints and resume,
// metrics, the agreed stop, the non-finite guard).
//
// Each rank takes its slice of the global batch of training synsets, embeds
// their glosses with the query tower and g = 1 + hard_negatives passages per
// query with the passage tower (its own lemma list, then hard negatives from its
// co-hyponyms, see wordnet.h), and minimises `grouped_loss`: every candidate of
// every rank is a negative of every query, except those whose passage string
// equals the query's (LabelMode::kMaskDuplicates). The logit scale is learnable
// (its log). `query_chunk_size > 0` runs each step through the gradient cache
// with the passages in chunks of `passage_chunk_size`.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "contrax/comm/communicator.h"
#include "contrax/train/common/loop.h"
#include "contrax/train/retrieval/towers.h"
#include "contrax/train/retrieval/wordnet.h"

namespace contrax::train {

/// How the towers score a gloss against a lemma list.
enum class RetrievalScorer {
  kDot,     ///< one pooled unit vector per text, their dot product (grouped_loss)
  kMaxSim,  ///< one unit vector per word, late interaction (maxsim_loss)
};

/// Options of `train_retrieval`; the defaults are the default
/// `contrax train retrieval` run.
struct RetrievalOptions {
  /// The run (common/loop.h): 3 epochs at a global batch of 512 queries,
  /// AdamW lr 1e-2 with a decoupled decay of 0.2 (each step shrinks the
  /// weights by lr x 0.2 = 0.2 %): the regulariser that keeps the towers from
  /// memorising the 113k training pairs (measured: recall@10 0.4534 at 1e-4,
  /// 0.4757 at 0.2; see docs/benchmarks.md).
  TORCH_ARG(RunOptions, run) = RunOptions().epochs(3).batch_size(512).lr(1e-2).weight_decay(0.2);
  /// > 0: gradient cache; queries in chunks of this many rows.
  TORCH_ARG(int64_t, query_chunk_size) = 0;
  /// Passage chunk rows of the gradient cache (<= 0: query_chunk_size * g).
  TORCH_ARG(int64_t, passage_chunk_size) = 0;
  /// Hard negatives per query (g = 1 + this candidates per query).
  TORCH_ARG(int64_t, hard_negatives) = 1;
  /// Initial temperature: logit_scale starts at log(1 / temperature).
  TORCH_ARG(double, temperature) = 0.07;
  /// Towers: 2^15 buckets of 128-dim features (each tower's table is 4M
  /// floats: its dense gradient is all-reduced every step), 256 hidden, 128
  /// out. (64-dim features: recall@10 0.4173; 256: no better, 2.6x the time.)
  TORCH_ARG(BagTowerOptions, query_tower) = BagTowerOptions().embed_dim(128);
  /// Options of the passage tower.
  TORCH_ARG(BagTowerOptions, passage_tower) = BagTowerOptions().embed_dim(128);
  /// kDot (default): the pooled towers and grouped_loss. kMaxSim: the towers
  /// embed every word (the corpus made with token_features), and the loss is
  /// maxsim_loss over the same groups (positive, then the hard negatives),
  /// each query's score the mean over its words of the best cosine with a
  /// lemma word (normalize_scores, so that the learnt scale means what it
  /// means for kDot). maxsim_loss takes no labels: a candidate with the
  /// query's own passage string is a negative, not masked (rare: the hard
  /// negatives exclude it; only in-batch duplicates remain). Not with the
  /// gradient cache or Matryoshka prefixes.
  TORCH_ARG(RetrievalScorer, scorer) = RetrievalScorer::kDot;
  /// kDot only: Matryoshka prefix widths, strictly increasing, each in
  /// [1, out_dim] (out_dim added when the list ends below it); the loss is
  /// grouped_loss's sum over the prefixes, weight 1 each. Empty: none.
  TORCH_ARG(std::vector<int64_t>, matryoshka_dims) = {};
};

/// What a run returns: the loop's result (its examples_per_s counts queries)
/// and the trained towers.
struct RetrievalTrainResult : RunResult {
  double logit_scale = 0;  ///< exp of the learnt log scale
  ///@{
  /// The trained towers, in eval mode.
  BagTower query_tower{nullptr}, passage_tower{nullptr};
  ///@}
};

/// The towers and scale as built from `options.run().seed()` before any
/// training (the random-init baseline uses the same function).
void build_towers(const RetrievalOptions& options, BagTower& query_tower, BagTower& passage_tower,
                  LogitScale& logit_scale);

/// Runs the training loop collectively on every rank of `comm` (null: world 1).
///
///   auto corpus = contrax::train::make_retrieval_corpus(contrax::train::load_wordnet("/usr/share/wordnet"));
///   contrax::train::RetrievalOptions o;
///   o.run().epochs(2);
///   auto r = contrax::train::train_retrieval(comm, corpus, o);
RetrievalTrainResult train_retrieval(const CommunicatorPtr& comm, const RetrievalCorpus& corpus,
                                     const RetrievalOptions& options);

/// Steps of the run: `total_steps(options.run(), train_size)` (common/loop.h).
int64_t retrieval_total_steps(const RetrievalOptions& options, int64_t train_size);

}  // namespace contrax::train
