// `contrax train`: distributed SimCLR / MoCo v3 on Fashion-MNIST, then the
// evaluation table (trained encoder vs random-init encoder vs raw pixels) and
// `contrax verify`'s exactness line. The run directory's files are described
// in run_dir.h; the training loop is contrax::train::train_contrastive.
//
//   contrax train                                  # defaults: 2 processes, SimCLR, 16 epochs
//   contrax train --recipe moco-v3 --nproc 2 --epochs 3 --run-dir runs/moco
//   contrax train --run-dir runs/a --resume auto   # continue a stopped run, or start it
//   contrax train --max-steps 20 --train-limit 2048 --json
//   contrax train --lr 1e-3 --dump-config > run.toml && contrax train --config run.toml
#include <unistd.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>

#include "cli.h"
#include "contrax/communicator.h"
#include "contrax/launcher.h"
#include "contrax/train/image/augment.h"
#include "contrax/train/image/eval.h"
#include "contrax/train/image/idx.h"
#include "contrax/train/image/trainer.h"
#include "contrax/verify.h"
#include "json_util.h"
#include "run_dir.h"
#include "train_retrieval.h"

namespace {

namespace cli = contrax::cli;
namespace ct = contrax::train;
using cli::Json;

volatile std::sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

// Set by the `contrax train` process that prepared the run directory for the
// workers it launches: "fresh", "resume" or "auto" (decide by the checkpoint,
// for restarts after a failure).
constexpr const char* kStartEnv = "CONTRAX_TRAIN_START";

// Limits of the integer flags: far beyond any real run, far below overflow of
// the products the trainer forms (batch x steps examples, epochs x steps).
constexpr int64_t kMaxBatch = int64_t{1} << 20;
constexpr int64_t kMaxSteps = int64_t{1} << 40;

// Every setting of a run. The defaults of the training recipe come from
// contrax::train::TrainOptions (the one place they are written); the rest are
// the tool's own.
std::string join_ints(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i > 0 ? "," : "") + std::to_string(v[i]);
  return s;
}

struct TrainFlags {
  explicit TrainFlags(ct::TrainOptions d = {}) : defaults(std::move(d)) {}
  ct::TrainOptions defaults;
  // "default" or "peer" (ct::peer_recipe(): the recipe of the torch peer).
  std::string variant = "default";
  std::string channels = join_ints(defaults.model().encoder().channels());
  std::string strides = join_ints(defaults.model().encoder().strides());
  double crop_min = defaults.augment().scale_min();
  int64_t pool_grid = defaults.model().encoder().pool_grid();
  std::string recipe = defaults.recipe();
  int64_t nproc = 2;
  std::string data_dir = ct::kDefaultDataDir;
  int64_t epochs = defaults.run().epochs();
  int64_t max_steps = defaults.run().max_steps();
  int64_t batch = defaults.run().batch_size();
  int64_t chunk = defaults.chunk_size();
  double lr = defaults.run().lr();
  double wd = defaults.run().weight_decay();
  int64_t warmup = defaults.run().warmup_steps();
  double temperature = defaults.temperature();
  double moco_m = defaults.moco_momentum();
  int64_t seed = static_cast<int64_t>(defaults.run().seed());
  std::string run_dir;  // empty: runs/<recipe>
  int64_t ckpt_every = defaults.run().checkpoint_every();
  std::string resume = "never";
  bool overwrite = false;
  bool json = false;
  int64_t train_limit = -1;
  int64_t eval_limit = -1;
  int64_t probe_limit = 10000;
  int64_t threads = 0;
  std::string dtype = "float";
  int64_t log_every = defaults.run().log_every();
  int64_t stop_at = defaults.run().stop_at_step();
  int64_t skip_nonfinite = defaults.run().skip_nonfinite();
  bool no_eval = false, no_verify = false, no_plot = false, force = false;
  int64_t timeout_s = 300;
  int64_t max_restarts = 0;
  // --recipe retrieval only (train_retrieval.h).
  int64_t hard_negatives = contrax::train::RetrievalOptions().hard_negatives();
  int64_t passage_chunk = 0;
  std::string wordnet_dir = contrax::train::kDefaultWordNetDir;
  std::string query_features = "words+chargrams";
  int64_t buckets = contrax::train::RetrievalOptions().query_tower().buckets();
  int64_t embed_dim = contrax::train::RetrievalOptions().query_tower().embed_dim();
};

