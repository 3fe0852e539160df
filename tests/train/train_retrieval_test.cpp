// The retrieval recipe: WordNet parsing on a fixture, the corpus (ids, split,
// features, hard negatives), BM25 and the retrieval metrics on hand-computed
// examples, the training loop (world-size independence in fp64 with an empty
// rank, gradient cache = one shot, resume) and the CLI end to end.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "contrax/train/image/trainer.h"
#include "contrax/train/retrieval/bm25.h"
#include "contrax/train/retrieval/eval.h"
#include "contrax/train/retrieval/trainer.h"
#include "contrax/train/retrieval/wordnet.h"
#include "support/cli.h"
#include "support/errors.h"
#include "support/processes.h"
#include "support/ranks.h"
#include "support/retrieval_runs.h"

namespace ct = contrax::train;
using contrax::testing::error_of;

namespace {

// A licence line, three nouns (two sharing the hypernym 00000100, two with the
// same single lemma "bank"), a verb with frames, a head adjective with a
// position marker and its satellite.
const char* kNouns =
    "  1 This software and database is being provided to you, the LICENSEE, by  \n"
    "00000100 03 n 01 entity 0 000 | that which exists  \n"
    "00000200 17 n 02 bank 0 side_of_river 0 001 @ 00000100 n 0000 | sloping land beside a river; \"they pulled "
    "the canoe up on the bank\"  \n"
    "00000300 14 n 01 bank 1 002 @ 00000100 n 0000 + 00000100 v 0101 | a financial institution; \"he cashed a "
    "check at the bank\"; \"that bank holds the mortgage\"  \n"
    "00000400 14 n 01 Bank 2 001 @i 00000100 n 0000 | \"only an example\"  \n";
const char* kVerbs =
    "00000100 29 v 01 breathe 0 001 + 00000300 n 0101 02 + 02 00 + 08 00 | draw air into, and expel out of, the "
    "lungs  \n";
const char* kAdjs =
    "00000100 00 a 01 big(a) 0 001 & 00000200 a 0000 | above average in size  \n"
    "00000200 00 s 02 large 0 galore(ip) 0 001 & 00000100 a 0000 | of considerable size  \n";

std::string temp_dir(const std::string& name) { return contrax::testing::scratch_dir(name); }

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

std::string fixture_dir() {
  const std::string d = temp_dir("wordnet");
  write(d + "/data.noun", kNouns);
  write(d + "/data.verb", kVerbs);
  write(d + "/data.adj", kAdjs);
  write(d + "/data.adv", "");
  return d;
}


}  // namespace

TEST(WordNet, ParsesTheFixture) {
  const auto all = ct::load_wordnet(fixture_dir());
  ASSERT_EQ(all.size(), 7u);
  const auto& bank = all[1];
  EXPECT_EQ(bank.key, 200);
  EXPECT_EQ(bank.pos, 'n');
  EXPECT_EQ(bank.lex_filenum, 17);
  EXPECT_EQ(bank.lemmas, (std::vector<std::string>{"bank", "side of river"}));
  EXPECT_EQ(bank.definition, "sloping land beside a river");  // examples dropped
  EXPECT_EQ(bank.hypernyms, (std::vector<int64_t>{100}));
  EXPECT_EQ(all[2].definition, "a financial institution");
  EXPECT_EQ(all[3].hypernyms, (std::vector<int64_t>{100}));  // @i counts
  EXPECT_EQ(all[3].definition, "\"only an example\"");        // nothing but examples: the whole gloss
  const auto& breathe = all[4];
  EXPECT_EQ(breathe.key, 100000000 + 100);  // verb file: offsets repeat across files
  EXPECT_EQ(breathe.definition, "draw air into, and expel out of, the lungs");
  EXPECT_TRUE(breathe.hypernyms.empty());
  EXPECT_EQ(all[5].lemmas, (std::vector<std::string>{"big"}));
  EXPECT_EQ(all[5].similar, (std::vector<int64_t>{200000000 + 200}));
  EXPECT_EQ(all[6].pos, 's');
  EXPECT_EQ(all[6].lemmas, (std::vector<std::string>{"large", "galore"}));
}

