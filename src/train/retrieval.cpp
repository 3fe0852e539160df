// Two-tower retrieval: towers, BM25, metrics, evaluation and the training
// loop of `contrax train --recipe retrieval` (see retrieval.h).
#include "contrax/train/retrieval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_set>

#include "contrax/data_parallel.h"
#include "contrax/failure.h"
#include "contrax/grad_cache.h"
#include "contrax/grouped.h"
#include "contrax/train/checkpoint.h"
#include "contrax/train/metrics.h"
#include "contrax/train/sampler.h"
#include "contrax/train/schedule.h"
#include "contrax/train/trainer.h"

namespace contrax {
namespace train {

namespace F = torch::nn::functional;

// ---------------------------------------------------------------------------
// Towers

BagTowerImpl::BagTowerImpl(const BagTowerOptions& o) : options(o) {
  TORCH_CHECK(o.buckets() >= 2 && o.embed_dim() >= 1 && o.hidden_dim() >= 1 && o.out_dim() >= 1,
              "BagTower: buckets must be >= 2 and every dimension >= 1, but got buckets ", o.buckets(), ", dims ",
              o.embed_dim(), "/", o.hidden_dim(), "/", o.out_dim());
  // Small rows (fastText-like): each feature's embedding is learnt from
  // scratch, and Adam's steps of ~lr are then large relative to them.
  embedding = register_parameter("embedding", torch::randn({o.buckets(), o.embed_dim()}) * o.init_std());
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.embed_dim()})));
  fc1 = register_module("fc1", torch::nn::Linear(o.embed_dim(), o.hidden_dim()));
  fc2 = register_module("fc2", torch::nn::Linear(o.hidden_dim(), o.out_dim()));
  skip = register_module("skip", torch::nn::Linear(torch::nn::LinearOptions(o.embed_dim(), o.out_dim()).bias(false)));
}

torch::Tensor BagTowerImpl::forward(const std::vector<torch::Tensor>& x) {
  TORCH_CHECK(x.size() == 2, "BagTower::forward(): expected {ids [n, L], weights [n, L]}, but got ", x.size(),
              " tensors");
  const auto& ids = x[0];
  const auto& w = x[1];
  TORCH_CHECK(ids.dim() == 2 && w.sizes() == ids.sizes(), "BagTower::forward(): ids and weights must both be [n, L], "
              "but got ", ids.sizes(), " and ", w.sizes());
  // The weighted sum of the rows' feature embeddings, as a gather and a
  // weighted sum (not F::embedding_bag: this form also serves a rank with
  // zero rows, whose zero gradient the reducer still has to see).
  const int64_t n = ids.size(0), L = ids.size(1);
  auto e = embedding.index_select(0, ids.reshape({-1})).view({n, L, options.embed_dim()});  // [n, L, e]
  auto h = norm->forward((e * w.to(embedding.dtype()).unsqueeze(-1)).sum(1));              // [n, e]
  auto z = skip->forward(h) + fc2->forward(torch::gelu(fc1->forward(h)));                   // [n, out]
  return F::normalize(z, F::NormalizeFuncOptions().dim(1).eps(1e-12));
}

LogitScaleImpl::LogitScaleImpl(double init_log_scale) {
  value = register_parameter("value", torch::full({}, init_log_scale, torch::kFloat));
}

// ---------------------------------------------------------------------------
// BM25

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

// ---------------------------------------------------------------------------
// Metrics and evaluation

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

// ---------------------------------------------------------------------------
// Training

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kMaxTotalSteps = int64_t{1} << 40;
constexpr const char* kRecipe = "retrieval";
constexpr const char* kReducerOp = "gradient all_reduce (DataParallel, in backward)";

std::string dtype_name(torch::Dtype d) { return d == torch::kDouble ? "double" : "float"; }

std::string fmt_duration(double s) {
  if (!(s >= 0) || s > 1e7) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  std::ostringstream o;
  if (t >= 60) o << t / 60 << "m" << std::setw(2) << std::setfill('0');
  o << t % 60 << "s";
  return o.str();
}

