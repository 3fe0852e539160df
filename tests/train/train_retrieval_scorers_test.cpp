// The retrieval recipe's scorers beyond one pooled dot product: the per-word
// features and towers of MaxSim, its chunked evaluation against the
// reference's einsum, Matryoshka prefixes at evaluation, the trainer with
// either (world-size independence in fp64 with empty ranks, resume, the
// errors) and the CLI's flags, errors and JSON.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "contrax/losses/reference.h"
#include "contrax/train/retrieval/eval.h"
#include "contrax/train/retrieval/towers.h"
#include "contrax/train/retrieval/trainer.h"
#include "contrax/train/retrieval/wordnet.h"
#include "support/cli.h"
#include "support/errors.h"
#include "support/processes.h"
#include "support/ranks.h"
#include "support/retrieval_runs.h"

namespace ct = contrax::train;
using namespace contrax::testing;  // NOLINT: the suite's helpers (errors, runs, scratch directories)

namespace {

std::vector<int64_t> sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int64_t> flat(const std::vector<std::vector<int64_t>>& tokens) {
  std::vector<int64_t> out;
  for (const auto& t : tokens) out.insert(out.end(), t.begin(), t.end());
  return out;
}

ct::RetrievalOptions maxsim_options() { return small_options().scorer(ct::RetrievalScorer::kMaxSim); }

ct::RetrievalOptions matryoshka_options() { return small_options().matryoshka_dims({2, 4, 8}); }

}  // namespace

TEST(RetrievalTokens, EachWordItsOwnBagOfThePooledFeatures) {
  const std::string text = "Sloping land, beside a river";
  const auto q = ct::query_token_features(text, 1000, 256, false);
  ASSERT_EQ(q.size(), 5u);
  EXPECT_EQ(q[0].size(), 2u);  // the word and the bigram after it
  EXPECT_EQ(q[2].size(), 3u);  // the word and both its bigrams
  // The bigrams of the pooled bag, each in both of its words' bags.
  auto pooled = ct::query_features(text, 1000, 256, false);
  auto both = pooled;
  both.insert(both.end(), pooled.begin() + 5, pooled.end());
  EXPECT_EQ(sorted(flat(q)), sorted(both));
  // Character n-grams per word: the pooled passage features, split by word.
  EXPECT_EQ(sorted(flat(ct::passage_token_features(text, 1000, 3, 5, 256))),
            sorted(ct::passage_features(text, 1000, 3, 5, 256)));
  const auto qc = ct::query_token_features(text, 1000, 256, true);
  EXPECT_EQ(qc[1].size(), q[1].size() + ct::passage_features("land", 1000, 3, 5, 256).size());
  // Caps, and a text without words: one token without features.
  EXPECT_EQ(ct::query_token_features(text, 1000, 256, false, 3, 5, 2).size(), 2u);
  EXPECT_EQ(ct::query_token_features(text, 1000, 1, true)[2].size(), 1u);
  EXPECT_EQ(ct::passage_token_features("--", 1000, 3, 5, 256), std::vector<std::vector<int64_t>>(1));
  EXPECT_NE(error_of([] { ct::query_token_features("a", 1, 8); }).find("query_token_features(): argument 'buckets' "
                                                                        "must be >= 2, but got 1"),
            std::string::npos);
}

TEST(RetrievalTokens, BatchPadsTokensAndFeaturesAndMasksTheTokens) {
  const auto c = synthetic_corpus(12, true);
  ASSERT_EQ(c.query_tokens.rows(), 12);
  EXPECT_EQ(c.query_features.rows(), 12);
  EXPECT_EQ(c.query_tokens.size(0), 5);    // "gloss 0 of 0 thing"
  EXPECT_EQ(c.passage_tokens.size(0), 2);  // "w0, v0"
  const auto b = ct::token_feature_batch(c.query_tokens, {3, 0}, torch::kDouble);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0].sizes(), b[1].sizes());
  EXPECT_EQ(b[0].size(0), 10);  // the tokens that exist
  EXPECT_EQ(b[3].sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_TRUE(b[3].all().item<bool>());
  // Each token a mean bag: its weights sum to 1.
  EXPECT_TRUE(torch::allclose(b[1].sum(1), torch::ones({10}, torch::kDouble)));
  const auto pb = ct::token_feature_batch(c.passage_tokens, {5}, torch::kFloat);
  EXPECT_EQ(pb[3].sizes(), (std::vector<int64_t>{1, 2}));
  // Rows with fewer tokens: their padding slots are masked and not embedded.
  ct::TokenBags bags;
  bags.features.values = {7, 8, 9};
  bags.features.offsets = {0, 1, 3, 3};
  bags.offsets = {0, 1, 3};
  const auto p = ct::token_feature_batch(bags, {0, 1});
  EXPECT_TRUE(torch::equal(p[0], torch::tensor({7, 0, 8, 9, 0, 0}, torch::kLong).view({3, 2})));
  EXPECT_TRUE(torch::equal(p[2], torch::tensor({0, 2, 3}, torch::kLong)));
  EXPECT_TRUE(torch::equal(p[3], torch::tensor({true, false, true, true}).view({2, 2})));
  EXPECT_EQ(p[1][2].sum().item<float>(), 0.0f);  // the featureless token
  const auto none = ct::token_feature_batch(bags, {});
  EXPECT_EQ(none[2].numel(), 0);
  EXPECT_EQ(none[3].sizes(), (std::vector<int64_t>{0, 1}));
  EXPECT_NE(error_of([&] { ct::token_feature_batch(bags, {2}); }).find("row 2 out of range [0, 2)"),
            std::string::npos);
}

