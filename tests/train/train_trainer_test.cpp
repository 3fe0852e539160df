// The training loop and the image recipes: a recipe that is only a step and
// its data, world-size independence (fp64), the gradient cache path, resume
// equality (also at another world size), the non-finite guard, a clean stop on SIGTERM, and the CLI's flag
// errors.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "contrax/train/common/checkpoint.h"
#include "contrax/train/image/idx.h"
#include "contrax/train/image/trainer.h"
#include "support/cli.h"
#include "support/processes.h"
#include "support/ranks.h"

namespace ct = contrax::train;
using contrax::testing::losses_of;

namespace {

// A synthetic data set: n random 28x28 grey images with blobs (enough for the
// loop; the real data set is used by the CLI tests).
ct::Dataset synthetic(int64_t n, uint64_t seed = 7) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  ct::Dataset d;
  d.images = torch::randint(0, 256, {n, 1, 28, 28}, g, torch::kUInt8);
  d.labels = torch::randint(0, 10, {n}, g, torch::kLong);
  return d;
}

// Trains on `world` thread-ranks; returns rank `from_rank`'s parameters (and
// losses).
std::vector<torch::Tensor> train_world(int64_t world, const ct::Dataset& data, const ct::TrainOptions& o,
                                       std::vector<double>* losses = nullptr, int64_t from_rank = 0) {
  std::vector<torch::Tensor> params;
  std::vector<double> ls;
  contrax::testing::run_ranks(world, [&](const contrax::CommunicatorPtr& comm) {
    auto r = ct::train_contrastive(comm, data, o);
    if (comm->rank() == from_rank) {
      for (auto& p : r.parameters) params.push_back(p.clone());
      ls = r.losses;
    }
  }, std::chrono::seconds(120));
  if (losses) *losses = ls;
  return params;
}

double max_rel_err(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double e = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) e = std::max(e, contrax::testing::rel_err(a[i], b[i]));
  return e;
}

ct::TrainOptions small_options(const std::string& recipe) {
  ct::TrainOptions o;
  o.recipe(recipe).model(ct::ContrastiveModelOptions()
                             .encoder(ct::EncoderOptions().channels({8, 16}).strides({2, 2}).groups(4))
                             .proj_hidden_dim(32)
                             .proj_dim(16)
                             .pred_hidden_dim(32));
  o.run().batch_size(24).max_steps(3).warmup_steps(1).lr(1e-2).dtype(torch::kDouble).log_every(0).seed(3);
  return o;
}

// A run directory that does not exist yet (the trainer makes it).
std::string temp_dir(const std::string& name) { return contrax::testing::scratch_path(name); }

// `contrax train ARGS`, its status and what it printed.
contrax::testing::CliRun run_cli(const std::string& args) { return contrax::testing::run_cli("train " + args); }

// Rewrites the checkpoint of TrainLoop.ARecipeIsAStepAndItsData's loop (a
// Linear(3, 1) in double, its AdamW, the CPU generator) in the format
// Checkpoint::save wrote before safetensors (version 2: a TorchScript
// archive of sub-archives, scalars as key and value lists).
void rewrite_as_legacy(const std::string& path) {
  torch::nn::Linear model(torch::nn::LinearOptions(3, 1).bias(false));
  model->to(torch::kDouble);
  torch::optim::AdamW adamw(model->parameters());
  auto gen = at::detail::createCPUGenerator();
  ct::Checkpoint c;
  c.module("model", *model).optimizer("adamw", adamw).generator("cpu", gen);
  c.load(path);
  torch::serialize::OutputArchive ar, m, o;
  ar.write("contrax_checkpoint_format", c10::IValue(int64_t{2}));
  model->save(m);
  ar.write("module.model", m);
  ar.write("module.model.dtype", c10::IValue(std::string("Double")));
  adamw.save(o);
  ar.write("optimizer.adamw", o);
  ar.write("generator.cpu", gen.get_state(), /*is_buffer=*/true);
  auto lists = [&ar](const std::string& name, auto keys, auto values) {
    ar.write(name + ".keys", c10::IValue(keys));
    ar.write(name + ".values", c10::IValue(values));
  };
  c10::List<std::string> int_keys, double_keys, string_keys, string_values;
  c10::List<int64_t> int_values;
  c10::List<double> double_values;
  for (const auto& [k, v] : c.ints) int_keys.push_back(k), int_values.push_back(v);
  for (const auto& [k, v] : c.doubles) double_keys.push_back(k), double_values.push_back(v);
  for (const auto& [k, v] : c.strings) string_keys.push_back(k), string_values.push_back(v);
  lists("ints", int_keys, int_values);
  lists("doubles", double_keys, double_values);
  lists("strings", string_keys, string_values);
  ar.write("metadata", c10::IValue(c.metadata));
  ar.save_to(path);
}