void add_flags(CLI::App& app, TrainFlags& f) {
  const int64_t cap = cli::max_procs();
  const std::string force_note = " (at most " + std::to_string(cap) + ", " + std::to_string(cli::kMaxProcsPerCore) +
                                 " per core, unless --force)";
  cli::add_choice(app, "--recipe", f.recipe, "training recipe", {"simclr", "moco-v3", "retrieval"});
  cli::add_choice(app, "--recipe-variant", f.variant,
                  "default, or peer: the smaller recipe of simclr_torch_ddp.py (flags given explicitly still apply)",
                  {"default", "peer"});
  app.add_option("--encoder-channels", f.channels, "output channels of the encoder's conv stages (comma-separated)");
  app.add_option("--encoder-strides", f.strides, "stride of each conv stage (comma-separated, one per stage)");
  cli::add_int(app, "--encoder-pool-grid", f.pool_grid,
               "1: global average pooling; g: average over a g x g grid of cells, flattened", 1, 16);
  cli::add_double(app, "--crop-scale-min", f.crop_min, "smallest crop area of the augmentation (fraction of the image)",
                  0, 1, true);
  cli::add_int(app, "--nproc", f.nproc, "local processes (ignored under a launcher)" + force_note, 1);
  app.add_option("--data", f.data_dir, "directory of the MNIST-format IDX files");
  cli::add_int(app, "--epochs", f.epochs, "epochs over the training subset (unless --max-steps)", 1, int64_t{1} << 20);
  cli::add_int(app, "--max-steps", f.max_steps, "> 0: train exactly this many steps (the schedule's length); -1: none",
               -1, kMaxSteps);
  cli::add_int(app, "--batch-size", f.batch, "global batch size (all processes together)", 1, kMaxBatch);
  cli::add_int(app, "--chunk-size", f.chunk, "> 0: gradient cache with chunks of this many rows", 0, kMaxBatch);
  cli::add_double(app, "--lr", f.lr, "peak learning rate of AdamW", 0, std::numeric_limits<double>::max(), true);
  cli::add_double(app, "--weight-decay", f.wd, "AdamW weight decay", 0);
  cli::add_int(app, "--warmup-steps", f.warmup, "linear warm-up steps before the cosine decay", 0, kMaxSteps);
  cli::add_double(app, "--temperature", f.temperature, "temperature of NT-Xent / MoCo v3", 0,
                  std::numeric_limits<double>::max(), true);
  cli::add_double(app, "--moco-momentum", f.moco_m, "MoCo v3 base momentum (cosine to 1)", 0, 1);
  cli::add_int(app, "--seed", f.seed, "seed of the model, the data order and the augmentations", 0);
  app.add_option("--run-dir", f.run_dir, "directory of the run's files (default: runs/RECIPE)");
  cli::add_int(app, "--checkpoint-every", f.ckpt_every, "checkpoint every K steps (0: only at the end)", 0, kMaxSteps);
  cli::add_choice(app, "--resume", f.resume,
                  "continue the run in --run-dir: --resume (a checkpoint must exist) or --resume auto (continue if "
                  "there is a checkpoint, else start)",
                  {"never", "always", "auto"});
  app.add_flag("--overwrite", f.overwrite, "replace an existing run in --run-dir");
  app.add_flag("--json", f.json, "print the summary as one JSON object (progress goes to stderr)");
  cli::add_int(app, "--train-limit", f.train_limit, "train on the first N training examples (-1: all)", -1);
  cli::add_int(app, "--eval-limit", f.eval_limit,
               "evaluate with the first N train (kNN memory bank) and N test examples (-1: all)", -1);
  cli::add_int(app, "--probe-limit", f.probe_limit,
               "fit the linear probe on the first N of those train examples (-1: all)", -1);
  cli::add_int(app, "--threads", f.threads, "intra-op threads per process (0: cores / processes)" + force_note, 0);
  cli::add_choice(app, "--dtype", f.dtype, "float or double (exactness tests)", {"float", "double"});
  cli::add_int(app, "--log-every", f.log_every, "progress line every N steps (0: none)", 0, kMaxSteps);
  cli::add_int(app, "--stop-at-step", f.stop_at, ">= 0: stop with a checkpoint at this step (tests)", -1, kMaxSteps);
  cli::add_int(app, "--skip-nonfinite", f.skip_nonfinite,
               "skip up to N steps whose loss or gradient is not finite (0: the first one stops the run)", 0,
               kMaxSteps);
  app.add_flag("--no-eval", f.no_eval, "skip the evaluation");
  app.add_flag("--no-verify", f.no_verify, "skip the exactness check after training");
  app.add_flag("--no-plot", f.no_plot, "do not draw RUN_DIR/curves.png at the end");
  cli::add_int(app, "--timeout", f.timeout_s, "seconds any collective may wait for a peer", 1, 24 * 3600);
  cli::add_int(app, "--max-restarts", f.max_restarts,
               "restart all processes up to N times after a failure, resuming from the last checkpoint", 0, 1000);
  cli::add_int(app, "--hard-negatives", f.hard_negatives, "retrieval: hard-negative passages per query", 0, 64);
  cli::add_int(app, "--passage-chunk-size", f.passage_chunk,
               "retrieval: gradient-cache chunk of passages (0: --chunk-size x (1 + hard negatives))", 0, kMaxBatch);
  cli::add_choice(app, "--query-features", f.query_features,
                  "retrieval: gloss features: word uni/bigrams, or those plus character 3-5-grams",
                  {"words", "words+chargrams"});
  cli::add_int(app, "--buckets", f.buckets, "retrieval: hash buckets of each tower's feature embedding", 2,
               int64_t{1} << 26);
  cli::add_int(app, "--embed-dim", f.embed_dim, "retrieval: width of the feature embeddings", 1, 1 << 16);
  app.add_option("--wordnet", f.wordnet_dir, "retrieval: directory of the WordNet data files (Debian wordnet-base)");
  app.add_flag("--force", f.force, "allow --nproc and --threads above " + std::to_string(cap));
}

