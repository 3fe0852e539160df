// `contrax train` end to end, its flags and its runs: --config /
// --dump-config, the recipes' defaults (a word after train, or --recipe;
// --recipe-variant), the run directory's rules (an existing run is refused
// and left byte-identical, --resume auto, the lock), strict JSON in
// metrics.jsonl and the summary (also after a divergence), the live progress
// line, a failed write, restarts after a failure, and --device cuda. The
// other subcommands, and the flag errors of all, are in cli_test.cpp.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <ATen/Context.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdlib>
#include <functional>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "contrax/check/build_info.h"
#include "contrax/check/verify.h"
#include "contrax/launch/launcher.h"
#include "contrax/train/image/trainer.h"
#include "contrax/train/retrieval/trainer.h"
#include "contrax/util/memory.h"
#include "support/cli.h"
#include "support/processes.h"

namespace {

namespace fs = std::filesystem;
using contrax::testing::kTinyTrain;
using contrax::testing::read_file;
using contrax::testing::run_cli;
using contrax::testing::run_cli_stdout;
using contrax::testing::run_shell;
using Json = nlohmann::json;

std::string temp_dir(const std::string& name) { return contrax::testing::scratch_dir(name); }

// Each file's size and a hash of its bytes (printable when a test fails). The
// lock file is not part of the run: a refused run records its pid there.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || name == ".lock") continue;
    const std::string bytes = read_file(e.path().string());
    files[name] = std::to_string(bytes.size()) + " bytes, hash " + std::to_string(std::hash<std::string>()(bytes));
  }
  return files;
}

// Every line parses with nlohmann's strict parser (NaN, -nan, inf are not JSON).
std::vector<Json> parse_lines(const std::string& path) {
  std::vector<Json> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    EXPECT_NO_THROW(rows.push_back(Json::parse(line))) << path << ": " << line;
  }
  return rows;
}

// The last line of the output that parses as a JSON object (the --json summary).
Json last_json_object(const std::string& out) {
  std::istringstream in(out);
  std::string line;
  Json found;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] != '{') continue;
    found = Json::parse(line);  // throws (fails the test) on anything not strict JSON
  }
  return found;
}

}  // namespace

TEST(Cli, ConfigRoundTripsDumpConfig) {
  const std::string d = temp_dir("config");
  auto first = run_cli_stdout("train --lr 0.5 --batch-size 32 --recipe moco-v3 --resume auto --no-eval --data " + d +
                              " --dump-config");
  ASSERT_EQ(first.status, 0) << first.out;
  EXPECT_NE(first.out.find("lr=0.5"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("recipe=\"moco-v3\""), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("epochs=" + std::to_string(contrax::train::TrainOptions().run().epochs())), std::string::npos)
      << "defaults are written too\n"
      << first.out;
  { std::ofstream(d + "/run.toml") << first.out; }
  auto second = run_cli_stdout("train --config " + d + "/run.toml --dump-config");
  ASSERT_EQ(second.status, 0) << second.out;
  EXPECT_EQ(second.out, first.out);
  // A flag given on the command line wins over the file.
  auto third = run_cli_stdout("train --config " + d + "/run.toml --lr 0.25 --dump-config");
  EXPECT_NE(third.out.find("lr=0.25"), std::string::npos) << third.out;
  // Values in the file are checked like flags.
  { std::ofstream(d + "/bad.toml") << "batch-size=0\n"; }
  auto bad = run_cli("train --config " + d + "/bad.toml --dump-config");
  EXPECT_EQ(bad.status, 2) << bad.out;
  EXPECT_NE(bad.out.find("flag '--batch-size' must be >= 1, but got 0"), std::string::npos) << bad.out;
  auto missing = run_cli("train --config " + d + "/none.toml");
  EXPECT_EQ(missing.status, 2) << missing.out;
  EXPECT_NE(missing.out.find("none.toml"), std::string::npos) << missing.out;
}

static std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i > 0 ? "," : "") + std::to_string(v[i]);
  return s;
}