const char* kFastCli =
    "--train-limit 512 --batch-size 64 --warmup-steps 2 --no-eval --no-verify --no-plot --log-every 0 --threads 1";

}  // namespace

TEST(Trainer, TwoRanksEqualOneRankSimCLR) {
  auto data = synthetic(60);  // 3 steps of 24, the third short (12) and even
  auto o = small_options("simclr");
  std::vector<double> l1, l2;
  auto p1 = train_world(1, data, o, &l1);
  auto p2 = train_world(2, data, o, &l2);
  EXPECT_LT(max_rel_err(p2, p1), 1e-9);
  ASSERT_EQ(l1.size(), 3u);
  ASSERT_EQ(l2.size(), 3u);
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l1[i], l2[i], 1e-10 * std::abs(l1[i]));
  // The parameters moved (the comparison is not vacuous).
  auto p0 = train_world(1, data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).max_steps(3).stop_at_step(0)));
  EXPECT_GT(max_rel_err(p1, p0), 1e-4);
}

TEST(Trainer, ThreeRanksUnevenEqualOneRankMocoV3) {
  auto data = synthetic(55);  // batches 24, 24, 7 over 3 ranks: 8/8/8 and 3/2/2
  auto o = small_options("moco-v3");
  auto p1 = train_world(1, data, o);
  auto p3 = train_world(3, data, o);
  EXPECT_LT(max_rel_err(p3, p1), 1e-9);
}

// A last global batch with fewer rows than ranks (24, 24, then 2 rows over 3
// ranks: 1/1/0) is trained on. The empty rank takes part in every collective
// and contributes nothing; parameters and losses equal one rank's, on the
// empty rank too. `chunk_size` 0: plain DataParallel; > 0: gradient cache.
void expect_empty_rank_equals_one_rank(int64_t chunk_size) {
  auto data = synthetic(50);
  for (const std::string recipe : {"simclr", "moco-v3"}) {
    SCOPED_TRACE(recipe + " chunk_size " + std::to_string(chunk_size));
    auto o = small_options(recipe);
    std::vector<double> l1, l3;
    auto p1 = train_world(1, data, o, &l1);
    auto p3 = train_world(3, data, ct::TrainOptions(o).chunk_size(chunk_size), &l3, /*from_rank=*/2);
    EXPECT_LT(max_rel_err(p3, p1), 1e-9);
    ASSERT_EQ(l1.size(), 3u);
    ASSERT_EQ(l3.size(), 3u);
    for (size_t i = 0; i < l1.size(); ++i) {
      EXPECT_TRUE(std::isfinite(l3[i])) << "step " << i;
      EXPECT_NEAR(l3[i], l1[i], 1e-10 * std::abs(l1[i])) << "step " << i;
    }
    // The 2-row step moved the parameters (it was trained on, not skipped).
    auto p2 = train_world(1, data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).stop_at_step(2)));
    EXPECT_GT(max_rel_err(p1, p2), 1e-6);
  }
}

TEST(Trainer, LastBatchSmallerThanWorldEqualsOneRank) { expect_empty_rank_equals_one_rank(0); }

TEST(Trainer, LastBatchSmallerThanWorldEqualsOneRankGradientCache) { expect_empty_rank_equals_one_rank(5); }

TEST(Trainer, EmptyRankLogsAFiniteLoss) {
  // The metrics line of the step in which rank 2 holds no row.
  auto data = synthetic(50);
  const std::string d = temp_dir("empty_rank_metrics");
  auto o = small_options("simclr");
  o.run().dtype(torch::kFloat).run_dir(d);
  train_world(3, data, o);
  auto losses = losses_of(d + "/metrics.jsonl");
  ASSERT_EQ(losses.size(), 3u);
  for (const auto& l : losses) EXPECT_TRUE(std::isfinite(std::stod(l))) << l;
}