// The checks that span flags; each single flag's range is checked while parsing.
void check_flags(const TrainFlags& f) {
  const int64_t cap = cli::max_procs();
  cli::usage_check(f.force || f.nproc <= cap, "flag '--nproc' must be <= ", cap, " (", cli::kMaxProcsPerCore,
                   " per core; --force allows more), but got ", f.nproc);
  cli::usage_check(f.force || f.threads <= cap, "flag '--threads' must be <= ", cap, " (", cli::kMaxProcsPerCore,
                   " per core; --force allows more), but got ", f.threads);
  cli::usage_check(f.max_steps != 0, "flag '--max-steps' must be -1 (none) or >= 1, but got 0");
  cli::usage_check(f.train_limit != 0, "flag '--train-limit' must be -1 (all) or >= 1, but got 0");
  cli::usage_check(f.eval_limit != 0, "flag '--eval-limit' must be -1 (all) or >= 1, but got 0");
  cli::usage_check(f.probe_limit != 0, "flag '--probe-limit' must be -1 (all) or >= 1, but got 0");
  cli::usage_check(!f.overwrite || f.resume == "never",
                   "flags '--overwrite' and '--resume' exclude each other (--overwrite starts the run again)");
}

// A bare `--resume` means "always"; CLI11 would otherwise take the next flag
// as its value.
std::vector<std::string> expand_bare_resume(std::vector<std::string> args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--") break;
    if (args[i] == "--resume" && (i + 1 == args.size() || args[i + 1].rfind("-", 0) == 0)) args[i] = "--resume=always";
  }
  return args;
}

Json settings_json(const TrainFlags& f, const std::string& run_dir) {
  Json s;
  s["recipe"] = f.recipe;
  s["nproc"] = f.nproc;
  s["data"] = f.data_dir;
  s["epochs"] = f.epochs;
  s["max_steps"] = f.max_steps;
  s["batch_size"] = f.batch;
  s["chunk_size"] = f.chunk;
  s["lr"] = f.lr;
  s["weight_decay"] = f.wd;
  s["warmup_steps"] = f.warmup;
  s["temperature"] = f.temperature;
  s["recipe_variant"] = f.variant;
  s["encoder_channels"] = f.channels;
  s["encoder_strides"] = f.strides;
  s["crop_scale_min"] = f.crop_min;
  s["encoder_pool_grid"] = f.pool_grid;
  s["moco_momentum"] = f.moco_m;
  s["seed"] = f.seed;
  s["run_dir"] = run_dir;
  s["checkpoint_every"] = f.ckpt_every;
  s["resume"] = f.resume;
  s["train_limit"] = f.train_limit;
  s["eval_limit"] = f.eval_limit;
  s["probe_limit"] = f.probe_limit;
  s["threads"] = f.threads;
  s["dtype"] = f.dtype;
  s["log_every"] = f.log_every;
  s["stop_at_step"] = f.stop_at;
  s["skip_nonfinite"] = f.skip_nonfinite;
  s["eval"] = !f.no_eval;
  s["verify"] = !f.no_verify;
  s["timeout_s"] = f.timeout_s;
  s["max_restarts"] = f.max_restarts;
  return s;
}