TEST(Cli, DefaultsComeFromTheLibrarysOptions) {
  // One place for every default: what `--dump-config` shows is what the
  // options structs hold.
  auto train = run_cli_stdout("train --dump-config");
  ASSERT_EQ(train.status, 0);
  const contrax::train::TrainOptions t;
  for (const std::string line :
       {"recipe=\"" + t.recipe() + "\"", "epochs=" + std::to_string(t.run().epochs()),
        "batch-size=" + std::to_string(t.run().batch_size()), "warmup-steps=" + std::to_string(t.run().warmup_steps()),
        "checkpoint-every=" + std::to_string(t.run().checkpoint_every()), "log-every=" + std::to_string(t.run().log_every()),
        "skip-nonfinite=" + std::to_string(t.run().skip_nonfinite()),
        "encoder-channels=\"" + join(t.model().encoder().channels()) + "\"",
        "encoder-strides=\"" + join(t.model().encoder().strides()) + "\"",
        "encoder-pool-grid=" + std::to_string(t.model().encoder().pool_grid())}) {
    EXPECT_NE(train.out.find("\n" + line + "\n"), std::string::npos) << line << "\n" << train.out;
  }
  EXPECT_EQ(t.run().lr(), 2e-3);  // the default run's recipe, unchanged
  EXPECT_EQ(t.run().epochs(), 10);
  EXPECT_NE(train.out.find("\nlr=0.002\n"), std::string::npos) << train.out;
  // The retrieval recipe shows its own defaults for the flags it shares.
  auto retrieval = run_cli_stdout("train --recipe retrieval --dump-config");
  ASSERT_EQ(retrieval.status, 0);
  const contrax::train::RetrievalOptions r;
  for (const std::string line :
       {std::string("recipe=\"retrieval\""), "epochs=" + std::to_string(r.run().epochs()),
        "batch-size=" + std::to_string(r.run().batch_size()), "warmup-steps=" + std::to_string(r.run().warmup_steps()),
        "checkpoint-every=" + std::to_string(r.run().checkpoint_every()), "log-every=" + std::to_string(r.run().log_every()),
        "hard-negatives=" + std::to_string(r.hard_negatives())}) {
    EXPECT_NE(retrieval.out.find("\n" + line + "\n"), std::string::npos) << line << "\n" << retrieval.out;
  }
  EXPECT_NE(r.run().epochs(), t.run().epochs());  // else the check above shows nothing
  auto verify = run_cli_stdout("verify --dump-config");
  const contrax::VerifyOptions v;
  EXPECT_NE(verify.out.find("\nwidth=" + std::to_string(v.width()) + "\n"), std::string::npos) << verify.out;
  auto launch = run_cli_stdout("launch --dump-config");
  const contrax::LaunchOptions l;
  EXPECT_NE(launch.out.find("\ngrace-ms=" + std::to_string(l.grace.count()) + "\n"), std::string::npos)
      << launch.out;
  EXPECT_NE(launch.out.find("\nmaster-addr=\"" + l.master_addr + "\"\n"), std::string::npos) << launch.out;
}

TEST(Cli, RecipeVariantPeerRestoresThePeersRecipeAndFlagsStillWin) {
  const auto p = contrax::train::peer_recipe();
  const auto& enc = p.model().encoder();
  std::ostringstream lr, t, crop;
  lr << "\nlr=" << p.run().lr() << "\n";
  t << "\ntemperature=" << p.temperature() << "\n";
  crop << "\ncrop-scale-min=" << p.augment().scale_min() << "\n";
  const std::vector<std::string> peer_lines{"\nencoder-channels=\"" + join(enc.channels()) + "\"\n",
                                            "\nencoder-strides=\"" + join(enc.strides()) + "\"\n",
                                            "\nencoder-pool-grid=" + std::to_string(enc.pool_grid()) + "\n",
                                            "\nepochs=" + std::to_string(p.run().epochs()) + "\n",
                                            lr.str(), t.str(), crop.str()};
  EXPECT_EQ(join(enc.channels()), "32,64,128");  // what simclr_torch_ddp.py builds
  EXPECT_EQ(join(enc.strides()), "2,2,1");
  const std::string d = temp_dir("variant");
  auto peer = run_cli_stdout("train --recipe-variant peer --dump-config");
  ASSERT_EQ(peer.status, 0) << peer.out;
  EXPECT_NE(peer.out.find("\nrecipe-variant=\"peer\"\n"), std::string::npos) << peer.out;
  for (const auto& line : peer_lines) EXPECT_NE(peer.out.find(line), std::string::npos) << line << peer.out;
  // A flag given explicitly wins over the variant's value, in either order.
  for (const std::string args : {"--temperature 0.7 --recipe-variant peer", "--recipe-variant=peer --temperature 0.7"}) {
    auto mixed = run_cli_stdout("train " + args + " --dump-config");
    EXPECT_NE(mixed.out.find("\ntemperature=0.7\n"), std::string::npos) << args << "\n" << mixed.out;
    EXPECT_NE(mixed.out.find(peer_lines[0]), std::string::npos) << args << "\n" << mixed.out;
  }
  // A variant set only in a config file applies too.
  { std::ofstream(d + "/peer.toml") << "recipe-variant=\"peer\"\n"; }
  auto from_file = run_cli("train --config " + d + "/peer.toml --no-eval --no-verify --no-plot --nproc 1 --threads 1 "
                           "--train-limit 64 --batch-size 32 --max-steps 1 --json --run-dir " + d + "/run");
  ASSERT_EQ(from_file.status, 0) << from_file.out;
  std::ifstream cfg(d + "/run/config.json");
  const auto settings = Json::parse(cfg)["settings"];
  EXPECT_EQ(settings["encoder_channels"], join(enc.channels())) << settings.dump();
  EXPECT_EQ(settings["crop_scale_min"], p.augment().scale_min()) << settings.dump();
  EXPECT_EQ(settings["temperature"], p.temperature()) << settings.dump();
  // The default is not the peer's encoder.
  auto def = run_cli_stdout("train --dump-config");
  EXPECT_EQ(def.out.find(peer_lines[0]), std::string::npos) << def.out;
}

