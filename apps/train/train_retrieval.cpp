// `contrax train retrieval`: the two-tower WordNet reverse dictionary
// (contrax/train/retrieval/trainer.h), then the held-out ranking of every
// system on one evaluation set: the trained towers, the towers it started
// from, and BM25 on words and on character n-grams (the stronger on
// recall@10 is the lexical baseline).
#include <chrono>
#include <iomanip>
#include <limits>
#include <ostream>
#include <sstream>

#include "cli/flags.h"
#include "contrax/train/retrieval/eval.h"
#include "contrax/train/retrieval/trainer.h"
#include "train/train_retrieval.h"

namespace contrax::cli {

namespace {

namespace ct = contrax::train;

Json metrics_json(const ct::RetrievalMetrics& m) {
  Json j;
  put_number(j, "recall_at_1", m.recall_at_1);
  put_number(j, "recall_at_10", m.recall_at_10);
  put_number(j, "mrr", m.mrr);
  return j;
}

class RetrievalRecipe : public TrainRecipe {
 public:
  ct::RunOptions& run() override { return o_.run(); }
  double temperature() const override { return o_.temperature(); }

  void add_flags(CLI::App& app) override {
    add_int(app, "--chunk-size", o_.query_chunk_size(), "> 0: gradient cache with chunks of this many queries", 0,
            kMaxBatch);
    add_double(app, "--temperature", o_.temperature(), "initial temperature (the logit scale is learnt)", 0,
               std::numeric_limits<double>::max(), true);
    add_int(app, "--hard-negatives", o_.hard_negatives(), "hard-negative passages per query", 0, 64);
    add_int(app, "--passage-chunk-size", o_.passage_chunk_size(),
            "gradient-cache chunk of passages (0: --chunk-size x (1 + hard negatives))", 0, kMaxBatch);
    add_choice(app, "--query-features", query_features_,
               "gloss features: word uni/bigrams, or those plus character 3-5-grams", {"words", "words+chargrams"});
    add_int(app, "--buckets", buckets_, "hash buckets of each tower's feature embedding", 2, int64_t{1} << 26);
    add_int(app, "--embed-dim", embed_dim_, "width of the feature embeddings", 1, 1 << 16);
    add_int(app, "--out-dim", out_dim_, "width of the towers' output embeddings", 1, 1 << 16);
    app.add_option("--wordnet", wordnet_dir_, "directory of the WordNet data files (Debian wordnet-base)");
    add_choice(app, "--scorer", scorer_,
               "dot: one pooled embedding per text; maxsim: one per word, late interaction (ColBERT's MaxSim)",
               {"dot", "maxsim"});
    app.add_option("--matryoshka", matryoshka_,
                   "dot scorer: Matryoshka prefix widths, comma-separated and increasing (e.g. 32,64; the output "
                   "width is always one), trained together and each evaluated");
  }

  void check_flags() override {
    o_.query_tower(ct::BagTowerOptions(o_.query_tower()).buckets(buckets_).embed_dim(embed_dim_).out_dim(out_dim_))
        .passage_tower(
            ct::BagTowerOptions(o_.passage_tower()).buckets(buckets_).embed_dim(embed_dim_).out_dim(out_dim_));
    auto dims = matryoshka_.empty() ? std::vector<int64_t>() : parse_int_list("--matryoshka", matryoshka_, 1, out_dim_);
    for (size_t k = 1; k < dims.size(); ++k) {
      usage_check(dims[k] > dims[k - 1], "flag '--matryoshka' must be strictly increasing widths, but got '",
                  matryoshka_, "'");
    }
    if (!dims.empty() && dims.back() < out_dim_) dims.push_back(out_dim_);  // the loss adds it anyway
    o_.matryoshka_dims(dims);
    o_.scorer(scorer_ == "maxsim" ? ct::RetrievalScorer::kMaxSim : ct::RetrievalScorer::kDot);
    if (scorer_ != "maxsim") return;
    usage_check(dims.empty(), "flag '--matryoshka' applies to --scorer dot only (MaxSim scores words, not prefixes)");
    usage_check(o_.query_chunk_size() == 0 && o_.passage_chunk_size() == 0,
                "flags '--chunk-size' and '--passage-chunk-size' apply to --scorer dot only (MaxSim does not run "
                "through the gradient cache), but got ", o_.query_chunk_size(), " and ", o_.passage_chunk_size());
  }