TEST(RetrievalTokens, TowerEmbedsEveryTokenAsItsOwnBag) {
  torch::manual_seed(0);
  ct::BagTower t(ct::BagTowerOptions(256).embed_dim(8).hidden_dim(8).out_dim(4));
  const auto c = synthetic_corpus(12, true);
  const auto b = ct::token_feature_batch(c.query_tokens, {3, 0}, torch::kFloat);
  auto z = t->forward(b);
  ASSERT_EQ(z.sizes(), (std::vector<int64_t>{2, 5, 4}));
  EXPECT_TRUE(torch::allclose(z[1][2], t->forward({b[0][7].unsqueeze(0), b[1][7].unsqueeze(0)})[0]));
  // A padding slot is zero.
  ct::TokenBags bags;
  bags.features.values = {7, 8, 9};
  bags.features.offsets = {0, 1, 2, 3};
  bags.offsets = {0, 1, 3};
  const auto zp = t->forward(ct::token_feature_batch(bags, {0, 1}));
  EXPECT_TRUE(torch::equal(zp[0][1], torch::zeros({4})));
  EXPECT_TRUE(torch::allclose(zp[1][1], t->forward({torch::tensor({{9L}}), torch::ones({1, 1})})[0]));
  EXPECT_NE(error_of([&] { t->forward({b[0], b[1], b[2]}); }).find("but got 3 tensors"), std::string::npos);
  EXPECT_NE(error_of([&] { t->forward({b[0], b[1], b[2].narrow(0, 0, 3), b[3]}); }).find("need slots [N]"),
            std::string::npos);
}

TEST(RetrievalEval, MaxSimScoresEqualTheReferenceInAnyChunks) {
  torch::manual_seed(1);
  auto q = torch::randn({7, 5, 6}, torch::kDouble), p = torch::randn({9, 4, 6}, torch::kDouble);
  auto qm = torch::rand({7, 5}) > 0.3, pm = torch::rand({9, 4}) > 0.4;
  pm.select(1, 0).fill_(true);  // every passage a valid token
  const auto want = contrax::reference::maxsim_scores(q, qm, p, pm);
  for (int64_t bytes : {int64_t{1}, int64_t{2000}, int64_t{64} << 20}) {
    EXPECT_LT(rel_err(ct::maxsim_score_matrix(q, qm, p, pm, bytes), want), 1e-14) << bytes;
  }
  EXPECT_EQ(ct::maxsim_score_matrix(q.narrow(0, 0, 0), qm.narrow(0, 0, 0), p, pm).sizes(),
            (std::vector<int64_t>{0, 9}));
  pm[3].fill_(false);
  EXPECT_NE(error_of([&] { ct::maxsim_score_matrix(q, qm, p, pm); }).find("every passage needs a valid token"),
            std::string::npos);
}

TEST(RetrievalEval, PrefixWidthsAndMaxSimRankTheSameSet) {
  const auto c = synthetic_corpus(60, true);
  auto held = c;
  held.heldout = std::vector<int64_t>(c.train.begin(), c.train.begin() + 30);
  const auto set = ct::make_eval_set(held);
  ct::BagTower q{nullptr}, p{nullptr};
  ct::LogitScale s{nullptr};
  ct::build_towers(small_options(), q, p, s);
  const auto full = ct::evaluate_towers(q, p, held, set);
  const auto at = ct::evaluate_towers_at_widths(q, p, held, set, {3, 8});
  ASSERT_EQ(at.size(), 2u);
  EXPECT_EQ(at[1].mrr, full.mrr);
  EXPECT_EQ(at[1].recall_at_10, full.recall_at_10);
  EXPECT_EQ(at[0].queries, 30);
  EXPECT_NE(error_of([&] { ct::evaluate_towers_at_widths(q, p, held, set, {9}); })
                .find("every width must be in [1, 8], but got 9"),
            std::string::npos);
  const auto m = ct::evaluate_token_towers(q, p, held, set);
  EXPECT_EQ(m.queries, 30);
  EXPECT_GE(m.mrr, 0.0);
  EXPECT_NE(error_of([&] { ct::evaluate_token_towers(q, p, synthetic_corpus(60), set); }).find("no token features"),
            std::string::npos);
}