TEST(Trainer, GradientCacheEqualsOneShot) {
  auto data = synthetic(60);
  for (const std::string recipe : {"simclr", "moco-v3"}) {
    auto o = small_options(recipe);
    auto ref = train_world(1, data, o);
    auto gc = train_world(2, data, ct::TrainOptions(o).chunk_size(5));
    EXPECT_LT(max_rel_err(gc, ref), 1e-9) << recipe;
  }
}

TEST(Trainer, ResumeContinuesOnTheSameCurve) {
  auto data = synthetic(60);
  for (const std::string recipe : {"simclr", "moco-v3"}) {
    auto o = small_options(recipe);
    o.run().max_steps(6).dtype(torch::kFloat);
    const std::string a = temp_dir("full_" + recipe), b = temp_dir("half_" + recipe);
    std::vector<double> la, lb1, lb2;
    auto pa = train_world(1, data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(a)), &la);
    train_world(1, data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(b).stop_at_step(3)), &lb1);
    EXPECT_TRUE(ct::is_valid_checkpoint(ct::checkpoint_path(b)));
    auto pb =
        train_world(1, data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(b).resume(true)), &lb2);
    ASSERT_EQ(lb1.size(), 3u);
    ASSERT_EQ(lb2.size(), 3u);
    lb1.insert(lb1.end(), lb2.begin(), lb2.end());
    EXPECT_EQ(lb1, la) << recipe;  // bit-exact: same thread count, same order of operations
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << recipe << " parameter " << i;
    EXPECT_EQ(losses_of(a + "/metrics.jsonl"), losses_of(b + "/metrics.jsonl"));
  }
}

// Issue 29, item 8: the model, AdamW's state, the data order and the
// augmentations are functions of the global batch, seed, epoch and step, so a
// checkpoint of 2 ranks resumes on 1 and on 3 (uneven slices: 8 of 24 rows
// each, 4 of the last batch's 12) on the 2-rank curve: in fp64 to rounding
// (1e-12 relative), in fp32 within 1e-5 relative (the order of the sums over
// ranks differs). Before the fix the resume was refused ("was written by a
// run of 2 processes; this run has 1").
TEST(Trainer, ResumeAtAnotherWorldSizeFollowsTheTwoRankCurve) {
  auto data = synthetic(60);
  for (const std::string recipe : {"simclr", "moco-v3"}) {
    for (const auto dtype : {torch::kDouble, torch::kFloat}) {
      auto o = small_options(recipe);
      o.run().max_steps(6).dtype(dtype);
      const double tol = dtype == torch::kDouble ? 1e-12 : 1e-5;
      const auto in = [&o](const std::string& d) { return ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(d)); };
      std::vector<double> full;
      auto p_full = train_world(2, data, in(temp_dir("ws_full_" + recipe)), &full);
      ASSERT_EQ(full.size(), 6u);
      for (const int64_t world : {1, 3}) {
        const std::string d = temp_dir("ws_" + recipe + "_" + std::to_string(world));
        std::vector<double> first, rest;
        train_world(2, data, ct::TrainOptions(in(d)).run(ct::RunOptions(in(d).run()).stop_at_step(3)), &first);
        auto p = train_world(world, data, ct::TrainOptions(in(d)).run(ct::RunOptions(in(d).run()).resume(true)), &rest);
        first.insert(first.end(), rest.begin(), rest.end());
        ASSERT_EQ(first.size(), full.size()) << recipe << " at " << world;
        for (size_t i = 0; i < full.size(); ++i) {
          EXPECT_NEAR(first[i], full[i], tol * std::abs(full[i])) << recipe << " " << dtype << " resumed at " << world
                                                                  << " ranks, step " << i + 1;
        }
        if (dtype == torch::kDouble) EXPECT_LT(max_rel_err(p, p_full), 1e-9) << recipe << " at " << world;
      }
    }
  }
}

TEST(Trainer, ResumeRejectsOtherSettings) {
  auto data = synthetic(60);
  auto o = small_options("simclr");
  const std::string d = temp_dir("mismatch");
  train_world(1, data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(d).stop_at_step(1)));
  try {
    train_world(1, data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(d).resume(true).batch_size(12)));
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("resume with the same settings"), std::string::npos) << e.what();
  }
}

