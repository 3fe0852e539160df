// The retrieval recipe (see trainer.h): the towers, their DataParallel and
// gradient cache, and one step's batch of queries and passages, run by the
// shared loop (common/loop.h).
#include "contrax/train/retrieval/trainer.h"

#include <cmath>
#include <functional>
#include <iomanip>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "contrax/comm/failure.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/maxsim.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"

namespace contrax::train {

namespace {

void check_retrieval_options(const RetrievalOptions& o, const RetrievalCorpus& c) {
  check_run_options(o.run(), "retrieval: ");
  TORCH_CHECK(o.query_chunk_size() >= 0, "retrieval: query chunk size must be >= 0, but got ", o.query_chunk_size());
  TORCH_CHECK(o.hard_negatives() >= 0 && o.hard_negatives() <= 64,
              "retrieval: hard negatives must be in [0, 64], but got ", o.hard_negatives());
  TORCH_CHECK(o.temperature() > 0, "retrieval: temperature must be > 0, but got ", o.temperature());
  TORCH_CHECK(!c.train.empty(), "retrieval: the training split is empty");
  const int64_t d = o.query_tower().out_dim();
  TORCH_CHECK(o.passage_tower().out_dim() == d, "retrieval: the towers' output widths must be equal, but got ", d,
              " and ", o.passage_tower().out_dim());
  for (size_t k = 0; k < o.matryoshka_dims().size(); ++k) {
    const int64_t m = o.matryoshka_dims()[k];
    TORCH_CHECK(m >= 1 && m <= d, "retrieval: every Matryoshka width must be in [1, ", d,
                "] (the towers' output width), but got ", m);
    TORCH_CHECK(k == 0 || m > o.matryoshka_dims()[k - 1],
                "retrieval: the Matryoshka widths must be strictly increasing, but got ", o.matryoshka_dims()[k - 1],
                " then ", m);
  }
  if (o.scorer() != RetrievalScorer::kMaxSim) return;
  TORCH_CHECK(o.query_chunk_size() == 0, "retrieval: the MaxSim scorer does not run through the gradient cache, "
              "but got query chunk size ", o.query_chunk_size());
  TORCH_CHECK(o.matryoshka_dims().empty(), "retrieval: the MaxSim scorer takes no Matryoshka prefixes");
  TORCH_CHECK(c.query_tokens.rows() == static_cast<int64_t>(c.synsets.size()) &&
                  c.passage_tokens.rows() == static_cast<int64_t>(c.synsets.size()),
              "retrieval: the MaxSim scorer needs the corpus's token features (make it with token_features(true))");
}

// What a resumed run must share with its checkpoint besides the loop's own
// settings. A checkpoint without the scorer or the prefixes (written before
// they existed) reads 0 for them: the dot scorer without prefixes.
std::vector<RunSetting> retrieval_run_settings(const RetrievalOptions& o) {
  std::vector<RunSetting> s{{"hard_negatives", o.hard_negatives(), "hard negatives"},
                            {"scorer", o.scorer() == RetrievalScorer::kMaxSim ? 1 : 0, "scorer (0: dot, 1: MaxSim)"},
                            {"matryoshka_prefixes", static_cast<int64_t>(o.matryoshka_dims().size()),
                             "Matryoshka prefixes given"}};
  for (size_t k = 0; k < o.matryoshka_dims().size(); ++k) {
    s.push_back({"matryoshka_dim_" + std::to_string(k), o.matryoshka_dims()[k],
                 "(width of Matryoshka prefix " + std::to_string(k + 1) + ")"});
  }
  return s;
}

// The towers, their reducers and the step's forward and backward.
struct Towers {
  BagTower query{nullptr}, passage{nullptr};
  LogitScale scale{nullptr};
  // One DataParallel per tower and one for the scale: the gradient cache arms
  // each tower's reducer for its own last chunk and the scale's for the loss.
  std::shared_ptr<DataParallel> dpq, dpp, dps;
  std::shared_ptr<GradCache> gc;

  void wrap(const CommunicatorPtr& comm, const RetrievalOptions& o) {
    dpq = std::make_shared<DataParallel>(query, comm);
    dpp = std::make_shared<DataParallel>(passage, comm);
    dps = std::make_shared<DataParallel>(scale, comm);
    if (o.query_chunk_size() <= 0) return;
    const int64_t g = 1 + o.hard_negatives();
    const int64_t pchunk = o.passage_chunk_size() > 0 ? o.passage_chunk_size() : o.query_chunk_size() * g;
    gc = std::make_shared<GradCache>(
        std::vector<GradCacheEncoder>{GradCacheEncoder(query, o.query_chunk_size()).data_parallel(dpq).name("queries"),
                                      GradCacheEncoder(passage, pchunk).data_parallel(dpp).name("passages")},
        [](const std::vector<torch::Tensor>&) -> torch::Tensor {
          TORCH_INTERNAL_ASSERT(false, "the retrieval step passes its loss to GradCache::finish");
        },
        GradCacheOptions().loss_data_parallel(dps));
  }

  // loss(queries' embeddings, candidates' embeddings, log scale).
  using Loss = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;