void validate(const RetrievalOptions& o, const RetrievalCorpus& c) {
  TORCH_CHECK(o.batch_size() >= 1, "retrieval: batch size must be >= 1, but got ", o.batch_size());
  TORCH_CHECK(o.query_chunk_size() >= 0, "retrieval: query chunk size must be >= 0, but got ", o.query_chunk_size());
  TORCH_CHECK(o.hard_negatives() >= 0 && o.hard_negatives() <= 64,
              "retrieval: hard negatives must be in [0, 64], but got ", o.hard_negatives());
  TORCH_CHECK(o.temperature() > 0, "retrieval: temperature must be > 0, but got ", o.temperature());
  TORCH_CHECK(o.dtype() == torch::kFloat || o.dtype() == torch::kDouble, "retrieval: dtype must be float or double");
  TORCH_CHECK(!c.train.empty(), "retrieval: the training split is empty");
  TORCH_CHECK(!o.resume() || !o.run_dir().empty(), "retrieval: resuming needs a run directory");
}

void check_resumable(const std::string& file, const RetrievalOptions& o, int64_t train_size, int64_t total,
                     int64_t world) {
  Checkpoint saved;
  saved.load(file);
  TORCH_CHECK(saved.strings["recipe"] == kRecipe, "checkpoint ", file, " is of recipe '", saved.strings["recipe"],
              "', not '", kRecipe, "'");
  TORCH_CHECK(saved.ints["batch_size"] == o.batch_size() && saved.ints["seed"] == static_cast<int64_t>(o.seed()) &&
                  saved.ints["dataset_size"] == train_size && saved.ints["total_steps"] == total &&
                  saved.ints["hard_negatives"] == o.hard_negatives(),
              "checkpoint ", file, " was written by a run with batch size ", saved.ints["batch_size"], ", seed ",
              saved.ints["seed"], ", ", saved.ints["dataset_size"], " examples, ", saved.ints["total_steps"],
              " steps, ", saved.ints["hard_negatives"], " hard negatives; this run has ", o.batch_size(), ", ",
              o.seed(), ", ", train_size, ", ", total, ", ", o.hard_negatives(), " (resume with the same flags)");
  TORCH_CHECK(saved.strings["dtype"] == dtype_name(o.dtype()), "checkpoint ", file, " was written with --dtype ",
              saved.strings["dtype"], "; this run has --dtype ", dtype_name(o.dtype()), " (resume with the same flags)");
  TORCH_CHECK(saved.ints["world_size"] == world, "checkpoint ", file, " was written by a run of ",
              saved.ints["world_size"], " processes; this run has ", world,
              " (resume with the same number of processes)");
}

torch::Tensor gradient_sum(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> sums;
  for (const auto& p : params) {
    if (p.grad().defined()) sums.push_back(p.grad().sum(torch::kDouble));
  }
  return sums.empty() ? torch::zeros({}, torch::kDouble) : torch::stack(sums).sum();
}

}  // namespace

int64_t retrieval_total_steps(const RetrievalOptions& o, int64_t n) {
  if (o.max_steps() > 0) {
    TORCH_CHECK(o.max_steps() <= kMaxTotalSteps, "max_steps must be <= 2^40, but got ", o.max_steps());
    return o.max_steps();
  }
  TORCH_CHECK(o.batch_size() >= 1, "batch size must be >= 1, but got ", o.batch_size());
  const int64_t per_epoch = n / o.batch_size() + (n % o.batch_size() != 0);
  const int64_t epochs = std::max<int64_t>(1, o.epochs());
  TORCH_CHECK(epochs <= kMaxTotalSteps / std::max<int64_t>(1, per_epoch), "epochs x steps per epoch (", epochs, " x ",
              per_epoch, ") must be <= 2^40 steps");
  return epochs * per_epoch;
}

void build_towers(const RetrievalOptions& o, BagTower& qt, BagTower& pt, LogitScale& scale) {
  // Seeded construction under a lock: ranks that are threads of one process
  // (tests) must not interleave their draws from the global generator.
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> lock(init_mutex);
  torch::manual_seed(o.seed());
  qt = BagTower(o.query_tower());
  pt = BagTower(o.passage_tower());
  scale = LogitScale(std::log(1.0 / o.temperature()));
  qt->to(o.dtype());
  pt->to(o.dtype());
  scale->to(o.dtype());
}