TEST(WordNet, ErrorsNameTheLineAndTheProblem) {
  auto parse = [](const std::string& text, int f = 0) { return ct::parse_wordnet_data(text, f, "x"); };
  EXPECT_NE(error_of([&] { parse("00000100 03 n 01 entity 0 000 that\n"); }).find("x line 1: no ' | '"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse("  licence\n00000100 03 n zz entity 0 000 | g\n"); })
                .find("x line 2: w_cnt must be a hexadecimal number, but got 'zz'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse("00000100 03 v 01 run 0 000 | g\n"); })
                .find("x line 1: ss_type 'v' does not belong in data.noun"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse("00000100 03 n 02 a 0 | g\n"); }).find("x line 1: line ends before its words"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse("00000100 03 n 00 000 | g\n"); }).find("w_cnt must be >= 1, but got 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse("00000100 99 n 01 a 0 000 | g\n"); }).find("lex_filenum must be < 45, but got 99"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse("00000100 03 n 01 a 0 001 @ 00000200 q 0000 | g\n"); })
                .find("pointer part of speech must be n, v, a, s or r, but got 'q'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse("", 4); }).find("argument 'pos_file' must be in [0, 4), but got 4"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::load_wordnet("/nonexistent"); })
                .find("cannot read WordNet file /nonexistent/data.noun (install Debian's 'wordnet-base'"),
            std::string::npos);
}

TEST(WordNet, FeaturesAreHashedNgrams) {
  // "cat" -> "<cat>": the word itself, 3-grams <ca cat at>, 4-grams <cat cat>
  // (the 5-gram is the whole marked word, already in): 6 features.
  const auto f = ct::passage_features("Cat", 1000, 3, 5, 100);
  EXPECT_EQ(f.size(), 6u);
  for (auto v : f) EXPECT_TRUE(v >= 1 && v < 1000) << v;
  EXPECT_EQ(f, ct::passage_features("cat!", 1000, 3, 5, 100));  // case and punctuation ignored
  // 4 words: 4 unigrams + 3 bigrams; truncated at max_features.
  EXPECT_EQ(ct::query_features("a b, c d", 1000, 100).size(), 7u);
  EXPECT_EQ(ct::query_features("a b, c d", 1000, 5).size(), 5u);
  EXPECT_NE(ct::query_features("a b", 1 << 20, 100), ct::query_features("b a", 1 << 20, 100));  // bigrams: order
  auto batch = ct::feature_batch(ct::Ragged{{5, 6, 7}, {0, 2, 2, 3}}, {0, 1, 2}, torch::kDouble);
  EXPECT_TRUE(torch::equal(batch[0], torch::tensor({5, 6, 0, 0, 7, 0}, torch::kLong).view({3, 2})));
  EXPECT_TRUE(torch::allclose(batch[1], torch::tensor({0.5, 0.5, 0.0, 0.0, 1.0, 0.0}, torch::kDouble).view({3, 2})));
}