// A recipe costs a step and its data: least squares on 40 rows through the
// loop alone. Its own setting is recorded and checked on resume, its progress
// text and rate reach the progress line, a stopped run resumes on the same
// curve, and a non-finite step is skipped or stops the run.
TEST(TrainLoop, ARecipeIsAStepAndItsData) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto x = torch::randn({40, 3}, g, torch::kDouble);
  const auto y = x.matmul(torch::tensor({1.0, -2.0, 0.5}, torch::kDouble));
  struct Out {
    ct::RunResult result;
    std::vector<std::string> lines;
  };
  auto train = [&](ct::RunOptions o, int64_t widgets, int64_t nan_at_step = -1) {
    Out out;
    torch::manual_seed(0);
    torch::nn::Linear model(torch::nn::LinearOptions(3, 1).bias(false));
    model->to(torch::kDouble);
    o.batch_size(10).max_steps(8).warmup_steps(0).lr(0.1).log_every(1).log(
        [&out](const std::string& line) { out.lines.push_back(line); });
    ct::TrainLoop loop(nullptr, o,
                       {"least-squares", 40, {{"model", model.get()}}, model->parameters(), {{"widgets", widgets, "widgets"}}});
    ct::Step step;
    step.loss = [&](const ct::StepBatch& b) {
      auto r = model->forward(x.index_select(0, b.indices)).squeeze(1) - y.index_select(0, b.indices);
      auto loss = r.pow(2).mean() * (b.step == nan_at_step ? std::nan("") : 1.0);
      loss.backward();
      return loss;
    };
    step.progress = [] { return std::string("  widgets 3"); };
    step.rate_unit = "rows";
    out.result = loop.run(step);
    return out;
  };
  const std::string a = temp_dir("loop_full"), b = temp_dir("loop_half");
  const auto full = train(ct::RunOptions().run_dir(a), 3);
  ASSERT_EQ(full.result.losses.size(), 8u);
  EXPECT_LT(full.result.losses.back(), 0.5 * full.result.losses.front());
  ASSERT_FALSE(full.lines.empty());
  EXPECT_NE(full.lines[0].find("step 1/8  epoch 1 (1/4)  loss "), std::string::npos) << full.lines[0];
  EXPECT_NE(full.lines[0].find("  widgets 3  lr "), std::string::npos) << full.lines[0];
  EXPECT_NE(full.lines[0].find(" rows/s  ETA "), std::string::npos) << full.lines[0];
  ct::Checkpoint saved;
  saved.load(ct::checkpoint_path(a));
  EXPECT_EQ(saved.strings["recipe"], "least-squares");
  EXPECT_EQ(saved.ints["widgets"], 3);
  EXPECT_EQ(saved.ints["step"], 8);
  // Stopped at step 3 and resumed: the same losses, bit for bit.
  const auto first = train(ct::RunOptions().run_dir(b).stop_at_step(3), 3);
  EXPECT_TRUE(first.result.interrupted);
  const auto rest = train(ct::RunOptions().run_dir(b).resume(true), 3);
  EXPECT_EQ(rest.result.start_step, 3);
  auto both = first.result.losses;
  both.insert(both.end(), rest.result.losses.begin(), rest.result.losses.end());
  EXPECT_EQ(both, full.result.losses);
  // The same stop with a checkpoint of the earlier format: refused (reading
  // it runs the code it holds); resumed only when trusted, on the same
  // curve, and rewritten as safetensors.
  const std::string c = temp_dir("loop_legacy");
  train(ct::RunOptions().run_dir(c).stop_at_step(3), 3);
  rewrite_as_legacy(ct::checkpoint_path(c));
  ASSERT_TRUE(ct::is_legacy_checkpoint(ct::checkpoint_path(c)));
  try {
    train(ct::RunOptions().run_dir(c).resume(true), 3);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is a checkpoint of Contrax's earlier format"), std::string::npos) << e.what();
  }
  const auto trusted = train(ct::RunOptions().run_dir(c).resume(true).trust_legacy_checkpoint(true), 3);
  EXPECT_EQ(trusted.result.losses, rest.result.losses);
  EXPECT_TRUE(ct::is_valid_checkpoint(ct::checkpoint_path(c)));
  // The recipe's own setting must match too.
  try {
    train(ct::RunOptions().run_dir(a).resume(true), 4);
    FAIL() << "expected an error";
  } catch (const ct::TrainError& e) {  // a kind the tool maps to its own words
    EXPECT_EQ(e.kind(), ct::TrainErrorKind::kCheckpointMismatch);
    EXPECT_NE(std::string(e.what()).find("8 steps, 3 widgets; this run has 10, 0, 40, 8, 4 (resume with the same "
                                         "settings)"),
              std::string::npos)
        << e.what();
  }
  // A non-finite step: skipped when allowed (and said so), else the run stops naming it.
  const auto skipped = train(ct::RunOptions().skip_nonfinite(1), 3, /*nan_at_step=*/2);
  EXPECT_EQ(skipped.result.skipped_steps, 1);
  EXPECT_EQ(skipped.result.steps, 8);
  EXPECT_NE(skipped.lines[2].find("NOT APPLIED: non-finite loss"), std::string::npos) << skipped.lines[2];
  try {
    train(ct::RunOptions(), 3, /*nan_at_step=*/2);
    FAIL() << "expected an error";
  } catch (const ct::Diverged& e) {
    // Typed, with what a caller words in its own terms (the tool: its flags).
    EXPECT_EQ(e.kind(), ct::TrainErrorKind::kDiverged);
    EXPECT_EQ(e.step, 3);
    EXPECT_EQ(e.total_steps, 8);
    EXPECT_TRUE(std::isnan(e.loss));
    EXPECT_FALSE(e.loss_finite);
    EXPECT_EQ(e.skip_nonfinite, 0);
    EXPECT_EQ(e.fact().rfind("training diverged at step 3/8: the loss is not finite (loss nan, lr ", 0), 0u)
        << e.fact();
    EXPECT_NE(std::string(e.what()).find("training diverged at step 3/8: the loss is not finite"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("; lower the learning rate (lr) or allow skipping such steps "
                                         "(skip_nonfinite)"),
              std::string::npos)
        << e.what();
  }
}