TEST(Cli, RecipesAreWordsAfterTrainAndRecipeIsTheirAlias) {
  // `contrax train RECIPE` and `contrax train --recipe RECIPE` are one command
  // with one set of settings; plain `contrax train` is simclr.
  for (const std::string recipe : {"simclr", "moco-v3", "retrieval"}) {
    auto word = run_cli_stdout("train " + recipe + " --lr 0.5 --dump-config");
    auto flag = run_cli_stdout("train --lr 0.5 --recipe " + recipe + " --dump-config");
    ASSERT_EQ(word.status, 0) << recipe << "\n" << word.out;
    EXPECT_EQ(word.out, flag.out) << recipe;
    EXPECT_NE(word.out.find("\nrecipe=\"" + recipe + "\"\n"), std::string::npos) << word.out;
  }
  EXPECT_EQ(run_cli_stdout("train --dump-config").out, run_cli_stdout("train simclr --dump-config").out);
  // Each recipe's help shows its own flags and defaults.
  const contrax::train::RetrievalOptions r;
  auto retrieval = run_cli("train retrieval --help");
  ASSERT_EQ(retrieval.status, 0) << retrieval.out;
  // CLI11 prints a flag's default after '=' ("--epochs INT:INT>=1=3", CLI11
  // 2.3 on bookworm) or in brackets ("--epochs INT:INT>=1 [3]", 2.4 on trixie).
  const auto line = [](const std::string& help, const std::string& flag) {
    const auto at = help.find("  " + flag + " ");
    return at == std::string::npos ? std::string() : help.substr(at, help.find('\n', at) - at) + " ";
  };
  const auto shows = [](const std::string& line, int64_t value) {
    const auto v = std::to_string(value);
    return line.find("=" + v + " ") != std::string::npos || line.find(" [" + v + "] ") != std::string::npos;
  };
  EXPECT_TRUE(shows(line(retrieval.out, "--epochs"), r.run().epochs())) << retrieval.out;
  EXPECT_TRUE(shows(line(retrieval.out, "--batch-size"), r.run().batch_size())) << retrieval.out;
  EXPECT_NE(line(retrieval.out, "--hard-negatives"), "") << retrieval.out;
  EXPECT_EQ(line(retrieval.out, "--encoder-channels"), "") << "an image recipe's flag\n" << retrieval.out;
  auto moco = run_cli("train moco-v3 --help");
  const contrax::train::TrainOptions t;
  EXPECT_TRUE(shows(line(moco.out, "--epochs"), t.run().epochs())) << moco.out;
  EXPECT_TRUE(shows(line(moco.out, "--batch-size"), t.run().batch_size())) << moco.out;
  EXPECT_NE(line(moco.out, "--moco-momentum"), "") << moco.out;
  EXPECT_EQ(line(moco.out, "--hard-negatives"), "") << "the retrieval recipe's flag\n" << moco.out;
  EXPECT_NE(moco.out.find("contrax train RECIPE --help"), std::string::npos) << moco.out;
  // A recipe's flag is refused by another recipe; the word and --recipe must agree.
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"train retrieval --encoder-channels 8,16", "--encoder-channels"},
           {"train moco-v3 --hard-negatives 2", "--hard-negatives"},
           {"train retrieval --recipe simclr", "flag '--recipe' says simclr but the recipe is retrieval"}}) {
    auto bad = run_cli(args + " --dump-config");
    EXPECT_EQ(bad.status, 2) << args << "\n" << bad.out;
    EXPECT_NE(bad.out.find(message), std::string::npos) << args << "\n" << bad.out;
  }
}