// Rank 0's console, copied to RUN_DIR/train.log. A failed write to the log
// stops the run with the cause (a full disk must not go unnoticed).
class Console {
 public:
  Console(bool to_stderr) : to_stderr_(to_stderr) {}
  void open_log(const std::string& path, bool append) {
    path_ = path;
    file_ = std::fopen(path.c_str(), append ? "a" : "w");
    TORCH_CHECK(file_ != nullptr, "cannot write ", path, ": ", std::strerror(errno));
  }
  ~Console() {
    if (file_ != nullptr) std::fclose(file_);
  }
  /// Progress and headers: stdout, or stderr under --json.
  void out(const std::string& s) { emit(to_stderr_ ? std::cerr : std::cout, s); }
  /// The final summary and the table: always stdout.
  void result(const std::string& s) { emit(std::cout, s); }
  void err(const std::string& s) { emit(std::cerr, s); }
  /// Only to the log (main() prints errors to the console itself).
  void log_only(const std::string& s) {
    if (file_ != nullptr) {
      std::fputs(s.c_str(), file_);
      std::fflush(file_);
    }
  }

 private:
  void emit(std::ostream& os, const std::string& s) {
    os << s << std::flush;
    if (file_ == nullptr) return;
    errno = 0;
    const bool ok = std::fwrite(s.data(), 1, s.size(), file_) == s.size() && std::fflush(file_) == 0;
    TORCH_CHECK(ok, "cannot write ", path_, ": ", errno != 0 ? std::strerror(errno) : "write failed");
  }
  bool to_stderr_;
  std::string path_;
  std::FILE* file_ = nullptr;
};

Json eval_json(const ct::EvalResult& e) {
  Json j;
  cli::put_number(j, "linear_probe_acc", e.linear_probe_acc);
  cli::put_number(j, "knn_acc", e.knn_acc);
  cli::put_number(j, "linear_probe_l2", e.probe.l2);
  j["probe_converged"] = e.probe.converged;
  cli::put_number(j, "seconds", e.seconds);
  return j;
}

std::string versions() {
  return c10::str("contrax ", CONTRAX_VERSION, ", LibTorch ", TORCH_VERSION);
}

// Runs the workers of a multi-process run on this node.
int launch_workers(const TrainFlags& f, const std::vector<std::string>& args, const std::string& start) {
  std::vector<std::string> argv{contrax::self_executable(), "train"};
  argv.insert(argv.end(), args.begin(), args.end());
  contrax::LaunchOptions lo;
  lo.nproc = f.nproc;
  lo.prefix_output = false;
  lo.grace = std::chrono::seconds(60);  // time to finish a step and write the checkpoint
  lo.max_restarts = f.max_restarts;
  // Workers inherit the environment: they take the decision made here (and,
  // after a restart, resume from whatever checkpoint the failed attempt left).
  ::setenv(kStartEnv, f.max_restarts > 0 && start == "fresh" ? "auto" : start.c_str(), 1);
  auto r = contrax::launch(argv, lo);
  if (r.exit_code != 0) std::cerr << "contrax train: " << r.message << "\n";
  return r.exit_code;
}