TEST(Trainer, ErrorsNameTheOption) {
  auto data = synthetic(30);
  auto o = small_options("simclr");
  o.run().max_steps(1);
  auto error = [&](const ct::Dataset& d, const ct::TrainOptions& opts) {
    try {
      ct::train_contrastive(nullptr, d, opts);
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  struct Case {
    ct::TrainOptions options;
    std::string message;
  };
  const std::string file = temp_dir("not_a_dir");
  { std::ofstream(file) << "x"; }
  for (const auto& c : std::vector<Case>{
           {ct::TrainOptions(o).recipe("byol"), "recipe must be 'simclr' or 'moco-v3', but got 'byol'"},
           {ct::TrainOptions(o).run(ct::RunOptions(o.run()).batch_size(0)), "batch size must be >= 1, but got 0"},
           {ct::TrainOptions(o).chunk_size(-1), "chunk size must be >= 0, but got -1"},
           {ct::TrainOptions(o).run(ct::RunOptions(o.run()).dtype(torch::kHalf)), "dtype must be float or double"},
           {ct::TrainOptions(o).run(ct::RunOptions(o.run()).resume(true)), "resuming needs a run directory"},
           {ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(file + "/run")),
            "cannot create run directory '" + file + "/run/'"},
       }) {
    auto msg = error(data, c.options);
    EXPECT_NE(msg.find(c.message), std::string::npos) << c.message << "\n" << msg;
  }
  auto msg = error(ct::Dataset{torch::zeros({0, 1, 28, 28}, torch::kUInt8), torch::zeros({0}, torch::kInt64)}, o);
  EXPECT_NE(msg.find("the training set is empty"), std::string::npos) << msg;
  // metrics.jsonl cannot be opened (a directory of that name).
  const std::string blocked = temp_dir("metrics_blocked");
  std::filesystem::create_directories(blocked + "/metrics.jsonl");
  msg = error(data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(blocked)));
  EXPECT_NE(msg.find("cannot write " + blocked + "/metrics.jsonl"), std::string::npos) << msg;
  // Resuming a SimCLR checkpoint as MoCo v3.
  const std::string d = temp_dir("other_recipe");
  train_world(1, data, ct::TrainOptions(o).run(ct::RunOptions(o.run()).run_dir(d)));
  auto moco = small_options("moco-v3");
  moco.run().max_steps(1).run_dir(d).resume(true);
  msg = error(data, moco);
  EXPECT_NE(msg.find("checkpoint " + ct::checkpoint_path(d) + " is of recipe 'simclr', not 'moco-v3'"),
            std::string::npos)
      << msg;
}