TEST(Cli, SecondTrainIntoARunDirIsRefusedAndTheRunStaysByteIdentical) {
  const std::string d = temp_dir("refuse") + "/run";
  auto first = run_cli(kTinyTrain + " --run-dir " + d);
  ASSERT_EQ(first.status, 0) << first.out;
  for (const char* f : {"checkpoint.pt", "metrics.jsonl", "config.json", "train.log", "results.json"}) {
    EXPECT_TRUE(fs::exists(d + "/" + f)) << f;
  }
  // train.log holds what the console showed.
  EXPECT_NE(read_file(d + "/train.log").find("step 3/3"), std::string::npos) << read_file(d + "/train.log");
  const auto before = snapshot(d);
  auto again = run_cli(kTinyTrain + " --run-dir " + d);
  EXPECT_EQ(again.status, 2) << again.out;
  EXPECT_NE(again.out.find("run directory '" + d + "' already holds a run"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("--resume"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("--overwrite"), std::string::npos) << again.out;
  EXPECT_EQ(snapshot(d), before) << "a refused run changed the first run's files";
  // --resume without a checkpoint names the path and leaves no directory behind.
  auto none = run_cli(kTinyTrain + " --resume --run-dir " + d + "/missing");
  EXPECT_EQ(none.status, 2) << none.out;
  EXPECT_NE(none.out.find("no checkpoint " + d + "/missing/checkpoint.pt"), std::string::npos) << none.out;
  EXPECT_FALSE(fs::exists(d + "/missing"));
  // --overwrite replaces it.
  auto over = run_cli(kTinyTrain + " --overwrite --max-steps 2 --run-dir " + d);
  ASSERT_EQ(over.status, 0) << over.out;
  EXPECT_EQ(parse_lines(d + "/metrics.jsonl").size(), 2u);
}

TEST(Cli, ResumeAutoStartsFreshThenReEvaluatesAFinishedRun) {
  const std::string d = temp_dir("auto") + "/run";
  auto fresh = run_cli(kTinyTrain + " --json --resume auto --run-dir " + d);
  ASSERT_EQ(fresh.status, 0) << fresh.out;
  Json s = last_json_object(fresh.out);
  EXPECT_EQ(s["steps"], 3);
  EXPECT_EQ(s["steps_run"], 3);
  EXPECT_EQ(s["start_step"], 0);
  const auto ckpt = snapshot(d)["checkpoint.pt"];
  auto again = run_cli(kTinyTrain + " --json --resume auto --run-dir " + d);
  ASSERT_EQ(again.status, 0) << again.out;
  s = last_json_object(again.out);
  EXPECT_EQ(s["steps"], 3);
  EXPECT_EQ(s["steps_run"], 0) << "a finished run is re-evaluated, not trained again";
  EXPECT_EQ(parse_lines(d + "/metrics.jsonl").size(), 3u);
  EXPECT_EQ(snapshot(d)["checkpoint.pt"], ckpt);
  // results.json is the summary.
  Json results = Json::parse(read_file(d + "/results.json"));
  EXPECT_EQ(results["steps"], 3);
  Json config = Json::parse(read_file(d + "/config.json"));
  EXPECT_EQ(config["settings"]["resume"], "auto");
  EXPECT_EQ(config["world_size"], 1);
  EXPECT_EQ(config["resumed"], true);
  EXPECT_EQ(config["versions"]["libtorch"].get<std::string>(), TORCH_VERSION);
}

TEST(Cli, ASecondRunWhileTheFirstHoldsTheLockIsRefused) {
  const std::string d = temp_dir("lock");
  // The test holds the lock as a running train would.
  const int fd = ::open((d + "/.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_EQ(::write(fd, "4242\n", 5), 5);
  auto r = run_cli(kTinyTrain + " --run-dir " + d);
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("run directory '" + d + "' is in use by another run (pid 4242)"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(d + "/metrics.jsonl"));
  ::close(fd);
  // Released (the holder ended): the run goes ahead; a stale temporary of a
  // killed writer is removed at the start.
  { std::ofstream(d + "/checkpoint.pt.tmp.999999999") << "partial"; }
  r = run_cli(kTinyTrain + " --run-dir " + d);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_FALSE(fs::exists(d + "/checkpoint.pt.tmp.999999999"));
}

TEST(Cli, MetricsAndSummaryAreStrictJsonCountedFromOne) {
  const std::string d = temp_dir("json") + "/run";
  auto r = run_cli_stdout(kTinyTrain + " --train-limit 160 --json --run-dir " + d);  // 64 + 64 + 32: a short last batch
  ASSERT_EQ(r.status, 0) << r.out;
  Json s = Json::parse(r.out);  // stdout is the summary alone
  EXPECT_EQ(s["recipe"], "simclr");
  EXPECT_TRUE(s["final_loss"].is_number());
  EXPECT_FALSE(s.contains("nonfinite"));
  auto rows = parse_lines(d + "/metrics.jsonl");
  ASSERT_EQ(rows.size(), 3u);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i]["step"], i + 1);
    EXPECT_EQ(rows[i]["epoch"], 1);
    EXPECT_EQ(rows[i]["step_in_epoch"], i + 1);
    EXPECT_TRUE(rows[i]["loss"].is_number());
    EXPECT_TRUE(rows[i]["lr"].is_number());
    EXPECT_GT(rows[i]["examples_per_s"].get<double>(), 0);
    EXPECT_EQ(rows[i]["bytes_sent"], 0) << "one process sends nothing";
    EXPECT_EQ(rows[i]["applied"], true);
  }
  EXPECT_EQ(rows[0]["rows"], 64);
  EXPECT_EQ(rows[2]["rows"], 32) << "the short last batch says it had fewer rows";
}

// Issue 27, item 2: on a terminal, one line redrawn in place per phase
// (training as a bar, then the exactness check and the evaluation, part by
// part); piped, the periodic plain lines. train.log keeps every line either
// way. The terminal is a pseudo-terminal from `script` (util-linux); the two
// processes' output reaches it through the launcher's pipes.
TEST(Cli, ProgressIsOneLiveLineOnATerminalAndPlainLinesInAPipe) {
  if (run_shell("command -v script >/dev/null").status != 0) GTEST_SKIP() << "script (util-linux) is not installed";
  const std::string d = temp_dir("progress");
  const std::string args = " train --nproc 2 --threads 1 --train-limit 256 --batch-size 64 --max-steps 6 "
                           "--warmup-steps 1 --log-every 1 --eval-limit 300 --no-plot --run-dir ";
  auto tty = run_shell("TERM=xterm COLUMNS=120 script -qefc \"" + std::string(CONTRAX_CLI_PATH) + args + d +
                       "/tty\" /dev/null </dev/null 2>&1");
  ASSERT_EQ(tty.status, 0) << tty.out;
  EXPECT_NE(tty.out.find("\rtrain [########################] 100%  step 6/6  epoch 2/2"), std::string::npos) << tty.out;
  EXPECT_NE(tty.out.find("verify  the distributed gradients"), std::string::npos) << tty.out;
  for (const char* part : {"trained encoder (1/3)", "random init (2/3)", "raw pixels (3/3)"}) {
    EXPECT_NE(tty.out.find(std::string("\revaluate  ") + part), std::string::npos) << part << "\n" << tty.out;
  }
  EXPECT_EQ(tty.out.find("epoch 1 (1/4)"), std::string::npos) << "no plain progress lines on a terminal\n" << tty.out;
  EXPECT_NE(tty.out.find("linear probe acc"), std::string::npos) << "the table follows\n" << tty.out;
  // Without --threads, the finished rank's core is the evaluation's: its three
  // parts run side by side, each part's stage on the one line.
  auto wide = run_shell("TERM=xterm COLUMNS=200 script -qefc \"" + std::string(CONTRAX_CLI_PATH) +
                        " train --nproc 2 --train-limit 128 --batch-size 64 --max-steps 2 --warmup-steps 1 "
                        "--eval-limit 300 --no-plot --no-verify --run-dir " +
                        d + "/wide\" /dev/null </dev/null 2>&1");
  ASSERT_EQ(wide.status, 0) << wide.out;
  EXPECT_NE(wide.out.find("\revaluate  3 parts at once: trained encoder: "), std::string::npos) << wide.out;
  EXPECT_NE(wide.out.find("linear probe acc"), std::string::npos) << "the table follows\n" << wide.out;
  auto pipe = run_cli(args.substr(1) + d + "/pipe");
  ASSERT_EQ(pipe.status, 0) << pipe.out;
  EXPECT_EQ(pipe.out.find('\r'), std::string::npos) << pipe.out;
  EXPECT_NE(pipe.out.find("step 1/6  epoch 1 (1/4)"), std::string::npos) << pipe.out;
  for (const char* run : {"/tty", "/pipe"}) {
    const std::string log = read_file(d + run + "/train.log");
    for (int step = 1; step <= 6; ++step) {
      EXPECT_NE(log.find("step " + std::to_string(step) + "/6  epoch"), std::string::npos) << run << "\n" << log;
    }
    EXPECT_EQ(log.find('\r'), std::string::npos) << run << "\n" << log;
  }
}

TEST(Cli, DivergenceStopsNamingTheStepAndKeepsTheLastGoodCheckpoint) {
  const std::string d = temp_dir("diverge") + "/run";
  auto half = run_cli(kTinyTrain + " --max-steps 6 --stop-at-step 2 --run-dir " + d);
  ASSERT_EQ(half.status, 0) << half.out;
  const auto good = snapshot(d)["checkpoint.pt"];
  ASSERT_FALSE(good.empty());
  auto bad = run_cli(kTinyTrain + " --max-steps 6 --lr 1e30 --temperature 0.001 --resume --run-dir " + d);
  EXPECT_EQ(bad.status, 1) << bad.out;
  EXPECT_NE(bad.out.find("training diverged at step "), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("is not finite"), std::string::npos) << bad.out;
  // Issue 29, item 5: the message names the likely cause among the flags set.
  EXPECT_NE(bad.out.find("; likely cause among the flags set: --temperature 0.001 (logits up to 1/T = 1000; the "
                         "recipe's is 0.1), --lr 1e+30 (the recipe's is 0.002)"),
            std::string::npos)
      << bad.out;
  EXPECT_EQ(snapshot(d)["checkpoint.pt"], good) << "the last good checkpoint was overwritten";
  EXPECT_NE(read_file(d + "/train.log").find("training diverged at step"), std::string::npos);
  // Every metrics line still parses; the bad step's loss is null and flagged.
  auto rows = parse_lines(d + "/metrics.jsonl");
  ASSERT_GE(rows.size(), 3u);
  EXPECT_EQ(rows.back()["applied"], false);
  EXPECT_TRUE(rows.back()["loss"].is_null() || rows.back()["loss"].is_number());
}

TEST(Cli, SkippedNonFiniteStepsGiveStrictJsonWithNullAndAFlag) {
  const std::string d = temp_dir("lr1e30") + "/run";
  auto r = run_cli_stdout(kTinyTrain + " --max-steps 4 --lr 1e30 --skip-nonfinite 10 --json --run-dir " + d);
  ASSERT_EQ(r.status, 0) << r.out;
  Json s = Json::parse(r.out);
  EXPECT_GE(s["skipped_steps"].get<int64_t>(), 1);
  bool any_null = false;
  for (const auto& row : parse_lines(d + "/metrics.jsonl")) {
    if (row["loss"].is_null()) {
      any_null = true;
      EXPECT_EQ(row["nonfinite"], Json::array({"loss"})) << row.dump();
      EXPECT_EQ(row["applied"], false) << row.dump();
    }
  }
  EXPECT_TRUE(any_null) << read_file(d + "/metrics.jsonl");
  EXPECT_TRUE(s["final_loss"].is_null()) << s.dump();
  EXPECT_NE(s["nonfinite"].dump().find("final_loss"), std::string::npos) << s.dump();
}

TEST(Cli, AFailedMetricsWriteStopsTheRunWithTheCause) {
  // RLIMIT_FSIZE of 8 KiB (SIGXFSZ ignored, so writes fail with EFBIG): the
  // metrics file outgrows it after a few dozen steps, long before the end.
  const std::string d = temp_dir("fsize") + "/run";
  const std::string cmd =
      "bash -c \"trap '' XFSZ; ulimit -f 8; exec " + std::string(CONTRAX_CLI_PATH) + " " + kTinyTrain +
      " --log-every 0 --train-limit 64 --max-steps 400 --checkpoint-every 0 --run-dir " + d + "\" 2>&1";
  const auto r = contrax::testing::run_shell(cmd);
  const std::string& out = r.out;
  ASSERT_NE(r.status, -1) << out;  // exited, not killed by a signal
  // The run stops at once with the cause. Its final checkpoint (2 MB) cannot
  // be written under the same limit either: that is an error too (exit 1,
  // never an abort from the archive writer).
  EXPECT_EQ(r.status, 1) << out;
  EXPECT_NE(out.find("contrax train: cannot write " + d + "/metrics.jsonl: File too large"), std::string::npos)
      << out;
  EXPECT_NE(out.find("stopping at the next step boundary"), std::string::npos) << out;
  EXPECT_NE(out.find("the run stopped at step"), std::string::npos) << out;
  auto rows = parse_lines(d + "/metrics.jsonl");  // what was written is whole lines
  EXPECT_GT(rows.size(), 10u);
  EXPECT_LT(rows.size(), 400u);
}

// ---- issue 13: a worker that fails once under --max-restarts 1

namespace {

// 12 steps over two processes, a checkpoint every 4; one thread per process,
// so that the interrupted and the uninterrupted runs compute alike.
std::string restart_train_flags(const std::string& run_dir) {
  return "train --threads 1 --train-limit 256 --batch-size 64 --max-steps 12 --warmup-steps 2 --checkpoint-every 4 "
         "--log-every 1 --resume auto --no-eval --no-verify --no-plot --run-dir " +
         run_dir;
}

std::vector<Json> metrics_rows(const std::string& run_dir) { return parse_lines(run_dir + "/metrics.jsonl"); }

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(Cli, MaxRestartsResumesAWorkerThatFailedOnceAndTheCurveEqualsAnUninterruptedRun) {
  const std::string base = temp_dir("restart");
  const std::string cli = CONTRAX_CLI_PATH;
  // The uninterrupted run.
  auto whole = run_shell(cli + " launch --nproc 2 --standalone -- " + cli + " " + restart_train_flags(base + "/whole") +
                         " 2>&1");
  ASSERT_EQ(whole.status, 0) << whole.out;
  const auto want = metrics_rows(base + "/whole");
  ASSERT_EQ(want.size(), 12u);

  // Rank 1 fails before step 10: after the checkpoint of step 8, with step 9
  // already logged, so that step 9 is computed (and logged) twice. Both ways
  // of restarting: torchrun's (contrax launch around the workers) and the
  // train command's own launcher.
  const std::string fault = "CONTRAX_FAULT_EXIT_AT_STEP=10:1 ";
  const std::map<std::string, std::string> ways = {
      {"launch", fault + cli + " launch --nproc 2 --standalone --max-restarts 1 -- " + cli + " " +
                     restart_train_flags(base + "/launch") + " 2>&1"},
      {"train", fault + cli + " " + restart_train_flags(base + "/train") + " --nproc 2 --max-restarts 1 2>&1"}};
  for (const auto& [way, cmd] : ways) {
    SCOPED_TRACE(way);
    const std::string d = base + "/" + way;
    auto r = run_shell(cmd);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("rank 1 failed before step 10 as asked by CONTRAX_FAULT_EXIT_AT_STEP=10:1"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("restarting all workers (restart 1 of 1)"), std::string::npos) << r.out;
    // The failed attempt logged step 9; the restart resumed from step 8 and
    // logged it again: train.log shows both, metrics.jsonl each step once.
    const std::string log = read_file(d + "/train.log");
    EXPECT_EQ(count_of(log, "step 9/12 "), 2u) << log;
    EXPECT_EQ(count_of(log, "step 8/12 "), 1u) << log;
    EXPECT_EQ(count_of(log, "step 12/12 "), 1u) << log;
    const auto got = metrics_rows(d);
    ASSERT_EQ(got.size(), want.size()) << read_file(d + "/metrics.jsonl");
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i]["step"], i + 1);
      // Bit-identical: the checkpoint holds the model, AdamW's state and the
      // CPU generator, and the data order and augmentations are functions of
      // (seed, epoch, step), so the resumed steps recompute the same numbers.
      EXPECT_EQ(got[i]["loss"].get<double>(), want[i]["loss"].get<double>()) << "step " << i + 1;
      EXPECT_EQ(got[i]["lr"].get<double>(), want[i]["lr"].get<double>()) << "step " << i + 1;
      EXPECT_EQ(got[i]["rows"], want[i]["rows"]) << "step " << i + 1;
    }
  }
}