  void settings(Json& s) const override {
    s["wordnet"] = wordnet_dir_;
    s["chunk_size"] = o_.query_chunk_size();
    s["passage_chunk_size"] = o_.passage_chunk_size();
    s["hard_negatives"] = o_.hard_negatives();
    s["temperature"] = o_.temperature();
    s["query_features"] = query_features_;
    s["scorer"] = scorer_;
    s["matryoshka"] = o_.matryoshka_dims();
    for (const auto& [name, t] : {std::pair<const char*, ct::BagTowerOptions>{"query_tower", o_.query_tower()},
                                  {"passage_tower", o_.passage_tower()}}) {
      s[name] = {{"buckets", t.buckets()},
                 {"embed_dim", t.embed_dim()},
                 {"hidden_dim", t.hidden_dim()},
                 {"out_dim", t.out_dim()}};
    }
  }

  int64_t load(const TrainToolFlags& f) override {
    const auto copts = ct::RetrievalCorpusOptions()
                           .query_buckets(o_.query_tower().buckets())
                           .passage_buckets(o_.passage_tower().buckets())
                           .train_limit(f.train_limit)
                           .query_chargrams(query_features_ == "words+chargrams")
                           .token_features(o_.scorer() == ct::RetrievalScorer::kMaxSim);
    corpus_ = ct::make_retrieval_corpus(ct::load_wordnet(wordnet_dir_), copts);
    return static_cast<int64_t>(corpus_.train.size());
  }

  std::string data_hint() const override {
    return " (install Debian's 'wordnet-base' package: apt-get install wordnet-base; or pass --wordnet DIR)";
  }

  std::string what() const override {
    return c10::str("retrieval (WordNet reverse dictionary) on ", corpus_.train.size(), " training synsets of ",
                    wordnet_dir_, " (", corpus_.heldout.size(), " held out)");
  }

  std::string batch() const override {
    const int64_t h = o_.hard_negatives(), g = 1 + h, q = o_.query_chunk_size();
    const int64_t p = o_.passage_chunk_size() > 0 ? o_.passage_chunk_size() : q * g;
    return c10::str(o_.run().batch_size(), " queries x ", g, " passages (", h, " hard negative", h == 1 ? "" : "s",
                    ")", q > 0 ? c10::str(", gradient cache chunks of ", q, " queries / ", p, " passages") : "");
  }

  train::RunResult train(const CommunicatorPtr& comm) override {
    result_ = ct::train_retrieval(comm, corpus_, o_);
    return result_;
  }

  void summarize(Json& s) const override {
    s["chunk_size"] = o_.query_chunk_size();
    s["hard_negatives"] = o_.hard_negatives();
    s["scorer"] = scorer_;
    put_number(s, "logit_scale", result_.logit_scale);
  }

