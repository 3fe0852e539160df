// The retrieval recipe's test runs, shared by its test programs
// (tests/train/train_retrieval*_test.cpp): a synthetic corpus, small fp64
// options, a run at a world size as threads, the comparison of two runs, and
// the CLI's quick settings.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "contrax/train/retrieval/trainer.h"
#include "contrax/train/retrieval/wordnet.h"
#include "support/ranks.h"

namespace contrax::testing {

/// A synthetic corpus: n synsets whose passages repeat every 50 (duplicates to
/// mask) and whose hypernyms group them by tens; with `token_features`, the
/// MaxSim scorer's per-word features too.
inline train::RetrievalCorpus synthetic_corpus(int64_t n, bool token_features = false) {
  std::vector<train::Synset> s;
  for (int64_t i = 0; i < n; ++i) {
    train::Synset x;
    x.key = 1000 + i;
    x.offset = 1000 + i;
    x.lex_filenum = static_cast<int>(i % 3);
    x.lemmas = {"w" + std::to_string(i % 50), "v" + std::to_string((i * 7) % 50)};
    x.definition = "gloss " + std::to_string(i % 13) + " of " + std::to_string(i % 17) + " thing";
    x.hypernyms = {i / 10};
    s.push_back(x);
  }
  return train::make_retrieval_corpus(s, train::RetrievalCorpusOptions()
                                             .heldout_per_10000(0)
                                             .query_buckets(256)
                                             .passage_buckets(256)
                                             .token_features(token_features));
}

/// Small towers, 3 steps of a global batch of 24 with 2 hard negatives, fp64.
inline train::RetrievalOptions small_options() {
  train::RetrievalOptions o;
  o.hard_negatives(2)
      .query_tower(train::BagTowerOptions(256).embed_dim(8).hidden_dim(16).out_dim(8))
      .passage_tower(train::BagTowerOptions(256).embed_dim(12).hidden_dim(8).out_dim(8));
  o.run().batch_size(24).max_steps(3).warmup_steps(1).lr(1e-2).dtype(torch::kDouble).log_every(0).seed(3);
  return o;
}

/// small_options() with its run options changed by `edit`.
inline train::RetrievalOptions small_options(const std::function<void(train::RunOptions&)>& edit) {
  auto o = small_options();
  edit(o.run());
  return o;
}

/// Rank 0's losses and trained parameters (the towers', then the log scale).
struct WorldRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
};

/// Trains on `world` ranks as threads.
inline WorldRun train_world(int64_t world, const train::RetrievalCorpus& c, const train::RetrievalOptions& o) {
  WorldRun out;
  run_ranks(world, [&](const CommunicatorPtr& comm) {
    auto r = train::train_retrieval(comm, c, o);
    if (comm->rank() == 0) {
      out.losses = r.losses;
      for (auto* m : std::vector<torch::nn::Module*>{r.query_tower.get(), r.passage_tower.get()}) {
        for (const auto& p : m->parameters()) out.params.push_back(p.detach().clone());
      }
      out.params.push_back(torch::tensor(std::log(r.logit_scale), torch::kDouble));
    }
  }, std::chrono::seconds(120));
  return out;
}

/// The same losses and parameters, to relative error `tol`.
inline void expect_same(const WorldRun& a, const WorldRun& b, double tol) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(a.losses[i], b.losses[i], tol * std::abs(b.losses[i]));
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_LT(rel_err(a.params[i], b.params[i]), tol) << i;
}

/// Whether Debian's wordnet-base is installed (the CLI tests need it).
inline bool have_wordnet() {
  return std::filesystem::exists(std::string(train::kDefaultWordNetDir) + "/data.noun");
}

/// A quick `contrax train retrieval`: 2 processes, 2048 training synsets, 400 evaluated.
constexpr const char* kFast =
    "train --recipe retrieval --nproc 2 --threads 1 --batch-size 64 --train-limit 2048 --eval-limit 400 "
    "--log-every 0 --no-plot --no-verify --timeout 120";

}  // namespace contrax::testing