TEST(RetrievalScorers, WorldSizesAgreeInDoubleWithUnevenAndEmptyRanks) {
  // As the dot scorer's test: batches of 24, 24 and 1 row (two empty ranks at W = 3).
  const auto c = synthetic_corpus(49, true);
  for (const auto& o : {maxsim_options(), matryoshka_options()}) {
    const auto one = train_world(1, c, o);
    ASSERT_EQ(one.losses.size(), 3u);
    for (double l : one.losses) EXPECT_TRUE(std::isfinite(l));
    expect_same(train_world(2, c, o), one, 1e-9);
    expect_same(train_world(3, c, o), one, 1e-9);
  }
  // The scorers train other models than the dot product's.
  const auto dot = train_world(1, c, small_options());
  EXPECT_NE(train_world(1, c, maxsim_options()).losses[0], dot.losses[0]);
  EXPECT_NE(train_world(1, c, matryoshka_options()).losses[0], dot.losses[0]);
  // Matryoshka through the gradient cache equals one shot.
  expect_same(train_world(2, c, matryoshka_options().query_chunk_size(5)), train_world(2, c, matryoshka_options()),
              1e-9);
}

TEST(RetrievalScorers, ResumeContinuesOnTheSameCurveAndRefusesAnotherScorer) {
  const auto c = synthetic_corpus(49, true);
  for (const auto& base : {maxsim_options(), matryoshka_options()}) {
    const std::string a = scratch_dir("full"), b = scratch_dir("half");
    auto o = ct::RetrievalOptions(base).run(ct::RunOptions(base.run()).max_steps(5).dtype(torch::kFloat));
    auto in = [&](const std::string& dir) { return ct::RunOptions(o.run()).run_dir(dir); };
    const auto full = train_world(2, c, ct::RetrievalOptions(o).run(in(a)));
    train_world(2, c, ct::RetrievalOptions(o).run(in(b).stop_at_step(2)));
    const auto rest = train_world(2, c, ct::RetrievalOptions(o).run(in(b).resume(true)));
    ASSERT_EQ(rest.losses.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.losses[i], full.losses[2 + i]);
    for (size_t i = 0; i < full.params.size(); ++i) EXPECT_TRUE(torch::equal(rest.params[i], full.params[i])) << i;
    // The dot scorer without prefixes may not continue it.
    std::string msg;
    try {
      train_world(2, c, ct::RetrievalOptions(o).scorer(ct::RetrievalScorer::kDot).matryoshka_dims({}).run(
                            in(b).resume(true)));
    } catch (const std::exception& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("(resume with the same settings)"), std::string::npos) << msg;
  }
}

TEST(RetrievalScorers, ErrorsNameTheOption) {
  const auto c = synthetic_corpus(10, true);
  auto err = [&](const ct::RetrievalOptions& o, const ct::RetrievalCorpus& corpus) {
    return error_of([&] { ct::train_retrieval(nullptr, corpus, o); });
  };
  EXPECT_NE(err(small_options().matryoshka_dims({4, 2}), c)
                .find("the Matryoshka widths must be strictly increasing, but got 4 then 2"),
            std::string::npos);
  EXPECT_NE(err(small_options().matryoshka_dims({4, 16}), c)
                .find("every Matryoshka width must be in [1, 8] (the towers' output width), but got 16"),
            std::string::npos);
  EXPECT_NE(err(maxsim_options().query_chunk_size(4), c)
                .find("the MaxSim scorer does not run through the gradient cache, but got query chunk size 4"),
            std::string::npos);
  EXPECT_NE(err(maxsim_options().matryoshka_dims({4}), c).find("the MaxSim scorer takes no Matryoshka prefixes"),
            std::string::npos);
  EXPECT_NE(err(maxsim_options(), synthetic_corpus(10)).find("needs the corpus's token features"), std::string::npos);
  auto wide = small_options();
  wide.passage_tower().out_dim(16);
  EXPECT_NE(err(wide, c).find("the towers' output widths must be equal, but got 8 and 16"), std::string::npos);
}

// ---------------------------------------------------------------------------
// CLI