TEST(Cli, FaultInjectionVariableIsCheckedAndSkippedAfterARestart) {
  const std::string d = temp_dir("fault") + "/run";
  auto bad = run_shell("CONTRAX_FAULT_EXIT_AT_STEP=2:x " + std::string(CONTRAX_CLI_PATH) + " " + kTinyTrain +
                       " --run-dir " + d + " 2>&1");
  EXPECT_EQ(bad.status, 1) << bad.out;
  EXPECT_NE(bad.out.find("environment variable 'CONTRAX_FAULT_EXIT_AT_STEP' must be <step>[:<rank>] with step >= 1 "
                         "and rank >= 0, but got '2:x'"),
            std::string::npos)
      << bad.out;
  // Rank 0 by default; not in a restarted attempt.
  auto once = run_shell("CONTRAX_FAULT_EXIT_AT_STEP=2 " + std::string(CONTRAX_CLI_PATH) + " " + kTinyTrain +
                        " --overwrite --run-dir " + d + " 2>&1");
  EXPECT_EQ(once.status, 1) << once.out;
  EXPECT_NE(once.out.find("rank 0 failed before step 2"), std::string::npos) << once.out;
  // A worker of a restarted attempt (as the launcher starts one: its
  // environment; `contrax train` itself runs even one process under its own
  // launcher, which numbers the attempts).
  auto restarted =
      run_shell("CONTRAX_FAULT_EXIT_AT_STEP=2 TORCHELASTIC_RESTART_COUNT=1 WORLD_SIZE=1 RANK=0 " +
                std::string(CONTRAX_CLI_PATH) + " " + kTinyTrain + " --overwrite --run-dir " + d + " 2>&1");
  EXPECT_EQ(restarted.status, 0) << restarted.out;
}