TEST(TrainCli, TwoProcessResumeEqualsUninterrupted) {
  const std::string a = temp_dir("cli_full"), b = temp_dir("cli_half");
  auto full = run_cli(std::string(kFastCli) + " --nproc 2 --max-steps 6 --run-dir " + a);
  ASSERT_EQ(full.status, 0) << full.out;
  auto half = run_cli(std::string(kFastCli) + " --nproc 2 --max-steps 6 --stop-at-step 3 --run-dir " + b);
  ASSERT_EQ(half.status, 0) << half.out;
  EXPECT_NE(half.out.find("stopped at step 3/6"), std::string::npos) << half.out;
  auto rest = run_cli(std::string(kFastCli) + " --nproc 2 --max-steps 6 --resume --run-dir " + b);
  ASSERT_EQ(rest.status, 0) << rest.out;
  auto la = losses_of(a + "/metrics.jsonl"), lb = losses_of(b + "/metrics.jsonl");
  EXPECT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb);
}

// Issue 29, item 8, through the tool and the launcher: `--nproc 2` stopped at
// step 3, resumed with `--nproc 1` and with `--nproc 3`, follows the
// uninterrupted 2-process curve in fp64 to rounding.
TEST(TrainCli, TwoProcessCheckpointResumesAtOneAndThreeProcessesOnTheSameCurve) {
  const std::string flags = std::string(kFastCli) + " --dtype double --max-steps 6 --run-dir ";
  const std::string a = temp_dir("cli_ws_full");
  auto full = run_cli(flags + a + " --nproc 2");
  ASSERT_EQ(full.status, 0) << full.out;
  const auto la = losses_of(a + "/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  for (const int nproc : {1, 3}) {
    const std::string b = temp_dir("cli_ws_" + std::to_string(nproc));
    auto half = run_cli(flags + b + " --nproc 2 --stop-at-step 3");
    ASSERT_EQ(half.status, 0) << half.out;
    auto rest = run_cli(flags + b + " --nproc " + std::to_string(nproc) + " --resume");
    ASSERT_EQ(rest.status, 0) << "--nproc " << nproc << "\n" << rest.out;
    const auto lb = losses_of(b + "/metrics.jsonl");
    ASSERT_EQ(lb.size(), la.size()) << rest.out;
    for (size_t i = 0; i < la.size(); ++i) {
      EXPECT_NEAR(std::stod(lb[i]), std::stod(la[i]), 1e-12 * std::abs(std::stod(la[i])))
          << "--nproc " << nproc << ", step " << i + 1;
    }
  }
}

TEST(TrainCli, TwoProcessesTrainALastBatchOfOneRow) {
  // 129 examples at global batch 64: the third batch is one row, so rank 1
  // holds none; real processes must neither hang nor log a NaN.
  const std::string d = temp_dir("cli_one_row");
  auto r = run_cli("--train-limit 129 --batch-size 64 --warmup-steps 1 --no-eval --no-verify --log-every 1 "
                   "--threads 1 --nproc 2 --epochs 1 --timeout 60 --no-plot --run-dir " + d);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("step 3/3  epoch 1 (3/3)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("nan"), std::string::npos) << r.out;  // the printed losses too
  auto losses = losses_of(d + "/metrics.jsonl");
  ASSERT_EQ(losses.size(), 3u);
  for (const auto& l : losses) EXPECT_TRUE(std::isfinite(std::stod(l))) << l;
}

TEST(TrainCli, JsonSummaryWithEvaluation) {
  const std::string d = temp_dir("cli_json");
  auto r = run_cli("--nproc 2 --train-limit 256 --batch-size 64 --max-steps 2 --eval-limit 300 --json --threads 1 --no-plot "
                   "--run-dir " + d);
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* key : {"\"linear_probe_acc\":", "\"knn_acc\":", "\"random_init_linear_probe_acc\":",
                          "\"raw_pixel_linear_probe_acc\":", "\"random_init_knn_acc\":", "\"raw_pixel_knn_acc\":",
                          "\"linear_probe_l2\":", "\"raw_pixel_linear_probe_l2\":", "\"eval_s\":",
                          "\"examples_per_s\":", "\"wall_s\":", "\"steps\":2", "\"world_size\":2",
                          "\"recipe\":\"simclr\"", "\"verify\":{\"ok\":true,\"max_rel_err\":", "\"cases\":"}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << key << "\n" << r.out;
  }
}