TEST(RetrievalScorersCli, FlagErrorsExitTwoAndNameTheFlag) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--scorer foo", "flag '--scorer' must be dot or maxsim, but got 'foo'"},
      {"--matryoshka 64,32", "flag '--matryoshka' must be strictly increasing widths, but got '64,32'"},
      {"--matryoshka 32,32", "flag '--matryoshka' must be strictly increasing widths, but got '32,32'"},
      {"--matryoshka 32,256", "flag '--matryoshka': every entry must be in [1, 128], but got 256"},
      {"--out-dim 16 --matryoshka 32", "flag '--matryoshka': every entry must be in [1, 16], but got 32"},
      {"--matryoshka 0,64", "flag '--matryoshka': every entry must be in [1, 128], but got 0"},
      {"--matryoshka 32,x", "flag '--matryoshka' must be comma-separated integers, but got '32,x'"},
      {"--out-dim 0", "flag '--out-dim' must be >= 1, but got 0"},
      {"--scorer maxsim --matryoshka 32", "flag '--matryoshka' applies to --scorer dot only"},
      {"--scorer maxsim --chunk-size 64", "flags '--chunk-size' and '--passage-chunk-size' apply to --scorer dot only"},
      {"--scorer maxsim --passage-chunk-size 8", "apply to --scorer dot only (MaxSim does not run through the "
                                                 "gradient cache), but got 0 and 8"},
  };
  for (const auto& [flags, message] : cases) {
    auto r = run_cli("train --recipe retrieval " + flags);
    EXPECT_EQ(r.status, 2) << flags << ": " << r.out;
    EXPECT_NE(r.out.find(message), std::string::npos) << flags << ": " << r.out;
  }
}

TEST(RetrievalScorersCli, JsonCarriesTheScorersMetricsAndConfigTheirSettings) {
  if (!have_wordnet()) GTEST_SKIP() << "Debian's wordnet-base is not installed (tools/setup.sh installs it)";
  for (const std::string flags : {"--scorer maxsim", "--matryoshka 32,64"}) {
    const std::string d = scratch_dir("cli_scorer");
    auto r = run_cli_stdout(std::string(kFast) + " --max-steps 3 --json " + flags + " --run-dir " + d);
    ASSERT_EQ(r.status, 0) << r.out;
    std::string last = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
    const auto s = nlohmann::json::parse(last.substr(last.rfind('\n') + 1));
    for (const char* k : {"recall_at_1", "recall_at_10", "mrr", "lexical_recall_at_10", "random_init_mrr"}) {
      ASSERT_TRUE(s.contains(k) && s[k].is_number()) << k << " in " << r.out;
    }
    const auto config = nlohmann::json::parse(read_file(d + "/config.json"));
    if (flags == "--scorer maxsim") {
      EXPECT_EQ(s["scorer"], "maxsim");
      EXPECT_EQ(config["settings"]["scorer"], "maxsim");
      EXPECT_FALSE(s.contains("matryoshka"));
      continue;
    }
    EXPECT_EQ(config["settings"]["scorer"], "dot");
    EXPECT_EQ(config["settings"]["matryoshka"], nlohmann::json::array({32, 64, 128}));
    ASSERT_TRUE(s.contains("matryoshka") && s["matryoshka"].size() == 3) << r.out;
    EXPECT_EQ(s["matryoshka"][0]["dim"], 32);
    EXPECT_EQ(s["matryoshka"][2]["dim"], 128);
    EXPECT_EQ(s["matryoshka"][2]["mrr"], s["mrr"]);
  }
}

TEST(RetrievalScorersCli, MaxSimResumeGivesTheSameMetricsAsAnUninterruptedRun) {
  if (!have_wordnet()) GTEST_SKIP() << "Debian's wordnet-base is not installed (tools/setup.sh installs it)";
  const std::string a = scratch_dir("cli_ms_full"), b = scratch_dir("cli_ms_half");
  const std::string run = std::string(kFast) + " --scorer maxsim --max-steps 4";
  auto full = run_cli(run + " --run-dir " + a);
  ASSERT_EQ(full.status, 0) << full.out;
  EXPECT_NE(full.out.find("trained towers (MaxSim)"), std::string::npos) << full.out;
  ASSERT_EQ(run_cli(run + " --stop-at-step 2 --run-dir " + b).status, 0);
  auto rest = run_cli(run + " --resume --run-dir " + b);
  ASSERT_EQ(rest.status, 0) << rest.out;
  EXPECT_EQ(losses_of(a + "/metrics.jsonl"), losses_of(b + "/metrics.jsonl"));
  const auto ra = nlohmann::json::parse(read_file(a + "/results.json"));
  const auto rb = nlohmann::json::parse(read_file(b + "/results.json"));
  for (const char* k : {"recall_at_1", "recall_at_10", "mrr"}) EXPECT_EQ(ra[k], rb[k]) << k;
  // The dot scorer may not continue it.
  auto dot = run_cli(std::string(kFast) + " --max-steps 4 --resume --run-dir " + b);
  EXPECT_NE(dot.status, 0);
  EXPECT_NE(dot.out.find("scorer (0: dot, 1: MaxSim)"), std::string::npos) << dot.out;
}