  double evaluate(const TrainToolFlags& f, Json& s, std::ostream& out, const EvalProgress& progress) override {
    const auto e0 = std::chrono::steady_clock::now();
    // One protocol, one evaluation set, for every system.
    progress("building the evaluation set");
    const auto set = ct::make_eval_set(corpus_, f.eval_limit);
    progress("trained towers (1/4)");
    // Matryoshka: every prefix width (the last the full width) from one embedding.
    const auto prefixes = o_.matryoshka_dims().empty()
                              ? std::vector<ct::RetrievalMetrics>()
                              : ct::evaluate_towers_at_widths(result_.query_tower, result_.passage_tower, corpus_,
                                                              set, o_.matryoshka_dims());
    const auto trained =
        prefixes.empty() ? towers_metrics(result_.query_tower, result_.passage_tower, set) : prefixes.back();
    ct::BagTower q0{nullptr}, p0{nullptr};
    ct::LogitScale s0{nullptr};
    ct::build_towers(o_, q0, p0, s0);  // the towers this run started from
    progress("random init (2/4)");
    const auto random_init = towers_metrics(q0, p0, set);
    progress("BM25 on words (3/4)");
    const auto word = ct::evaluate_bm25(corpus_, set, "word");
    progress("BM25 on character n-grams (4/4)");
    const auto chargram = ct::evaluate_bm25(corpus_, set, "chargram");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
    // The lexical baseline is the stronger BM25 variant on recall@10.
    const bool char_wins = chargram.recall_at_10 > word.recall_at_10;
    const ct::RetrievalMetrics& lexical = char_wins ? chargram : word;
    for (const auto& [prefix, m] : {std::pair<std::string, const ct::RetrievalMetrics&>{"", trained},
                                    {"lexical_", lexical},
                                    {"random_init_", random_init}}) {
      put_number(s, prefix + "recall_at_1", m.recall_at_1);
      put_number(s, prefix + "recall_at_10", m.recall_at_10);
      put_number(s, prefix + "mrr", m.mrr);
    }
    put_number(s, "eval_s", seconds);
    s["evaluation"] = {{"queries", set.query_synsets.size()},
                       {"passages", set.passage_synsets.size()},
                       {"lexical", char_wins ? "bm25_chargram" : "bm25_word"},
                       {"trained_towers", metrics_json(trained)},
                       {"random_init_towers", metrics_json(random_init)},
                       {"bm25_word", metrics_json(word)},
                       {"bm25_chargram", metrics_json(chargram)}};
    Json widths = Json::array();
    for (size_t k = 0; k < prefixes.size(); ++k) {
      Json m = metrics_json(prefixes[k]);
      m["dim"] = o_.matryoshka_dims()[k];
      widths.push_back(m);
    }
    if (!prefixes.empty()) s["matryoshka"] = s["evaluation"]["matryoshka"] = widths;
    out << "\nheld-out retrieval: " << set.query_synsets.size() << " glosses ranked against "
        << set.passage_synsets.size() << " distinct held-out lemma lists (ties broken at random, in expectation)\n";
    out << std::left << std::setw(42) << "system" << std::setw(12) << "recall@1" << std::setw(12) << "recall@10"
        << "MRR\n";
    auto row = [&out](const std::string& name, const ct::RetrievalMetrics& m) {
      out << std::left << std::setw(42) << name << std::fixed << std::setprecision(4) << std::setw(12)
          << m.recall_at_1 << std::setw(12) << m.recall_at_10 << m.mrr << "\n";
    };
    const std::string trained_name = o_.scorer() == ct::RetrievalScorer::kMaxSim ? "trained towers (MaxSim)"
                                                                                   : "trained towers";
    for (size_t k = 0; k + 1 < prefixes.size(); ++k) {
      row(c10::str("trained towers, first ", o_.matryoshka_dims()[k], " dims"), prefixes[k]);
    }
    row(prefixes.empty() ? trained_name : c10::str("trained towers, all ", out_dim_, " dims"), trained);
    row("random-init towers", random_init);
    row(std::string("BM25, words") + (char_wins ? "" : " (lexical baseline)"), word);
    row(std::string("BM25, char 3-5-grams") + (char_wins ? " (lexical baseline)" : ""), chargram);
    return seconds;
  }

  // The towers' ranking by the run's scorer.
  ct::RetrievalMetrics towers_metrics(ct::BagTower q, ct::BagTower p, const ct::RetrievalEvalSet& set) const {
    return o_.scorer() == ct::RetrievalScorer::kMaxSim ? ct::evaluate_token_towers(q, p, corpus_, set)
                                                       : ct::evaluate_towers(q, p, corpus_, set);
  }

  std::string rate_note() const override {
    std::ostringstream s;
    s << "queries/s; learnt logit scale " << std::fixed << std::setprecision(1) << result_.logit_scale << "; ";
    return s.str();
  }

 private:
  ct::RetrievalOptions o_;
  std::string wordnet_dir_ = ct::kDefaultWordNetDir;
  std::string query_features_ = "words+chargrams";
  int64_t buckets_ = ct::RetrievalOptions().query_tower().buckets();
  int64_t embed_dim_ = ct::RetrievalOptions().query_tower().embed_dim();
  int64_t out_dim_ = ct::RetrievalOptions().query_tower().out_dim();
  std::string scorer_ = "dot";
  std::string matryoshka_;
  ct::RetrievalCorpus corpus_;
  ct::RetrievalTrainResult result_;
};

}  // namespace

std::unique_ptr<TrainRecipe> make_retrieval_recipe() { return std::make_unique<RetrievalRecipe>(); }

}  // namespace contrax::cli