  // The loss of one step's queries [b_r] and their candidates [b_r * g], with
  // gradients averaged over ranks. grouped_loss and maxsim_loss return
  // L_r = (W / B) * (sum of this rank's per-query losses), as clip_loss does.
  torch::Tensor loss(const Communicator& comm, const std::vector<torch::Tensor>& qx,
                     const std::vector<torch::Tensor>& px, const Loss& f) {
    torch::Tensor loss;
    if (gc) {
      gc->cache(size_t{0}, qx);
      gc->cache(size_t{1}, px);
      with_collective_context(comm, kReducerAllReduce, [&] {
        loss = gc->finish([&](const std::vector<torch::Tensor>& r) { return f(r[0], r[1], scale->value); });
      });
      return loss;
    }
    auto q = dpq->forward([&] { return query->forward(qx); });    // [b_r, d] (MaxSim: [b_r, Lq, d])
    auto p = dpp->forward([&] { return passage->forward(px); });  // [b_r * g, d] (MaxSim: [b_r * g, Ld, d])
    auto s = dps->forward([&] { return scale->forward(); });      // 0-dim log scale
    loss = f(q, p, s);
    with_collective_context(comm, kReducerAllReduce, [&] { loss.backward(); });
    return loss;
  }
};

// A step's queries (this rank's training synsets) and candidates (each
// query's own passage, then its hard negatives), as features, with their
// passage ids as labels (candidates sharing the query's are masked).
torch::Tensor retrieval_step(Towers& t, const CommunicatorPtr& comm, const RetrievalCorpus& corpus,
                             const RetrievalOptions& o, const StepBatch& b) {
  const int64_t h = o.hard_negatives();
  std::vector<int64_t> rows(b.indices.data_ptr<int64_t>(), b.indices.data_ptr<int64_t>() + b.indices.numel());
  const auto negs = sample_hard_negatives(corpus, rows, h, o.run().seed(), b.epoch);
  std::vector<int64_t> qsyn, csyn, qlab, clab;
  for (size_t k = 0; k < rows.size(); ++k) {
    const int64_t s = corpus.train[rows[k]];
    qsyn.push_back(s);
    csyn.push_back(s);
    for (int64_t j = 0; j < h; ++j) csyn.push_back(corpus.train[negs[k * h + j]]);
  }
  if (o.scorer() == RetrievalScorer::kMaxSim) {
    const auto qb = token_feature_batch(corpus.query_tokens, qsyn, o.run().dtype());    // ids, weights, slots, mask
    const auto pb = token_feature_batch(corpus.passage_tokens, csyn, o.run().dtype());  // ids, weights, slots, mask
    const auto mopts =
        MaxSimLossOptions().comm(comm).normalize_scores(true).query_mask(qb[3]).document_mask(pb[3]);
    return t.loss(*comm, qb, pb,
                  [&](const torch::Tensor& q, const torch::Tensor& p, const torch::Tensor& s) {
                    return maxsim_loss(q, p, s, mopts);
                  });
  }
  for (auto s : qsyn) qlab.push_back(corpus.passage_id[s]);
  for (auto s : csyn) clab.push_back(corpus.passage_id[s]);
  const auto lopts = GroupedLossOptions()
                         .comm(comm)
                         .labels(torch::tensor(qlab, torch::kLong).reshape({-1}))
                         .candidate_labels(torch::tensor(clab, torch::kLong).reshape({-1}))
                         .label_mode(LabelMode::kMaskDuplicates)
                         .matryoshka_dims(o.matryoshka_dims());
  return t.loss(*comm, feature_batch(corpus.query_features, qsyn, o.run().dtype()),
                feature_batch(corpus.passage_features, csyn, o.run().dtype()),
                [&](const torch::Tensor& q, const torch::Tensor& p, const torch::Tensor& s) {
                  return grouped_loss(q, p, s, c10::nullopt, lopts);
                });
}

}  // namespace

int64_t retrieval_total_steps(const RetrievalOptions& o, int64_t n) { return total_steps(o.run(), n); }

void build_towers(const RetrievalOptions& o, BagTower& qt, BagTower& pt, LogitScale& scale) {
  // Seeded construction under a lock: ranks that are threads of one process
  // (tests) must not interleave their draws from the global generator.
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> lock(init_mutex);
  torch::manual_seed(o.run().seed());
  qt = BagTower(o.query_tower());
  pt = BagTower(o.passage_tower());
  scale = LogitScale(std::log(1.0 / o.temperature()));
  qt->to(o.run().dtype());
  pt->to(o.run().dtype());
  scale->to(o.run().dtype());
}

RetrievalTrainResult train_retrieval(const CommunicatorPtr& comm_in, const RetrievalCorpus& corpus,
                                     const RetrievalOptions& o) {
  CommunicatorPtr comm = comm_in ? comm_in : Communicator::single();
  check_retrieval_options(o, corpus);
  Towers t;
  build_towers(o, t.query, t.passage, t.scale);
  std::vector<torch::Tensor> params;
  for (auto* m : std::vector<torch::nn::Module*>{t.query.get(), t.passage.get(), t.scale.get()}) {
    for (const auto& p : m->parameters()) params.push_back(p);
  }
  TrainLoop loop(comm, o.run(),
                 {"retrieval",
                  static_cast<int64_t>(corpus.train.size()),
                  {{"query_tower", t.query.get()}, {"passage_tower", t.passage.get()}, {"logit_scale", t.scale.get()}},
                  params,
                  retrieval_run_settings(o),
                  {{"temperature", o.temperature()}}});
  t.wrap(comm, o);
  Step step;
  step.loss = [&](const StepBatch& b) { return retrieval_step(t, comm, corpus, o, b); };
  step.progress = [&] {
    std::ostringstream s;
    s << "  scale " << std::fixed << std::setprecision(1) << std::exp(t.scale->value.item<double>());
    return s.str();
  };
  step.rate_unit = "q";
  RetrievalTrainResult result;
  static_cast<RunResult&>(result) = loop.run(step);
  t.query->eval();
  t.passage->eval();
  result.query_tower = t.query;
  result.passage_tower = t.passage;
  result.logit_scale = std::exp(t.scale->value.item<double>());
  return result;
}

}  // namespace contrax::train