TEST(TrainCli, EvaluationLongerThanTheCollectiveTimeoutIsFine) {
  // Rank 0 evaluates alone after the last collective. With a 2 s collective
  // timeout and an evaluation that takes longer (3000 images, three probes
  // with an L2 search: several seconds), a peer waiting for rank 0 in a
  // collective would time out and fail the run.
  const std::string d = temp_dir("cli_slow_eval");
  auto r = run_cli("--nproc 2 --train-limit 128 --batch-size 64 --max-steps 1 --eval-limit 3000 --json --threads 1 --no-plot "
                   "--timeout 2 --run-dir " + d);
  ASSERT_EQ(r.status, 0) << r.out;
  const auto at = r.out.find("\"eval_s\":");
  ASSERT_NE(at, std::string::npos) << r.out;
  // The premise: the evaluation really outlasted the timeout.
  EXPECT_GT(std::stod(r.out.substr(at + 9)), 2.0) << r.out;
}

TEST(TrainCli, SigtermStopsCleanlyWithACheckpoint) {
  const std::string d = temp_dir("cli_sigterm");
  const std::string cmd = std::string(CONTRAX_CLI_PATH) + " train " + kFastCli +
                          " --nproc 2 --max-steps 100000 --checkpoint-every 0 --run-dir " + d;
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setpgid(0, 0);
    ::execl("/bin/sh", "sh", "-c", ("exec " + cmd + " > /dev/null 2>&1").c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Wait for a few steps to be logged.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (losses_of(d + "/metrics.jsonl").size() < 3 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_GE(losses_of(d + "/metrics.jsonl").size(), 3u);
  ::kill(pid, SIGTERM);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 128 + SIGTERM);
  const std::string ck = ct::checkpoint_path(d);
  ASSERT_TRUE(ct::is_valid_checkpoint(ck));
  ct::Checkpoint c;
  c.load(ck);
  EXPECT_GE(c.ints["step"], 3);
  EXPECT_LT(c.ints["step"], 100000);
  EXPECT_EQ(c.strings["recipe"], "simclr");
  // And the run continues from it.
  auto r = run_cli(std::string(kFastCli) + " --nproc 2 --max-steps " + std::to_string(c.ints["step"] + 1) +
                   " --resume --run-dir " + d);
  EXPECT_NE(r.status, 0);  // a different --max-steps changes the schedule: refused
  EXPECT_NE(r.out.find("resume with the same flags"), std::string::npos) << r.out;
}

TEST(TrainCli, FlagErrors) {
  struct Case {
    std::string args, message;
    int status;  // 2: a usage error (the flag's value); 1: what the value leads to
  };
  for (const auto& c : std::vector<Case>{
           {"--recipe byol", "flag '--recipe' must be simclr, moco-v3 or retrieval, but got 'byol'", 2},
           {"--batch-size 0", "flag '--batch-size' must be >= 1", 2},
           {"--chunk-size -1", "flag '--chunk-size' must be >= 0", 2},
           {"--nproc 0", "flag '--nproc' must be >= 1", 2},
           {"--dtype half", "flag '--dtype' must be float or double", 2},
           {"--eval-limit 0", "flag '--eval-limit' must be -1 (all) or >= 1, but got 0", 2},
           {"--probe-limit -2", "flag '--probe-limit' must be >= -1, but got -2", 2},
           {"--lr x", "--lr", 2},
           {"--no-such-flag 1", "no-such-flag", 2},
           {"--nproc 1 --no-plot --data /nonexistent/dir --run-dir " + temp_dir("no_data"), "/nonexistent/dir", 1},
           {"--nproc 1 --resume --run-dir /nonexistent/run", "/nonexistent/run/checkpoint.pt", 2},
       }) {
    auto r = run_cli(c.args);
    EXPECT_EQ(r.status, c.status) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.message), std::string::npos) << c.args << "\n" << r.out;
  }
  auto h = run_cli("--help");
  EXPECT_EQ(h.status, 0);
  EXPECT_NE(h.out.find("--chunk-size"), std::string::npos) << h.out;
}
