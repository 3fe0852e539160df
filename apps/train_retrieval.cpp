// `contrax train --recipe retrieval` (see train_retrieval.h).
#include "train_retrieval.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "contrax/launcher.h"
#include "contrax/train/image/trainer.h"
#include "contrax/train/retrieval/eval.h"
#include "contrax/verify.h"
#include "run_dir.h"

namespace contrax::cli {

namespace ct = contrax::train;

namespace {

Json metrics_json(const ct::RetrievalMetrics& m) {
  Json j;
  put_number(j, "recall_at_1", m.recall_at_1);
  put_number(j, "recall_at_10", m.recall_at_10);
  put_number(j, "mrr", m.mrr);
  return j;
}

}  // namespace

Json retrieval_settings_json(const RetrievalRun& r) {
  const auto& o = r.options;
  Json s;
  s["recipe"] = "retrieval";
  s["wordnet"] = r.wordnet_dir;
  s["epochs"] = o.run().epochs();
  s["max_steps"] = o.run().max_steps();
  s["batch_size"] = o.run().batch_size();
  s["chunk_size"] = o.query_chunk_size();
  s["passage_chunk_size"] = o.passage_chunk_size();
  s["hard_negatives"] = o.hard_negatives();
  s["lr"] = o.run().lr();
  s["weight_decay"] = o.run().weight_decay();
  s["warmup_steps"] = o.run().warmup_steps();
  s["temperature"] = o.temperature();
  s["seed"] = o.run().seed();
  s["dtype"] = o.run().dtype() == torch::kDouble ? "double" : "float";
  s["run_dir"] = r.run_dir;
  s["checkpoint_every"] = o.run().checkpoint_every();
  s["train_limit"] = r.train_limit;
  s["eval_limit"] = r.eval_limit;
  s["query_features"] = r.query_chargrams ? "words+chargrams" : "words";
  s["log_every"] = o.run().log_every();
  s["stop_at_step"] = o.run().stop_at_step();
  s["skip_nonfinite"] = o.run().skip_nonfinite();
  s["eval"] = !r.no_eval;
  s["verify"] = !r.no_verify;
  for (const auto& [name, t] : {std::pair<const char*, ct::BagTowerOptions>{"query_tower", o.query_tower()},
                                {"passage_tower", o.passage_tower()}}) {
    s[name] = {{"buckets", t.buckets()},
               {"embed_dim", t.embed_dim()},
               {"hidden_dim", t.hidden_dim()},
               {"out_dim", t.out_dim()}};
  }
  return s;
}

int run_retrieval(const RetrievalRun& run, const CommunicatorPtr& comm, const RetrievalIo& io,
                  std::chrono::steady_clock::time_point wall0) {
  const int64_t world = comm->world_size(), rank = comm->rank();
  const auto& o0 = run.options;
  auto copts = ct::RetrievalCorpusOptions()
                   .query_buckets(o0.query_tower().buckets())
                   .passage_buckets(o0.passage_tower().buckets())
                   .train_limit(run.train_limit)
                   .query_chargrams(run.query_chargrams);
  const auto corpus = ct::make_retrieval_corpus(ct::load_wordnet(run.wordnet_dir), copts);
  auto opts = o0;
  opts.run().run_dir(run.run_dir).log([&io](const std::string& line) { io.out(line); });
  if (rank == 0) {
    std::ostringstream os;
    const int64_t g = 1 + opts.hard_negatives();
    os << "contrax train: retrieval (WordNet reverse dictionary) on " << corpus.train.size()
       << " training synsets of " << run.wordnet_dir << " (" << corpus.heldout.size() << " held out), " << world
       << " process" << (world > 1 ? "es" : "") << " x " << at::get_num_threads() << " thread"
       << (at::get_num_threads() > 1 ? "s" : "") << ", global batch " << opts.run().batch_size() << " queries x " << g
       << " passages (" << opts.hard_negatives() << " hard negative" << (opts.hard_negatives() == 1 ? "" : "s") << ")"
       << (opts.query_chunk_size() > 0
               ? ", gradient cache chunks of " + std::to_string(opts.query_chunk_size()) + " queries / " +
                     std::to_string(opts.passage_chunk_size() > 0 ? opts.passage_chunk_size()
                                                                  : opts.query_chunk_size() * g) +
                     " passages"
               : std::string())
       << ", run dir " << run.run_dir << (opts.run().resume() ? " (resuming)" : "") << "\n";
    io.out(os.str());
  }
  ct::RetrievalTrainResult r;
  try {
    r = ct::train_retrieval(comm, corpus, opts);
  } catch (const c10::Error& e) {
    io.log_only(c10::str("contrax train: error: ", e.what_without_backtrace(), "\n"));
    throw;
  }
  const int64_t steps_run = r.steps - r.start_step;
  if (r.interrupted) {
    if (rank == 0) {
      io.err(c10::str("contrax train: stopped at step ", r.steps, "/", r.total_steps, "; checkpoint ",
                      ct::checkpoint_path(run.run_dir), " written; continue with --resume\n"));
    }
    return io.interrupted_status();
  }

  Json verify_j;
  if (!run.no_verify) {
    auto results = contrax::verify(comm);
    double worst = 0;
    bool ok = true;
    for (const auto& v : results) {
      worst = std::max(worst, v.max_rel_err);
      ok = ok && v.passed;
    }
    verify_j["ok"] = ok;
    put_number(verify_j, "max_rel_err", worst);
    verify_j["cases"] = results.size();
    verify_j["world_size"] = world;
  }
  // Evaluation on rank 0 after the last collective (as the image recipes).
  if (rank != 0) return 0;

  // One protocol, one evaluation set, for every system.
  ct::RetrievalMetrics trained, random_init, bm25_word, bm25_char;
  ct::RetrievalEvalSet set;
  double eval_s = 0;
  std::string lexical_name;
  if (!run.no_eval) {
    const auto e0 = std::chrono::steady_clock::now();
    set = ct::make_eval_set(corpus, run.eval_limit);
    trained = ct::evaluate_towers(r.query_tower, r.passage_tower, corpus, set);
    ct::BagTower q0{nullptr}, p0{nullptr};
    ct::LogitScale s0{nullptr};
    ct::build_towers(opts, q0, p0, s0);  // the towers this run started from
    random_init = ct::evaluate_towers(q0, p0, corpus, set);
    bm25_word = ct::evaluate_bm25(corpus, set, "word");
    bm25_char = ct::evaluate_bm25(corpus, set, "chargram");
    eval_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
  }
  // The lexical baseline is the stronger BM25 variant on recall@10.
  const bool char_wins = bm25_char.recall_at_10 > bm25_word.recall_at_10;
  const ct::RetrievalMetrics& lexical = char_wins ? bm25_char : bm25_word;
  lexical_name = char_wins ? "bm25_chargram" : "bm25_word";
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();

  Json s;
  s["recipe"] = "retrieval";
  s["world_size"] = world;
  s["steps"] = r.steps;
  s["start_step"] = r.start_step;
  s["steps_run"] = steps_run;
  s["total_steps"] = r.total_steps;
  s["epochs"] = r.epochs_done;
  s["batch_size"] = opts.run().batch_size();
  s["chunk_size"] = opts.query_chunk_size();
  s["hard_negatives"] = opts.hard_negatives();
  s["skipped_steps"] = r.skipped_steps;
  put_number(s, "final_loss", r.losses.empty() ? std::nan("") : r.losses.back());
  put_number(s, "logit_scale", r.logit_scale);
  if (!run.no_eval) {
    put_number(s, "recall_at_1", trained.recall_at_1);
    put_number(s, "recall_at_10", trained.recall_at_10);
    put_number(s, "mrr", trained.mrr);
    put_number(s, "lexical_recall_at_1", lexical.recall_at_1);
    put_number(s, "lexical_recall_at_10", lexical.recall_at_10);
    put_number(s, "lexical_mrr", lexical.mrr);
    put_number(s, "random_init_recall_at_1", random_init.recall_at_1);
    put_number(s, "random_init_recall_at_10", random_init.recall_at_10);
    put_number(s, "random_init_mrr", random_init.mrr);
    put_number(s, "eval_s", eval_s);
    s["evaluation"] = {{"queries", set.query_synsets.size()},
                       {"passages", set.passage_synsets.size()},
                       {"lexical", lexical_name},
                       {"trained_towers", metrics_json(trained)},
                       {"random_init_towers", metrics_json(random_init)},
                       {"bm25_word", metrics_json(bm25_word)},
                       {"bm25_chargram", metrics_json(bm25_char)}};
  }
  put_number(s, "examples_per_s", r.examples_per_s);
  put_number(s, "train_s", r.train_s);
  put_number(s, "wall_s", wall);
  s["bytes_sent_rank0"] = r.bytes_sent;
  if (!run.no_verify) s["verify"] = verify_j;
  s["run_dir"] = run.run_dir;
  write_run_file(run.run_dir, "results.json", s.dump(2) + "\n");

  std::ostringstream out;
  if (run.json) {
    out << s.dump() << "\n";
  } else {
    if (!run.no_eval) {
      out << "\nheld-out retrieval: " << set.query_synsets.size() << " glosses ranked against "
          << set.passage_synsets.size() << " distinct held-out lemma lists (ties broken at random, in expectation)\n";
      out << std::left << std::setw(42) << "system" << std::setw(12) << "recall@1" << std::setw(12) << "recall@10"
          << "MRR\n";
      auto row = [&out](const std::string& name, const ct::RetrievalMetrics& m) {
        out << std::left << std::setw(42) << name << std::fixed << std::setprecision(4) << std::setw(12)
            << m.recall_at_1 << std::setw(12) << m.recall_at_10 << m.mrr << "\n";
      };
      row("trained towers", trained);
      row("random-init towers", random_init);
      row(std::string("BM25, words") + (char_wins ? "" : " (lexical baseline)"), bm25_word);
      row(std::string("BM25, char 3-5-grams") + (char_wins ? " (lexical baseline)" : ""), bm25_char);
    }
    out << "trained " << steps_run << " step" << (steps_run == 1 ? "" : "s");
    if (r.start_step > 0) out << " (steps " << r.start_step + 1 << "-" << r.steps << " of " << r.total_steps << ")";
    out << " to epoch " << r.epochs_done << " in " << std::fixed << std::setprecision(1) << r.train_s << " s, "
        << std::setprecision(0) << r.examples_per_s << " queries/s; learnt logit scale " << std::setprecision(1)
        << r.logit_scale << "; ";
    if (r.skipped_steps > 0) out << r.skipped_steps << " non-finite steps skipped; ";
    if (!run.no_eval) out << "evaluated in " << eval_s << " s; ";
    out << "wall " << wall << " s\n";
    if (!run.no_verify) {
      out << (verify_j["ok"].get<bool>() ? "distributed gradients equal single-device"
                                         : "MISMATCH: distributed gradients differ from single-device")
          << ": max rel err " << std::setprecision(3) << std::scientific
          << (verify_j["max_rel_err"].is_null() ? std::nan("") : verify_j["max_rel_err"].get<double>()) << " over "
          << verify_j["cases"].get<int64_t>() << " cases (W=" << world << ")\n";
    }
  }
  io.result(out.str());
  if (!run.no_plot && r.steps > 0) {
    if (plot_run(run.run_dir, /*quiet=*/true) != 0) {
      io.err("contrax train: curves.png not drawn (see above); the run itself is complete\n");
    }
  }
  return verify_j.is_null() || verify_j["ok"].get<bool>() ? 0 : 1;
}

}  // namespace contrax::cli