// `contrax train --device cuda`: the image recipes train on the GPU where one
// is (the run's config and summary say so); elsewhere it is refused before
// anything starts, saying why; the retrieval recipe refuses it everywhere.
TEST(Cli, TrainOnCudaRunsThereOrSaysWhyNot) {
  const std::string d = temp_dir("train_cuda") + "/run";
  auto retrieval = run_cli("train retrieval --device cuda --no-eval --no-verify --no-plot --run-dir " + d);
  EXPECT_EQ(retrieval.status, 2) << retrieval.out;
  EXPECT_NE(retrieval.out.find("contrax train: error: flag '--device' is 'cuda', but the retrieval recipe trains on "
                               "the CPU only (the image recipes, simclr and moco-v3, train on a GPU)"),
            std::string::npos)
      << retrieval.out;
  if (torch::cuda::is_available()) {
    auto r = run_cli(kTinyTrain + std::string(" --device cuda --run-dir ") + d);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(Json::parse(read_file(d + "/config.json"))["settings"]["device"], "cuda");
    const auto gpus = static_cast<int64_t>(torch::cuda::device_count());
    auto many = run_cli(kTinyTrain + std::string(" --device cuda --overwrite --run-dir ") + d + " --nproc " +
                        std::to_string(gpus + 1));
    EXPECT_EQ(many.status, 2) << many.out;
    EXPECT_NE(many.out.find("flag '--device' is 'cuda' (each process on its own GPU, NCCL between them), which "
                            "needs one GPU per rank, but --nproc is " + std::to_string(gpus + 1)),
              std::string::npos)
        << many.out;
    return;
  }
  auto r = run_cli(kTinyTrain + std::string(" --device cuda --run-dir ") + d);
  EXPECT_EQ(r.status, 2) << r.out;
  const std::string why =
      at::Context::hasCUDART() ? "no CUDA device is visible" : "this LibTorch was built without CUDA";
  EXPECT_NE(r.out.find("contrax train: error: flag '--device' is 'cuda', but " + why), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(d)) << "refused before the run directory was made";
}