int run_train(const std::vector<std::string>& raw_args) {
  const std::vector<std::string> args = expand_bare_resume(raw_args);
  CLI::App app{"train SimCLR or MoCo v3 on Fashion-MNIST over N processes, then evaluate", "train"};
  cli::setup_app(app);
  // The variant picks the defaults the flags start from (so that --help and
  // --dump-config show them); one set in a config file is applied after parsing.
  std::string variant = "default", recipe;
  for (size_t i = 0; i < args.size() && args[i] != "--"; ++i) {
    if (args[i] == "--recipe-variant" && i + 1 < args.size()) variant = args[i + 1];
    if (args[i].rfind("--recipe-variant=", 0) == 0) variant = args[i].substr(17);
    if (args[i] == "--recipe" && i + 1 < args.size()) recipe = args[i + 1];
    if (args[i].rfind("--recipe=", 0) == 0) recipe = args[i].substr(9);
  }
  TrainFlags f(variant == "peer" ? ct::peer_recipe() : ct::TrainOptions());
  if (recipe == "retrieval") {
    // The retrieval recipe's own defaults for the flags it shares with the
    // image recipes, so that --help and --dump-config show what will run. (A
    // recipe set in a config file gets them after parsing, below.)
    const ct::RetrievalOptions r;
    f.epochs = r.run().epochs();
    f.batch = r.run().batch_size();
    f.lr = r.run().lr();
    f.wd = r.run().weight_decay();
    f.warmup = r.run().warmup_steps();
    f.temperature = r.temperature();
    f.ckpt_every = r.run().checkpoint_every();
    f.log_every = r.run().log_every();
  }
  add_flags(app, f);
  if (int st = cli::parse(app, args); st >= 0) return st;
  if (f.variant == "peer") {
    // The peer's values, except where a flag (or the config file) sets one.
    const TrainFlags p(ct::peer_recipe());
    auto take = [&app](const char* name, auto& field, const auto& value) {
      if (app.get_option(name)->count() == 0) field = value;
    };
    take("--epochs", f.epochs, p.epochs);
    take("--batch-size", f.batch, p.batch);
    take("--lr", f.lr, p.lr);
    take("--weight-decay", f.wd, p.wd);
    take("--warmup-steps", f.warmup, p.warmup);
    take("--temperature", f.temperature, p.temperature);
    take("--encoder-channels", f.channels, p.channels);
    take("--encoder-strides", f.strides, p.strides);
    take("--crop-scale-min", f.crop_min, p.crop_min);
    take("--encoder-pool-grid", f.pool_grid, p.pool_grid);
  }
  check_flags(f);
  cli::RetrievalRun retrieval;
  if (f.recipe == "retrieval") {
    // Flags given keep their value; the others take the retrieval defaults.
    auto& o = retrieval.options;
    auto given = [&app](const char* flag) { return app.count(flag) > 0; };
    if (given("--epochs")) o.run().epochs(f.epochs);
    if (given("--batch-size")) o.run().batch_size(f.batch);
    if (given("--lr")) o.run().lr(f.lr);
    if (given("--weight-decay")) o.run().weight_decay(f.wd);
    if (given("--warmup-steps")) o.run().warmup_steps(f.warmup);
    if (given("--temperature")) o.temperature(f.temperature);
    if (given("--checkpoint-every")) o.run().checkpoint_every(f.ckpt_every);
    if (given("--log-every")) o.run().log_every(f.log_every);
    o.run().max_steps(f.max_steps).stop_at_step(f.stop_at).seed(static_cast<uint64_t>(f.seed))
        .dtype(f.dtype == "double" ? torch::kDouble : torch::kFloat).skip_nonfinite(f.skip_nonfinite)
        .stop_requested([] { return g_signal != 0; });
    o.query_chunk_size(f.chunk).passage_chunk_size(f.passage_chunk).hard_negatives(f.hard_negatives);
    o.query_tower(ct::BagTowerOptions(o.query_tower()).buckets(f.buckets).embed_dim(f.embed_dim))
        .passage_tower(ct::BagTowerOptions(o.passage_tower()).buckets(f.buckets).embed_dim(f.embed_dim));
    retrieval.wordnet_dir = f.wordnet_dir;
    retrieval.query_chargrams = f.query_features == "words+chargrams";
    retrieval.train_limit = f.train_limit;
    retrieval.eval_limit = f.eval_limit;
    retrieval.json = f.json;
    retrieval.no_eval = f.no_eval;
    retrieval.no_verify = f.no_verify;
    retrieval.no_plot = f.no_plot;
  }
  const std::string run_dir = f.run_dir.empty() ? "runs/" + f.recipe : f.run_dir;
  retrieval.run_dir = run_dir;
  const auto mode = cli::parse_resume_mode(f.resume);

  // The process the user started decides fresh or resume and holds the
  // directory's lock for the whole run (its workers included). A worker of
  // an outside launcher (contrax launch, srun) has no such parent: there
  // rank 0 takes the lock and prepares, the other ranks only decide.
  std::unique_ptr<cli::RunDirLock> lock;
  bool resume = false;
  const char* start_env = std::getenv(kStartEnv);
  const bool top = !contrax::in_launched_worker();
  // The worker's rank as its launcher set it: torchrun-style RANK, or an srun
  // task's SLURM_PROCID (what Communicator::from_env reads when RANK is unset).
  const char* env_rank = std::getenv("RANK") != nullptr ? std::getenv("RANK") : std::getenv("SLURM_PROCID");
  const bool outside_rank0 = !top && start_env == nullptr && env_rank != nullptr && std::string(env_rank) == "0";
  if (top || outside_rank0) {
    if (mode == cli::ResumeMode::kAlways) {
      // Checked before the directory is created: a mistyped --run-dir with
      // --resume must not leave a new empty directory behind.
      cli::usage_check(std::filesystem::exists(ct::checkpoint_path(run_dir)), "flag '--resume': no checkpoint ",
                       ct::checkpoint_path(run_dir), " to resume from (--resume auto starts fresh when there is none)");
    }
    std::error_code ec;
    std::filesystem::create_directories(run_dir, ec);
    TORCH_CHECK(!ec, "cannot create run directory '", run_dir, "': ", ec.message());
    lock = std::make_unique<cli::RunDirLock>(run_dir);
    resume = cli::prepare_run_dir(run_dir, mode, f.overwrite);
    if (top && f.nproc > 1) return launch_workers(f, args, resume ? "resume" : "fresh");
    if (top && f.max_restarts > 0) {
      // One process: the restart policy still needs a launcher around it.
      return launch_workers(f, args, resume ? "resume" : "fresh");
    }
  } else if (start_env != nullptr) {
    const std::string s = start_env;
    resume = s == "resume" || (s == "auto" && cli::resolve_resume(run_dir, cli::ResumeMode::kAuto));
  } else {
    resume = cli::resolve_resume(run_dir, mode);
  }

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  const auto wall0 = std::chrono::steady_clock::now();
  auto comm = contrax::Communicator::from_env(
      contrax::CommunicatorOptions().timeout(std::chrono::seconds(f.timeout_s)));
  const int64_t world = comm->world_size(), rank = comm->rank();
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  at::set_num_threads(static_cast<int>(f.threads > 0 ? f.threads : std::max<int64_t>(1, cores / world)));

  Console console(f.json);
  if (rank == 0) {
    console.open_log(run_dir + "/train.log", resume);
    Json config;
    config["settings"] = f.recipe == "retrieval" ? cli::retrieval_settings_json(retrieval) : settings_json(f, run_dir);
    config["command"] = raw_args;
    config["resumed"] = resume;
    config["world_size"] = world;
    config["threads_per_process"] = at::get_num_threads();
    config["versions"] = {{"contrax", CONTRAX_VERSION}, {"libtorch", TORCH_VERSION}, {"blas", cli::blas_library()}};
    cli::write_run_file(run_dir, "config.json", config.dump(2) + "\n");
  }

  if (f.recipe == "retrieval") {
    retrieval.options.run().resume(resume);
    cli::RetrievalIo io;
    io.out = [&console](const std::string& s) { console.out(s); };
    io.result = [&console](const std::string& s) { console.result(s); };
    io.err = [&console](const std::string& s) { console.err(s); };
    io.log_only = [&console](const std::string& s) { console.log_only(s); };
    io.interrupted_status = [] {
      return g_signal != 0 && !contrax::in_launched_worker() ? 128 + static_cast<int>(g_signal) : 0;
    };
    return cli::run_retrieval(retrieval, comm, io, wall0);
  }

  // Every file the run will read, before it trains: a missing or unreadable
  // test split must not surface only after the training.
  ct::check_dataset_files(f.data_dir, f.no_eval ? std::vector<std::string>{"train"}
                                                : std::vector<std::string>{"train", "test"});
  auto train_data = ct::load_dataset(f.data_dir, "train", f.train_limit);
  // epochs x steps per epoch, before anything trains (the trainer checks it
  // too, but cannot name the flags).
  const int64_t per_epoch = train_data.size() / f.batch + (train_data.size() % f.batch != 0);
  cli::usage_check(f.max_steps > 0 || f.epochs <= kMaxSteps / std::max<int64_t>(1, per_epoch), "flag '--epochs' x ",
                   per_epoch, " steps per epoch must be <= 2^40 steps, but got --epochs ", f.epochs);
  const ct::TrainOptions base = f.variant == "peer" ? ct::peer_recipe() : ct::TrainOptions();
  auto model_options = base.model();
  model_options.encoder().channels(cli::parse_int_list("--encoder-channels", f.channels, 1, 1 << 16));
  model_options.encoder().strides(cli::parse_int_list("--encoder-strides", f.strides, 1, 64));
  model_options.encoder().pool_grid(f.pool_grid);
  cli::usage_check(model_options.encoder().strides().size() == model_options.encoder().channels().size(),
                   "flags '--encoder-channels' and '--encoder-strides' must have as many entries, but got ",
                   f.channels, " and ", f.strides);
  auto opts = ct::TrainOptions()
                  .recipe(f.recipe)
                  .run(ct::RunOptions()
                           .epochs(f.epochs)
                           .max_steps(f.max_steps)
                           .stop_at_step(f.stop_at)
                           .batch_size(f.batch)
                           .lr(f.lr)
                           .weight_decay(f.wd)
                           .warmup_steps(f.warmup)
                           .seed(static_cast<uint64_t>(f.seed))
                           .dtype(f.dtype == "double" ? torch::kDouble : torch::kFloat)
                           .run_dir(run_dir)
                           .checkpoint_every(f.ckpt_every)
                           .resume(resume)
                           .log_every(f.log_every)
                           .skip_nonfinite(f.skip_nonfinite)
                           .log([&console](const std::string& line) { console.out(line); })
                           .stop_requested([] { return g_signal != 0; }))
                  .chunk_size(f.chunk)
                  .temperature(f.temperature)
                  .moco_momentum(f.moco_m)
                  .model(model_options)
                  .augment(ct::AugmentOptions(base.augment()).scale_min(f.crop_min));
  if (rank == 0) {
    std::ostringstream os;
    os << "contrax train: " << f.recipe << " on " << train_data.size() << " examples of " << f.data_dir << ", "
       << world << " process" << (world > 1 ? "es" : "") << " x " << at::get_num_threads() << " thread"
       << (at::get_num_threads() > 1 ? "s" : "") << ", global batch " << f.batch
       << (f.chunk > 0 ? ", gradient cache chunks of " + std::to_string(f.chunk) : std::string()) << ", run dir "
       << run_dir << (resume ? " (resuming)" : "") << "\n";
    console.out(os.str());
  }
  ct::TrainResult r;
  try {
    r = ct::train_contrastive(comm, train_data, opts);
  } catch (const c10::Error& e) {
    // train.log keeps why the run ended (a divergence names its step).
    console.log_only(c10::str("contrax train: error: ", e.what_without_backtrace(), "\n"));
    throw;
  }
  const int64_t steps_run = r.steps - r.start_step;

  if (r.interrupted) {
    if (rank == 0) {
      console.err(c10::str("contrax train: stopped at step ", r.steps, "/", r.total_steps, "; checkpoint ",
                           ct::checkpoint_path(run_dir), " written; continue with --resume\n"));
    }
    if (g_signal != 0) return contrax::in_launched_worker() ? 0 : 128 + static_cast<int>(g_signal);
    return 0;
  }

  Json verify_j;
  if (!f.no_verify) {
    auto results = contrax::verify(comm);
    double worst = 0;
    bool ok = true;
    for (const auto& v : results) {
      worst = std::max(worst, v.max_rel_err);
      ok = ok && v.passed;
    }
    verify_j["ok"] = ok;
    cli::put_number(verify_j, "max_rel_err", worst);
    verify_j["cases"] = results.size();
    verify_j["world_size"] = world;
  }

  // Evaluation on rank 0, after the last collective: the other ranks are done
  // and exit, so a slow evaluation can never time out a peer that waits for it
  // (a barrier here failed after its 300 s timeout when a loaded machine slowed
  // the evaluation down). It keeps the training's thread count rather than
  // taking the idle ranks' cores: on a shared 2-core machine two OpenMP threads
  // made the many small L-BFGS steps of the probe many times slower (threads
  // spinning against other processes).
  if (rank != 0) return 0;
  ct::EvalResult trained, random_init, raw;
  int64_t n_test = 0, n_bank = 0, n_probe = 0;
  const auto eopts = ct::EvalOptions().probe_train_limit(f.probe_limit);
  if (!f.no_eval) {
    auto eval_train = ct::load_dataset(f.data_dir, "train", f.eval_limit);
    auto eval_test = ct::load_dataset(f.data_dir, "test", f.eval_limit);
    auto enc = r.encoder;
    enc->to(torch::kFloat);
    // One protocol for all three representations, so that they compare.
    trained = ct::evaluate_encoder(enc, eval_train, eval_test, eopts);
    random_init = ct::evaluate_random_init(enc->options, static_cast<uint64_t>(f.seed) + 1000003, eval_train,
                                           eval_test, eopts);
    raw = ct::evaluate_raw_pixels(eval_train, eval_test, eopts);
    n_test = eval_test.size();
    n_bank = eval_train.size();
    n_probe = f.probe_limit > 0 ? std::min(f.probe_limit, eval_train.size()) : eval_train.size();
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();

  Json s;
  s["recipe"] = f.recipe;
  s["world_size"] = world;
  s["steps"] = r.steps;
  s["start_step"] = r.start_step;
  s["steps_run"] = steps_run;
  s["total_steps"] = r.total_steps;
  s["epochs"] = r.epochs_done;
  s["batch_size"] = f.batch;
  s["chunk_size"] = f.chunk;
  s["skipped_steps"] = r.skipped_steps;
  cli::put_number(s, "final_loss", r.losses.empty() ? std::nan("") : r.losses.back());
  if (!f.no_eval) {
    // The flat keys of earlier versions, and the table as one object per row.
    cli::put_number(s, "linear_probe_acc", trained.linear_probe_acc);
    cli::put_number(s, "knn_acc", trained.knn_acc);
    cli::put_number(s, "random_init_linear_probe_acc", random_init.linear_probe_acc);
    cli::put_number(s, "random_init_knn_acc", random_init.knn_acc);
    cli::put_number(s, "raw_pixel_linear_probe_acc", raw.linear_probe_acc);
    cli::put_number(s, "raw_pixel_knn_acc", raw.knn_acc);
    cli::put_number(s, "linear_probe_l2", trained.probe.l2);
    cli::put_number(s, "random_init_linear_probe_l2", random_init.probe.l2);
    cli::put_number(s, "raw_pixel_linear_probe_l2", raw.probe.l2);
    cli::put_number(s, "eval_s", trained.seconds + random_init.seconds + raw.seconds);
    s["evaluation"] = {{"test_images", n_test},
                       {"knn_bank_images", n_bank},
                       {"probe_train_images", n_probe},
                       {"knn_k", eopts.knn().k()},
                       {"trained_encoder", eval_json(trained)},
                       {"random_init_encoder", eval_json(random_init)},
                       {"raw_pixels", eval_json(raw)}};
  }
  cli::put_number(s, "examples_per_s", r.examples_per_s);
  cli::put_number(s, "train_s", r.train_s);
  cli::put_number(s, "wall_s", wall);
  s["bytes_sent_rank0"] = r.bytes_sent;
  if (!f.no_verify) s["verify"] = verify_j;
  s["run_dir"] = run_dir;
  cli::write_run_file(run_dir, "results.json", s.dump(2) + "\n");

  std::ostringstream out;
  if (f.json) {
    out << s.dump() << "\n";
  } else {
    if (!f.no_eval) {
      out << "\nevaluation of frozen features on " << n_test << " test images (backbone output, not the projection "
          << "head):\n"
          << "  linear probe: logistic regression (L-BFGS to convergence) on standardised features of " << n_probe
          << " train images, L2 chosen on " << eopts.probe().val_fraction() * 100 << "% of them\n"
          << "  kNN: cosine similarity to " << n_bank << " train images, " << eopts.knn().k()
          << " neighbours voting with weight exp(sim / " << eopts.knn().temperature() << ")\n";
      out << std::left << std::setw(22) << "representation" << std::setw(20) << "linear probe acc" << std::setw(16)
          << "kNN acc (k=" + std::to_string(eopts.knn().k()) + ")" << "probe L2\n";
      auto row = [&out](const std::string& name, const ct::EvalResult& e) {
        out << std::left << std::setw(22) << name << std::setw(20) << std::fixed << std::setprecision(4)
            << e.linear_probe_acc << std::setw(16) << e.knn_acc << std::scientific << std::setprecision(0)
            << e.probe.l2 << (e.probe.converged ? "" : " (probe not converged)") << std::fixed << "\n";
      };
      row("trained encoder", trained);
      row("random-init encoder", random_init);
      row("raw pixels", raw);
    }
    out << "trained " << steps_run << " step" << (steps_run == 1 ? "" : "s");
    if (r.start_step > 0) out << " (steps " << r.start_step + 1 << "-" << r.steps << " of " << r.total_steps << ")";
    out << " to epoch " << r.epochs_done << " in " << std::fixed << std::setprecision(1) << r.train_s << " s, "
        << std::setprecision(0) << r.examples_per_s << " examples/s; " << std::setprecision(1);
    if (r.skipped_steps > 0) out << r.skipped_steps << " non-finite steps skipped; ";
    if (!f.no_eval) out << "evaluated in " << trained.seconds + random_init.seconds + raw.seconds << " s; ";
    out << "wall " << wall << " s\n";
    if (!f.no_verify) {
      out << (verify_j["ok"].get<bool>() ? "distributed gradients equal single-device"
                                         : "MISMATCH: distributed gradients differ from single-device")
          << ": max rel err " << std::setprecision(3) << std::scientific
          << (verify_j["max_rel_err"].is_null() ? std::nan("") : verify_j["max_rel_err"].get<double>()) << " over "
          << verify_j["cases"].get<int64_t>() << " cases (W=" << world << ")\n";
    }
  }
  console.result(out.str());
  if (!f.no_plot && steps_run + r.start_step > 0) {
    // A missing matplotlib costs the picture, not the run: the script says why.
    if (cli::plot_run(run_dir, /*quiet=*/true) != 0) {
      console.err("contrax train: curves.png not drawn (see above); the run itself is complete\n");
    }
  }
  return verify_j.is_null() || verify_j["ok"].get<bool>() ? 0 : 1;
}

contrax::cli::Command train_cmd("train", "train SimCLR or MoCo v3 on Fashion-MNIST over N processes, then evaluate",
                                run_train);

}  // namespace