RetrievalTrainResult train_retrieval(const CommunicatorPtr& comm_in, const RetrievalCorpus& corpus,
                                     const RetrievalOptions& o) {
  CommunicatorPtr comm = comm_in ? comm_in : Communicator::single();
  const int64_t rank = comm->rank(), world = comm->world_size();
  validate(o, corpus);
  const int64_t T = static_cast<int64_t>(corpus.train.size());
  const int64_t total = retrieval_total_steps(o, T);
  const int64_t g = 1 + o.hard_negatives();
  ShardedSampler sampler(T, ShardedSamplerOptions().global_batch_size(o.batch_size()).world_size(world).seed(o.seed()));

  BagTower qt{nullptr}, pt{nullptr};
  LogitScale scale{nullptr};
  build_towers(o, qt, pt, scale);
  std::vector<torch::Tensor> params;
  for (auto* m : std::vector<torch::nn::Module*>{qt.get(), pt.get(), scale.get()}) {
    for (const auto& p : m->parameters()) params.push_back(p);
  }
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(o.lr()).weight_decay(o.weight_decay()));
  const auto sched =
      WarmupCosineOptions().base_lr(o.lr()).warmup_steps(std::min(o.warmup_steps(), total)).total_steps(total);

  Checkpoint ckpt;
  ckpt.module("query_tower", *qt)
      .module("passage_tower", *pt)
      .module("logit_scale", *scale)
      .optimizer("adamw", optimizer)
      .generator("cpu", at::detail::getDefaultCPUGenerator());
  int64_t start = 0;
  const std::string ckpt_file = o.run_dir().empty() ? "" : checkpoint_path(o.run_dir());
  if (o.resume()) {
    check_resumable(ckpt_file, o, T, total, world);
    ckpt.load(ckpt_file);
    start = ckpt.ints["step"];
  }
  auto save = [&](int64_t step) {
    if (ckpt_file.empty() || rank != 0) return;
    const auto pos = sampler.position(step);
    ckpt.ints = {{"step", step},
                 {"epoch", pos.epoch},
                 {"step_in_epoch", pos.step},
                 {"batch_size", o.batch_size()},
                 {"seed", static_cast<int64_t>(o.seed())},
                 {"dataset_size", T},
                 {"total_steps", total},
                 {"world_size", world},
                 {"hard_negatives", o.hard_negatives()}};
    ckpt.strings = {{"recipe", kRecipe}, {"dtype", dtype_name(o.dtype())}};
    ckpt.doubles = {{"lr", o.lr()}, {"temperature", o.temperature()}};
    std::ostringstream meta;
    meta << "{\"recipe\":\"" << kRecipe << "\",\"step\":" << step << ",\"total_steps\":" << total << "}";
    ckpt.metadata = meta.str();
    ckpt.save(ckpt_file);
  };

  // One DataParallel per tower and one for the scale: the gradient cache arms
  // each tower's reducer for its own last chunk and the scale's for the loss.
  auto dpq = std::make_shared<DataParallel>(qt, comm);
  auto dpp = std::make_shared<DataParallel>(pt, comm);
  auto dps = std::make_shared<DataParallel>(scale, comm);
  std::shared_ptr<GradCache> gc;
  if (o.query_chunk_size() > 0) {
    const int64_t pchunk = o.passage_chunk_size() > 0 ? o.passage_chunk_size() : o.query_chunk_size() * g;
    gc = std::make_shared<GradCache>(
        std::vector<GradCacheEncoder>{GradCacheEncoder(qt, o.query_chunk_size()).data_parallel(dpq).name("queries"),
                                      GradCacheEncoder(pt, pchunk).data_parallel(dpp).name("passages")},
        [](const std::vector<torch::Tensor>&) -> torch::Tensor {
          TORCH_INTERNAL_ASSERT(false, "the retrieval step passes its loss to GradCache::finish");
        },
        GradCacheOptions().loss_data_parallel(dps));
  }

  std::unique_ptr<MetricsWriter> metrics;
  if (rank == 0 && !o.run_dir().empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.run_dir(), ec);
    TORCH_CHECK(!ec, "cannot create run directory '", o.run_dir(), "/': ", ec.message());
    metrics = std::make_unique<MetricsWriter>(metrics_path(o.run_dir()), o.resume() ? start : -1);
  }
  auto log = [&](const std::string& line) {
    if (o.log()) {
      o.log()(line);
    } else {
      std::cout << line << std::flush;
    }
  };

  RetrievalTrainResult result;
  result.start_step = start;
  result.total_steps = total;
  const auto t0 = Clock::now();
  const int64_t bytes0 = comm->stats().total_bytes_sent();
  int64_t step = start, examples = 0;
  std::string write_error;
  auto checked = [&](const std::function<void()>& write) {
    if (!write_error.empty()) return;
    try {
      write();
    } catch (const std::exception& e) {
      const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
      write_error = ce != nullptr ? ce->what_without_backtrace() : e.what();
      std::cerr << "contrax train: " << write_error << "; stopping at the next step boundary\n" << std::flush;
    }
  };
  for (; step < total; ++step) {
    const bool want_stop = (o.stop_requested() && o.stop_requested()()) ||
                           (o.stop_at_step() >= 0 && step >= o.stop_at_step()) || !write_error.empty();
    auto flag = torch::full({1}, want_stop ? 1.0 : 0.0, torch::kDouble);
    comm->all_reduce_sum(flag, "stop_flag");
    if (flag.item<double>() > 0) {
      result.interrupted = true;
      break;
    }
    const int64_t step_bytes0 = comm->stats().total_bytes_sent();
    const auto pos = sampler.position(step);
    const auto idx = sampler.local_indices(pos.epoch, pos.step, rank);
    std::vector<int64_t> rows(idx.data_ptr<int64_t>(), idx.data_ptr<int64_t>() + idx.numel());
    const auto negs = sample_hard_negatives(corpus, rows, o.hard_negatives(), o.seed(), pos.epoch);
    std::vector<int64_t> qsyn, csyn, qlab, clab;
    for (size_t k = 0; k < rows.size(); ++k) {
      const int64_t s = corpus.train[rows[k]];
      qsyn.push_back(s);
      csyn.push_back(s);
      for (int64_t j = 0; j < o.hard_negatives(); ++j) csyn.push_back(corpus.train[negs[k * o.hard_negatives() + j]]);
    }
    for (auto s : qsyn) qlab.push_back(corpus.passage_id[s]);
    for (auto s : csyn) clab.push_back(corpus.passage_id[s]);
    const auto qx = feature_batch(corpus.query_features, qsyn, o.dtype());
    const auto px = feature_batch(corpus.passage_features, csyn, o.dtype());
    const auto lopts = GroupedLossOptions()
                           .comm(comm)
                           .labels(torch::tensor(qlab, torch::kLong).reshape({-1}))
                           .candidate_labels(torch::tensor(clab, torch::kLong).reshape({-1}))
                           .label_mode(LabelMode::kMaskDuplicates);
    const double lr = warmup_cosine_lr(step, sched);
    set_learning_rate(optimizer, lr);
    optimizer.zero_grad();
    torch::Tensor loss;
    if (gc) {
      gc->cache(size_t{0}, qx);
      gc->cache(size_t{1}, px);
      with_collective_context(*comm, kReducerOp, [&] {
        loss = gc->finish([&](const std::vector<torch::Tensor>& r) {
          return grouped_loss(r[0], r[1], scale->value, c10::nullopt, lopts);
        });
      });
    } else {
      auto q = dpq->forward([&] { return qt->forward(qx); });      // [b_r, d]
      auto p = dpp->forward([&] { return pt->forward(px); });      // [b_r * g, d]
      auto s = dps->forward([&] { return scale->forward(); });     // 0-dim log scale
      loss = grouped_loss(q, p, s, c10::nullopt, lopts);
      with_collective_context(*comm, kReducerOp, [&] { loss.backward(); });
    }
    auto lt = torch::stack({loss.detach().to(torch::kDouble).reshape({}), gradient_sum(params)});
    comm->all_reduce_sum(lt, "loss");
    // grouped_loss returns L_r = (W / B) * (sum of this rank's per-query
    // losses), as clip_loss does: the global mean loss is the mean over ranks.
    const double gloss = lt[0].item<double>() / static_cast<double>(world);
    const bool finite = std::isfinite(gloss) && std::isfinite(lt[1].item<double>());
    if (finite) {
      optimizer.step();
    } else {
      ++result.skipped_steps;
    }
    result.losses.push_back(gloss);
    examples += sampler.global_batch_rows(pos.step);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    const double eps = elapsed > 0 ? examples / elapsed : 0;
    if (rank == 0) {
      if (metrics) {
        StepMetrics m;
        m.step = step + 1;
        m.epoch = pos.epoch + 1;
        m.step_in_epoch = pos.step + 1;
        m.rows = sampler.global_batch_rows(pos.step);
        m.loss = gloss;
        m.lr = lr;
        m.examples_per_s = eps;
        m.elapsed_s = elapsed;
        m.bytes_sent = comm->stats().total_bytes_sent() - step_bytes0;
        m.applied = finite;
        checked([&] { metrics->write(m); });
      }
      const int64_t done = step + 1 - start;
      if (o.log_every() > 0 && (done % o.log_every() == 0 || step + 1 == total || done == 1 || !finite)) {
        const double eta = elapsed / done * (total - step - 1);
        std::ostringstream line;
        line << "step " << step + 1 << "/" << total << "  epoch " << pos.epoch + 1 << " (" << pos.step + 1 << "/"
             << sampler.steps_per_epoch() << ")  loss " << std::fixed << std::setprecision(4) << gloss << "  scale "
             << std::setprecision(1) << std::exp(scale->value.item<double>()) << "  lr " << std::scientific
             << std::setprecision(2) << lr << std::fixed << std::setprecision(0) << "  " << eps << " q/s  ETA "
             << fmt_duration(eta);
        if (sampler.global_batch_rows(pos.step) < o.batch_size()) {
          line << "  (short batch: " << sampler.global_batch_rows(pos.step) << " rows)";
        }
        if (!finite) line << "  NOT APPLIED: non-finite " << (std::isfinite(gloss) ? "gradient" : "loss");
        checked([&] { log(line.str() + "\n"); });
      }
    }
    if (!finite && result.skipped_steps > o.skip_nonfinite()) {
      TORCH_CHECK(false, "training diverged at step ", step + 1, "/", total, ": the ",
                  std::isfinite(gloss) ? "gradient" : "loss", " is not finite (loss ", gloss, ", lr ", lr, "); ",
                  ckpt_file.empty() ? std::string("nothing was saved")
                                    : "the last good checkpoint " + ckpt_file + " is kept (if one was written)",
                  "; lower --lr or allow skipping with --skip-nonfinite N");
    }
    if (o.checkpoint_every() > 0 && (step + 1) % o.checkpoint_every() == 0 && step + 1 < total) save(step + 1);
  }
  result.steps = step;
  result.train_s = std::chrono::duration<double>(Clock::now() - t0).count();
  result.examples_per_s = result.train_s > 0 ? examples / result.train_s : 0;
  result.epochs_done = step > 0 ? sampler.position(step - 1).epoch + 1 : 0;
  result.bytes_sent = comm->stats().total_bytes_sent() - bytes0;
  try {
    if (step > start || !o.resume()) save(step);
  } catch (const c10::Error& e) {
    if (write_error.empty()) throw;
    TORCH_CHECK(false, write_error, "; the run stopped at step ", step, "/", total,
                " but its checkpoint could not be written either: ", e.what_without_backtrace());
  }
  comm->barrier();
  TORCH_CHECK(write_error.empty(), write_error, "; the run stopped at step ", step, "/", total,
              ckpt_file.empty() ? std::string() : " with checkpoint " + ckpt_file, " (free space, then --resume)");
  qt->eval();
  pt->eval();
  result.query_tower = qt;
  result.passage_tower = pt;
  result.logit_scale = std::exp(scale->value.item<double>());
  return result;
}

}  // namespace train
}  // namespace contrax