TEST(WordNet, CorpusIdsSplitAndHardNegatives) {
  auto all = ct::load_wordnet(fixture_dir());
  auto c = ct::make_retrieval_corpus(all, ct::RetrievalCorpusOptions().heldout_per_10000(0));
  ASSERT_EQ(c.passages.size(), 7u);
  EXPECT_EQ(c.passages[1], "bank, side of river");
  EXPECT_EQ(c.passages[2], "bank");
  EXPECT_EQ(c.passage_id[2], c.passage_id[3]);  // "bank" and "Bank": one passage
  EXPECT_NE(c.passage_id[1], c.passage_id[2]);
  EXPECT_EQ(c.num_passage_ids, 6);
  EXPECT_EQ(c.train.size(), 7u);
  EXPECT_TRUE(c.heldout.empty());
  // Co-hyponyms of 00000100: {1, 2, 3}; 2 and 3 share a passage, so their
  // pools hold only 1; adjective cluster {5, 6}.
  auto pool = [&](int64_t t) {
    return std::vector<int64_t>(c.hard_negative_pool.values.begin() + c.hard_negative_pool.offsets[t],
                                c.hard_negative_pool.values.begin() + c.hard_negative_pool.offsets[t + 1]);
  };
  EXPECT_EQ(pool(1), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(pool(2), (std::vector<int64_t>{1}));
  EXPECT_EQ(pool(3), (std::vector<int64_t>{1}));
  EXPECT_EQ(pool(5), (std::vector<int64_t>{6}));
  EXPECT_EQ(pool(6), (std::vector<int64_t>{5}));
  EXPECT_TRUE(pool(0).empty());
  const auto a = ct::sample_hard_negatives(c, {1, 2, 0}, 3, 7, 0);
  EXPECT_EQ(a, ct::sample_hard_negatives(c, {1, 2, 0}, 3, 7, 0));  // deterministic
  ASSERT_EQ(a.size(), 9u);
  for (int j = 0; j < 3; ++j) {
    EXPECT_TRUE(a[j] == 2 || a[j] == 3);
    EXPECT_EQ(a[3 + j], 1);
    EXPECT_NE(c.passage_id[c.train[a[6 + j]]], c.passage_id[0]);  // fallback: same lexicographer file, else any other
  }
  // The split is a function of the key alone: all held out at 10000/10000.
  auto held = ct::make_retrieval_corpus(all, ct::RetrievalCorpusOptions().heldout_per_10000(10000));
  EXPECT_EQ(held.heldout.size(), 7u);
  EXPECT_TRUE(held.train.empty());
  EXPECT_NE(error_of([&] { ct::make_retrieval_corpus(all, ct::RetrievalCorpusOptions().heldout_per_10000(-1)); })
                .find("heldout_per_10000 must be in [0, 10000], but got -1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::sample_hard_negatives(c, {7}, 1, 0, 0); }).find("row 7 out of range [0, 7)"),
            std::string::npos);
}

TEST(Bm25, HandComputedScores) {
  // Documents d0 = [a b], d1 = [b c c]: N = 2, avgdl = 2.5, k1 = 1.2, b = 0.75.
  //   idf(a) = idf(c) = ln(1 + (2 - 1 + 0.5) / (1 + 0.5)) = ln 2 = 0.693147
  //   idf(b)          = ln(1 + (2 - 2 + 0.5) / (2 + 0.5)) = ln 1.2 = 0.182322
  //   length factor K(d) = k1 (1 - b + b |d| / avgdl): K(d0) = 1.2 (0.25 + 0.6) = 1.02,
  //                                                    K(d1) = 1.2 (0.25 + 0.9) = 1.38
  // Query [c]:     d0: 0;  d1: ln2 * 2 * 2.2 / (2 + 1.38) = 0.693147 * 1.301775 = 0.902322
  // Query [b a b]: distinct terms b, a.
  //   d0: (ln1.2 + ln2) * 1 * 2.2 / (1 + 1.02) = 0.875469 * 1.089109 = 0.953481
  //   d1: ln1.2 * 2.2 / (1 + 1.38)             = 0.182322 * 0.924370 = 0.168533
  ct::Bm25 bm25({{"a", "b"}, {"b", "c", "c"}});
  auto s = bm25.score_matrix({{"c"}, {"b", "a", "b"}, {"zzz"}});
  auto expect = torch::tensor({0.0, 0.902322, 0.953481, 0.168533, 0.0, 0.0}, torch::kDouble).view({3, 2});
  EXPECT_LT((s - expect).abs().max().item<double>(), 2e-6) << s;
  EXPECT_NE(error_of([] { ct::Bm25({{"a"}}, ct::Bm25Options().b(2)); }).find("k1 must be >= 0 and b in [0, 1]"),
            std::string::npos);
}

TEST(RetrievalMetrics, HandExample) {
  // q0: correct passage highest                       -> rank 1: r@1 1, r@10 1, RR 1
  // q1: one passage (0.7) above the correct 0.6       -> rank 2: r@1 0, r@10 1, RR 1/2
  // q2: all four tied                                 -> rank uniform on 1..4:
  //     r@1 1/4, r@10 1, RR (1 + 1/2 + 1/3 + 1/4) / 4 = 0.520833
  auto scores = torch::tensor({0.9, 0.1, 0.2, 0.3, 0.5, 0.7, 0.6, 0.1, 0.0, 0.0, 0.0, 0.0}).view({3, 4});
  auto m = ct::retrieval_metrics(scores, torch::tensor({0, 2, 3}, torch::kLong));
  EXPECT_NEAR(m.recall_at_1, (1 + 0 + 0.25) / 3, 1e-12);
  EXPECT_NEAR(m.recall_at_10, 1.0, 1e-12);
  EXPECT_NEAR(m.mrr, (1 + 0.5 + (1 + 1.0 / 2 + 1.0 / 3 + 1.0 / 4) / 4) / 3, 1e-12);
  EXPECT_EQ(m.queries, 3);
  EXPECT_EQ(m.passages, 4);
  // 8 passages above and 3 tied with the correct one: rank uniform on 9..12,
  // r@10 = (10 - 8) / 4 = 1/2, RR = (1/9 + 1/10 + 1/11 + 1/12) / 4.
  std::vector<double> row{0.5};
  for (int i = 0; i < 8; ++i) row.push_back(1.0);
  for (int i = 0; i < 3; ++i) row.push_back(0.5);
  row.push_back(0.0);
  auto m2 = ct::retrieval_metrics(torch::tensor(row, torch::kDouble).view({1, 13}), torch::tensor({0}, torch::kLong));
  EXPECT_EQ(m2.recall_at_1, 0.0);
  EXPECT_NEAR(m2.recall_at_10, 0.5, 1e-12);
  EXPECT_NEAR(m2.mrr, (1.0 / 9 + 1.0 / 10 + 1.0 / 11 + 1.0 / 12) / 4, 1e-12);
  EXPECT_NE(error_of([] { ct::retrieval_metrics(torch::zeros({3}), torch::zeros({3}, torch::kLong)); })
                .find("argument 'scores' must be [queries, passages], but got shape [3]"),
            std::string::npos);
  EXPECT_NE(error_of([] { ct::retrieval_metrics(torch::zeros({3, 2}), torch::zeros({2}, torch::kLong)); })
                .find("argument 'target' must be [3], but got shape [2]"),
            std::string::npos);
  EXPECT_NE(error_of([] { ct::retrieval_metrics(torch::zeros({1, 2}), torch::full({1}, 2, torch::kLong)); })
                .find("argument 'target' must hold columns in [0, 2)"),
            std::string::npos);
}

TEST(RetrievalEval, DeduplicatedPassagesAndTheSameProtocolForEverySystem) {
  auto c = ct::make_retrieval_corpus(ct::load_wordnet(fixture_dir()),
                                     ct::RetrievalCorpusOptions().heldout_per_10000(10000).query_buckets(64)
                                         .passage_buckets(64));
  auto set = ct::make_eval_set(c);
  EXPECT_EQ(set.query_synsets.size(), 7u);
  EXPECT_EQ(set.passage_synsets.size(), 6u);  // "bank" once
  EXPECT_EQ(set.target[2].item<int64_t>(), set.target[3].item<int64_t>());
  // BM25 on words: "a financial institution" shares no word with "bank": its
  // score ties with all 6 passages at 0 -> r@1 = 1/6.
  auto word = ct::evaluate_bm25(c, set, "word");
  EXPECT_EQ(word.queries, 7);
  EXPECT_GE(word.recall_at_10, 0.999);  // 6 passages: everything is in the top 10
  ct::RetrievalOptions o;
  o.query_tower(ct::BagTowerOptions(64).embed_dim(8).hidden_dim(8).out_dim(4))
      .passage_tower(ct::BagTowerOptions(64).embed_dim(8).hidden_dim(8).out_dim(4));
  ct::BagTower q{nullptr}, p{nullptr};
  ct::LogitScale s{nullptr};
  ct::build_towers(o, q, p, s);
  auto towers = ct::evaluate_towers(q, p, c, set);
  EXPECT_EQ(towers.passages, 6);
  EXPECT_NEAR(std::exp(s->value.item<double>()), 1 / 0.07, 1e-4);
  EXPECT_NE(error_of([&] { ct::evaluate_bm25(c, set, "stems"); }).find("argument 'terms' must be 'word' or 'chargram'"),
            std::string::npos);
}

// ---------------------------------------------------------------------------
// Training loop

using contrax::testing::expect_same;
using contrax::testing::small_options;
using contrax::testing::synthetic_corpus;
using contrax::testing::train_world;

TEST(RetrievalTrainer, WorldSizesAgreeInDoubleWithUnevenAndEmptyRanks) {
  // 49 training synsets at global batch 24: batches of 24, 24 and 1 row; with
  // 3 ranks the slices are uneven (8/8/8, then 1/0/0: two empty ranks).
  const auto c = synthetic_corpus(49);
  const auto one = train_world(1, c, small_options());
  ASSERT_EQ(one.losses.size(), 3u);
  for (double l : one.losses) EXPECT_TRUE(std::isfinite(l));
  expect_same(train_world(2, c, small_options()), one, 1e-9);
  expect_same(train_world(3, c, small_options()), one, 1e-9);
}

TEST(RetrievalTrainer, GradientCacheEqualsOneShot) {
  const auto c = synthetic_corpus(49);
  const auto one = train_world(2, c, small_options());
  expect_same(train_world(2, c, small_options().query_chunk_size(5)), one, 1e-9);
  expect_same(train_world(2, c, small_options().query_chunk_size(3).passage_chunk_size(7)), one, 1e-9);
}

TEST(RetrievalTrainer, LearnsTheSyntheticPairs) {
  // The loss must fall on a task the towers can fit.
  const auto c = synthetic_corpus(200);
  auto r = train_world(1, c, small_options([](ct::RunOptions& r) {
                         r.max_steps(-1).epochs(15).batch_size(50).dtype(torch::kFloat);
                       }));
  ASSERT_FALSE(r.losses.empty());
  EXPECT_LT(r.losses.back(), 0.7 * r.losses.front()) << r.losses.front() << " -> " << r.losses.back();
}

TEST(RetrievalTrainer, ResumeContinuesOnTheSameCurve) {
  const auto c = synthetic_corpus(49);
  const std::string a = temp_dir("full"), b = temp_dir("half");
  auto o = small_options([](ct::RunOptions& r) { r.max_steps(5).dtype(torch::kFloat); });
  const auto full = train_world(2, c, ct::RetrievalOptions(o).run(ct::RunOptions(o.run()).run_dir(a)));
  const auto half =
      train_world(2, c, ct::RetrievalOptions(o).run(ct::RunOptions(o.run()).run_dir(b).stop_at_step(2)));
  EXPECT_EQ(half.losses.size(), 2u);
  const auto rest = train_world(2, c, ct::RetrievalOptions(o).run(ct::RunOptions(o.run()).run_dir(b).resume(true)));
  ASSERT_EQ(rest.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.losses[i], full.losses[2 + i]);
  for (size_t i = 0; i < full.params.size(); ++i) EXPECT_TRUE(torch::equal(rest.params[i], full.params[i])) << i;
  // Another batch size is refused, naming the settings.
  std::string msg;
  try {
    train_world(2, c, ct::RetrievalOptions(o).run(ct::RunOptions(o.run()).run_dir(b).resume(true).batch_size(12)));
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("(resume with the same settings)"), std::string::npos) << msg;
}

TEST(RetrievalTrainer, ErrorsNameTheOption) {
  const auto c = synthetic_corpus(10);
  auto err = [&](const ct::RetrievalOptions& o) { return error_of([&] { ct::train_retrieval(nullptr, c, o); }); };
  EXPECT_NE(err(small_options().hard_negatives(-1)).find("hard negatives must be in [0, 64], but got -1"),
            std::string::npos);
  EXPECT_NE(err(small_options().temperature(0)).find("temperature must be > 0, but got 0"), std::string::npos);
  EXPECT_NE(err(small_options([](ct::RunOptions& r) { r.batch_size(0); })).find("batch size must be >= 1, but got 0"),
            std::string::npos);
  EXPECT_NE(err(small_options().query_chunk_size(-1)).find("query chunk size must be >= 0, but got -1"),
            std::string::npos);
  EXPECT_NE(err(small_options([](ct::RunOptions& r) { r.resume(true); })).find("resuming needs a run directory"),
            std::string::npos);
}

// ---------------------------------------------------------------------------
// CLI

using contrax::testing::have_wordnet;
using contrax::testing::kFast;

TEST(RetrievalCli, JsonSummaryCarriesTheThreeSystems) {
  if (!have_wordnet()) GTEST_SKIP() << "Debian's wordnet-base is not installed (tools/setup.sh installs it)";
  const std::string d = temp_dir("cli_json");
  auto r = contrax::testing::run_cli_stdout(std::string(kFast) + " --max-steps 4 --json --run-dir " + d);
  ASSERT_EQ(r.status, 0) << r.out;
  // The summary is stdout's last line.
  std::string last = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
  last = last.substr(last.rfind('\n') + 1);
  const auto s = nlohmann::json::parse(last);
  EXPECT_EQ(s["recipe"], "retrieval");
  EXPECT_EQ(s["steps"], 4);
  for (const char* k : {"recall_at_1", "recall_at_10", "mrr", "lexical_recall_at_1", "lexical_recall_at_10",
                        "lexical_mrr", "random_init_recall_at_1", "random_init_recall_at_10", "random_init_mrr"}) {
    ASSERT_TRUE(s.contains(k) && s[k].is_number()) << k << " in " << r.out;
    EXPECT_GE(s[k].get<double>(), 0.0) << k;
    EXPECT_LE(s[k].get<double>(), 1.0) << k;
  }
  EXPECT_LE(s["recall_at_1"].get<double>(), s["recall_at_10"].get<double>());
  EXPECT_EQ(s["evaluation"]["queries"], 400);
  for (const char* f : {"config.json", "train.log", "metrics.jsonl", "results.json", "checkpoint.pt"}) {
    EXPECT_TRUE(std::filesystem::exists(d + "/" + f)) << f;
  }
  const auto config = nlohmann::json::parse(contrax::testing::read_file(d + "/config.json"));
  EXPECT_EQ(config["settings"]["recipe"], "retrieval");
  EXPECT_EQ(config["settings"]["hard_negatives"], 1);
}

TEST(RetrievalCli, ResumeGivesTheSameMetricsAsAnUninterruptedRun) {
  if (!have_wordnet()) GTEST_SKIP() << "Debian's wordnet-base is not installed (tools/setup.sh installs it)";
  const std::string a = temp_dir("cli_full"), b = temp_dir("cli_half");
  auto full = contrax::testing::run_cli(std::string(kFast) + " --max-steps 6 --run-dir " + a);
  ASSERT_EQ(full.status, 0) << full.out;
  auto half = contrax::testing::run_cli(std::string(kFast) + " --max-steps 6 --stop-at-step 3 --run-dir " + b);
  ASSERT_EQ(half.status, 0) << half.out;
  EXPECT_NE(half.out.find("stopped at step 3/6"), std::string::npos) << half.out;
  auto rest = contrax::testing::run_cli(std::string(kFast) + " --max-steps 6 --resume --run-dir " + b);
  ASSERT_EQ(rest.status, 0) << rest.out;
  EXPECT_EQ(contrax::testing::losses_of(a + "/metrics.jsonl"), contrax::testing::losses_of(b + "/metrics.jsonl"));
  const auto ra = nlohmann::json::parse(contrax::testing::read_file(a + "/results.json"));
  const auto rb = nlohmann::json::parse(contrax::testing::read_file(b + "/results.json"));
  for (const char* k : {"recall_at_1", "recall_at_10", "mrr", "random_init_recall_at_10", "lexical_recall_at_10"}) {
    EXPECT_EQ(ra[k], rb[k]) << k;
  }
}

TEST(RetrievalCli, FlagErrorsNameTheFlag) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--hard-negatives 65", "flag '--hard-negatives' must be <= 64, but got 65"},
      {"--query-features chars", "flag '--query-features' must be words or words+chargrams, but got 'chars'"},
      {"--buckets 1", "flag '--buckets' must be >= 2, but got 1"},
      {"--passage-chunk-size -1", "flag '--passage-chunk-size' must be >= 0, but got -1"},
  };
  for (const auto& [flags, message] : cases) {
    auto r = contrax::testing::run_cli("train --recipe retrieval " + flags);
    EXPECT_EQ(r.status, 2) << flags << ": " << r.out;
    EXPECT_NE(r.out.find(message), std::string::npos) << flags << ": " << r.out;
  }
  // A missing corpus names the file and the package.
  const std::string d = temp_dir("cli_no_wordnet");
  auto r = contrax::testing::run_cli("train --recipe retrieval --nproc 1 --no-plot --wordnet /nonexistent --run-dir " +
                                     d + "/run");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("cannot read WordNet file /nonexistent/data.noun (install Debian's 'wordnet-base'"),
            std::string::npos)
      << r.out;
}
