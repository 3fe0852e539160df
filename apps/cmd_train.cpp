// `contrax train [RECIPE]`: a recipe trained over N processes, then its
// evaluation and `contrax verify`'s exactness line. The recipes are in
// train_image.cpp (simclr, moco-v3: Fashion-MNIST) and train_retrieval.cpp
// (retrieval: WordNet); this file holds what they share: the flags of the run
// and of the tool, the run directory (contrax/train/common/run_dir.h), the
// workers, config.json, results.json and the summary (the console and
// train.log: train_console.h).
//
//   contrax train                                  # simclr: 2 processes, 10 epochs
//   contrax train moco-v3 --epochs 3 --run-dir runs/moco   # or: contrax train --recipe moco-v3 ...
//   contrax train retrieval --help                 # the retrieval recipe's flags and defaults
//   contrax train --run-dir runs/a --resume auto   # continue a stopped run, or start it
//   contrax train --max-steps 20 --train-limit 2048 --json
//   contrax train --lr 1e-3 --dump-config > run.toml && contrax train --config run.toml
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>
#include <thread>

#include "cli.h"
#include "contrax/check/verify.h"
#include "contrax/launch/launcher.h"
#include "contrax/train/common/run_dir.h"
#include "json_util.h"
#include "live_line.h"
#include "plot.h"
#include "stop_signal.h"
#include "train_console.h"
#include "train_errors.h"
#include "train_recipe.h"
#include "train_threads.h"

namespace {

namespace cli = contrax::cli;
namespace ct = contrax::train;
using cli::Json;

// Set by the `contrax train` process that claimed the run directory for the
// workers it launches: "fresh", "resume" or "auto" (decide by the checkpoint,
// for restarts after a failure).
constexpr const char* kStartEnv = "CONTRAX_TRAIN_START";

// The smallest temperature a dtype carries. Logits are cosines over T, so
// they reach 1/T, and the backward's products and sums of squares (the
// gradient's norm, AdamW's second moment) grow as (1/T)^4: that must stay
// below the dtype's largest number, with a margin of 10 on 1/T, rounded up to
// a power of ten. float: 1e-08 (fp32 gradients were measured to overflow at
// 1e-9 and not at 1e-8, max^(1/4) = 1.4e9); double: 1e-76.
double min_temperature(const std::string& dtype) {
  const double max = dtype == "double" ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  return std::pow(10.0, std::ceil(std::log10(10 / std::pow(max, 0.25))));
}

// Every setting of a run; the defaults of the run's flags are the recipe's
// options (the one place they are written), the others the tool's own.
class TrainCommand {
 public:
  explicit TrainCommand(const std::vector<std::string>& args) : command_(args) {}
  /// -1 to go on, else the status to exit with (--help, a usage error).
  int parse();
  /// -1 when this process trains, else the exit status of its workers.
  int start();
  int train();
  /// The tool's message for a typed error of the trainer library.
  std::string message(const ct::TrainError& e) const { return cli::train_error_message(e, recipe_->data_hint()); }

 private:
  void add_flags(CLI::App& app, cli::TrainRecipe& recipe);
  CLI::App& resolve(const CLI::App& given, const std::string& word, bool help);
  void check_flags();
  int launch_workers(const std::string& start) const;
  int64_t threads_per_process(int64_t world) const;
  void check_tasks(bool top) const;
  Json settings() const;
  Json verify() const;
  int report(const ct::RunResult& r, std::chrono::steady_clock::time_point wall0);
  std::string divergence_cause() const;

  const std::vector<std::string> command_;  // as given
  CLI::App app_{"train a recipe (SimCLR, MoCo v3, two-tower retrieval) over N processes, then evaluate", "train"};
  std::unique_ptr<cli::TrainRecipe> recipe_;
  std::string name_, name_flag_;  // the recipe's name; the --recipe flag's value
  cli::TrainToolFlags tool_;
  int64_t nproc_ = 2, threads_ = 0, seed_ = 0, timeout_s_ = 300, max_restarts_ = 0;
  std::string run_dir_, resume_ = "never", dtype_ = "float", device_ = "cpu";
  bool overwrite_ = false, json_ = false, no_verify_ = false, no_plot_ = false, force_ = false;
  bool resumed_ = false, trust_legacy_ = false;
  double default_lr_ = 0, default_temperature_ = 0;  // the recipe's, for divergence_cause()
  ct::RunDir::Claim claim_;  // the run directory's lock, held until the run ends
  contrax::CommunicatorPtr comm_;
  std::unique_ptr<cli::TrainConsole> console_;
  std::unique_ptr<cli::IntraOpThreads> threads_guard_;  // this rank's intra-op threads, started
};

// The flags of a run of `recipe` (the shared ones, then the recipe's own),
// their defaults the recipe's.
void TrainCommand::add_flags(CLI::App& app, cli::TrainRecipe& recipe) {
  const int64_t cap = cli::max_procs();
  const std::string force_note = " (at most " + std::to_string(cap) + ", " + std::to_string(cli::kMaxProcsPerCore) +
                                 " per core, unless --force)";
  cli::add_choice(app, "--recipe", name_flag_, "the recipe (or as the word after train: contrax train RECIPE)",
                  cli::train_recipe_names())
      ->check(CLI::Validator(
          [this](std::string& v) -> std::string {
            // Checked while parsing, so that --dump-config never writes a
            // recipe other than the one whose flags it lists.
            cli::usage_check(v == name_, "flag '--recipe' says ", v, " but the recipe is ", name_, " (contrax train ",
                             name_, ")");
            return std::string();
          },
          ""));
  cli::add_int(app, "--nproc", nproc_, "local processes (ignored under a launcher)" + force_note, 1);
  ct::RunOptions& run = recipe.run();
  cli::add_int(app, "--epochs", run.epochs(), "epochs over the training subset (unless --max-steps)", 1,
               int64_t{1} << 20);
  cli::add_int(app, "--max-steps", run.max_steps(),
               "> 0: train exactly this many steps (the schedule's length); -1: none", -1, cli::kMaxSteps);
  cli::add_int(app, "--batch-size", run.batch_size(), "global batch size (all processes together)", 1,
               cli::kMaxBatch);
  cli::add_double(app, "--lr", run.lr(), "peak learning rate of AdamW", 0, std::numeric_limits<double>::max(), true);
  cli::add_double(app, "--weight-decay", run.weight_decay(), "AdamW weight decay", 0);
  cli::add_int(app, "--warmup-steps", run.warmup_steps(), "linear warm-up steps before the cosine decay", 0,
               cli::kMaxSteps);
  cli::add_int(app, "--seed", seed_, "seed of the model, the data order and the augmentations", 0);
  app.add_option("--run-dir", run_dir_, "directory of the run's files (default: runs/RECIPE)");
  cli::add_int(app, "--checkpoint-every", run.checkpoint_every(), "checkpoint every K steps (0: only at the end)", 0,
               cli::kMaxSteps);
  cli::add_choice(app, "--resume", resume_,
                  "continue the run in --run-dir: --resume (a checkpoint must exist) or --resume auto (continue if "
                  "there is a checkpoint, else start)",
                  {"never", "always", "auto"})
      ->expected(0, 1);  // bare: "always" (resolve)
  app.add_flag("--trust-legacy-checkpoint", trust_legacy_,
               "with --resume: read a checkpoint of Contrax's earlier format (a TorchScript archive; reading it "
               "runs the code it holds, so only for one you wrote) and rewrite it as safetensors");
  app.add_flag("--overwrite", overwrite_, "replace an existing run in --run-dir");
  app.add_flag("--json", json_, "print the summary as one JSON object (progress goes to stderr)");
  cli::add_int(app, "--train-limit", tool_.train_limit, "train on the first N training examples (-1: all)", -1);
  cli::add_int(app, "--eval-limit", tool_.eval_limit,
               "evaluate with the first N train (kNN memory bank) and N test examples (-1: all)", -1);
  cli::add_int(app, "--threads", threads_, "intra-op threads per process (0: cores / processes)" + force_note, 0);
  cli::add_choice(app, "--dtype", dtype_, "float or double (exactness tests)", {"float", "double"});
  cli::add_device(app, device_,
                  "where each process trains: cpu, or cuda (the image recipes: process r on GPU LOCAL_RANK mod "
                  "#GPUs, one GPU per process, NCCL between them; augmentation on the CPU into pinned memory)");
  cli::add_int(app, "--log-every", run.log_every(), "progress line every N steps (0: none)", 0, cli::kMaxSteps);
  cli::add_int(app, "--stop-at-step", run.stop_at_step(), ">= 0: stop with a checkpoint at this step (tests)", -1,
               cli::kMaxSteps);
  cli::add_int(app, "--skip-nonfinite", run.skip_nonfinite(),
               "skip up to N steps whose loss or gradient is not finite (0: the first one stops the run)", 0,
               cli::kMaxSteps);
  app.add_flag("--no-eval", tool_.no_eval, "skip the evaluation");
  app.add_flag("--no-verify", no_verify_, "skip the exactness check after training");
  app.add_flag("--no-plot", no_plot_, "do not draw RUN_DIR/curves.png at the end");
  cli::add_int(app, "--timeout", timeout_s_, "seconds any collective may wait for a peer", 1, 24 * 3600);
  cli::add_int(app, "--max-restarts", max_restarts_,
               "restart all processes up to N times after a failure, resuming from the last checkpoint", 0, 1000);
  app.add_flag("--force", force_, "allow --nproc and --threads above " + std::to_string(cap));
  recipe.add_flags(app);
  app.footer("Recipes: contrax train [simclr|moco-v3|retrieval] FLAGS (or --recipe NAME); "
             "contrax train RECIPE --help shows that recipe's flags and defaults.");
}

// The checks that span flags; each single flag's range is checked while
// parsing, and the run directory's rules (--resume, --overwrite) by
// RunDir::claim in start().
void TrainCommand::check_flags() {
  cli::check_procs("--nproc", nproc_, force_);
  cli::check_procs("--threads", threads_, force_);
  cli::usage_check(threads_ <= cli::max_threads(), "flag '--threads' must be <= ", cli::max_threads(), " (",
                   cli::kMaxThreadsPerCore, " per core, even with --force: OpenMP starts every thread at once), but got ",
                   threads_);
  const double t = recipe_->temperature(), t_min = min_temperature(dtype_);
  cli::usage_check(t >= t_min, "flag '--temperature' must be >= ", t_min, " with --dtype ", dtype_,
                   " (logits reach 1/T and the gradients' squares grow as (1/T)^4, which must stay below ", dtype_,
                   "'s largest number ", dtype_ == "double" ? std::numeric_limits<double>::max()
                                                              : std::numeric_limits<float>::max(),
                   "), but got ", t);
  cli::usage_check(recipe_->run().max_steps() != 0, "flag '--max-steps' must be -1 (none) or >= 1, but got 0");
  cli::usage_check(tool_.train_limit != 0, "flag '--train-limit' must be -1 (all) or >= 1, but got 0");
  cli::usage_check(app_.count("--run-dir") == 0 || !run_dir_.empty(),
                   "flag '--run-dir' must name a directory, but got an empty string (leave it out for runs/RECIPE)");
  cli::usage_check(tool_.eval_limit != 0, "flag '--eval-limit' must be -1 (all) or >= 1, but got 0");
  if (device_ == "cuda") {
    cli::usage_check(recipe_->trains_on_gpu(), "flag '--device' is 'cuda', but the ", name_,
                     " recipe trains on the CPU only (the image recipes, simclr and moco-v3, train on a GPU)");
    cli::check_cuda_device(device_, nproc_, "flag '--device' is 'cuda' (each process on its own GPU, NCCL between them)");
  }
  recipe_->check_flags();
}

// The command line is read once, by CLI11, into an app that knows every
// recipe's flags by name; the recipe (the word after train, --recipe,
// --recipe-variant, or the --config file) then gives the flags their
// defaults and checks (resolve).
int TrainCommand::parse() {
  CLI::App given{"", "train"};
  cli::setup_app(given);
  std::string word;
  given.add_option("RECIPE", word, "the recipe")->configurable(false);
  for (const char* name : {"simclr", "retrieval"}) {  // the image recipes share their flags
    CLI::App flags;
    add_flags(flags, *cli::make_train_recipe(name, "default"));
    cli::add_unbound_flags(flags, given);
  }
  const int st = cli::parse(given, command_, [&](bool help) -> CLI::App& { return resolve(given, word, help); });
  if (st >= 0) return st;
  check_flags();
  if (run_dir_.empty()) run_dir_ = "runs/" + name_;
  return -1;
}

// The recipe the command line chose, its flags bound to it, and every flag
// given (or read from --config) applied to them with its checks: a flag of
// another recipe is a usage error.
CLI::App& TrainCommand::resolve(const CLI::App& given, const std::string& word, bool help) {
  // A word that names no recipe is a stray word, as before the recipes were words.
  if (!help && !word.empty() && !cli::is_train_recipe(word)) throw CLI::ExtrasError(given.get_name(), {word});
  const auto value = [&](const char* flag, const std::string& otherwise) {
    const CLI::Option* o = given.get_option(flag);
    return o->count() > 0 ? o->as<std::string>() : otherwise;
  };
  const std::string flag = value("--recipe", "");
  name_ = cli::is_train_recipe(word) ? word : cli::is_train_recipe(flag) ? flag : "simclr";
  recipe_ = cli::make_train_recipe(name_, value("--recipe-variant", "default"));
  name_flag_ = name_;
  seed_ = static_cast<int64_t>(recipe_->run().seed());
  default_lr_ = recipe_->run().lr();
  default_temperature_ = recipe_->temperature();
  cli::setup_app(app_);
  add_flags(app_, *recipe_);
  if (help) return app_;
  for (const CLI::Option* o : given.get_options()) {
    if (o->count() == 0 || o->get_lnames().empty() || !o->get_configurable() || o == given.get_config_ptr()) continue;
    const std::string name = "--" + o->get_lnames()[0];
    CLI::Option* mine = app_.get_option_no_throw(name);
    cli::usage_check(mine != nullptr, "flag '", name, "' is not a flag of the ", name_, " recipe (contrax train ",
                     name_, " --help lists its flags)");
    std::vector<std::string> values = o->results();
    // A bare --resume (its value is optional: CLI11 gives "") means always.
    if (name == "--resume") std::replace(values.begin(), values.end(), std::string(), std::string("always"));
    mine->add_result(values);
    mine->run_callback();
  }
  return app_;
}

// Runs the workers of a multi-process run on this node.
int TrainCommand::launch_workers(const std::string& start) const {
  std::vector<std::string> argv{contrax::self_executable(), "train"};
  argv.insert(argv.end(), command_.begin(), command_.end());
  contrax::LaunchOptions lo;
  lo.nproc = nproc_;
  lo.prefix_output = false;
  lo.grace = std::chrono::seconds(60);  // time to finish a step and write the checkpoint
  lo.max_restarts = max_restarts_;
  // Workers inherit the environment: they take the decision made here (and,
  // after a restart, resume from whatever checkpoint the failed attempt left).
  ::setenv(kStartEnv, max_restarts_ > 0 && start == "fresh" ? "auto" : start.c_str(), 1);
  // The workers' output reaches the terminal through the launcher's pipes:
  // whether it is one (and its width) is decided here (live_line.h).
  const cli::LiveLine live(json_ ? stderr : stdout);
  ::setenv("CONTRAX_PROGRESS", live.on() ? "live" : "plain", 1);
  if (live.on()) ::setenv("COLUMNS", std::to_string(live.columns()).c_str(), 1);
  auto r = contrax::launch(argv, lo);
  if (r.exit_code != 0) std::cerr << "contrax train: " << r.message << "\n";
  return r.exit_code;
}

int64_t TrainCommand::threads_per_process(int64_t world) const {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  return threads_ > 0 ? threads_ : std::max<int64_t>(1, cores / world);
}

// The threads this process will start, against the tasks limit, before any
// starts: the whole run where this process launches it (or trains alone),
// else (a worker of torchrun or srun) its own rank's. Workers of this tool's
// own launcher were counted by the process that started them.
void TrainCommand::check_tasks(bool top) const {
  cli::ThreadPlan p;
  p.threads_given = threads_ > 0;
  p.evaluates = !tool_.no_eval;
  if (top) {
    p.ranks = p.world = nproc_;
    p.launcher = true;
  } else if (std::getenv(kStartEnv) == nullptr) {
    const char* w = std::getenv("WORLD_SIZE") != nullptr ? std::getenv("WORLD_SIZE") : std::getenv("SLURM_NTASKS");
    const char* r = std::getenv("RANK") != nullptr ? std::getenv("RANK") : std::getenv("SLURM_PROCID");
    p.world = std::max<int64_t>(1, w != nullptr ? std::atoll(w) : 1);
    p.hosts_store = r != nullptr && std::string(r) == "0";
    p.evaluates = p.evaluates && p.hosts_store;
  } else {
    return;
  }
  p.threads = threads_per_process(p.world);
  cli::check_tasks_limit(p);
}

// Decides fresh or resume. The process the user started claims the run
// directory and holds its lock for the whole run (its workers included), then
// starts the workers of a multi-process run (or one under a restart policy);
// a worker of an outside launcher (contrax launch, srun) has no such parent:
// there rank 0 claims the directory and the other ranks only decide. Returns
// -1 when this process trains, else the exit status of the workers.
int TrainCommand::start() {
  const ct::RunDir dir(run_dir_);
  const auto mode = ct::resume_mode(resume_);
  const char* start_env = std::getenv(kStartEnv);
  const bool top = !contrax::in_launched_worker();
  // The worker's rank as its launcher set it: torchrun-style RANK, or an srun
  // task's SLURM_PROCID (what Communicator::from_env reads when RANK is unset).
  const char* env_rank = std::getenv("RANK") != nullptr ? std::getenv("RANK") : std::getenv("SLURM_PROCID");
  const bool outside_rank0 = !top && start_env == nullptr && env_rank != nullptr && std::string(env_rank) == "0";
  check_tasks(top);
  if (top || outside_rank0) {
    claim_ = dir.claim(mode, overwrite_);  // refusals: RunDirRefused, a usage error (run_train)
    resumed_ = claim_.resume;
    // Even one process runs under the launcher: should the kernel's
    // out-of-memory killer end it (SIGKILL, which no process can catch), or
    // a restart policy restart it, someone must be there to say so.
    if (top) return launch_workers(resumed_ ? "resume" : "fresh");
  } else if (start_env != nullptr) {
    const std::string s = start_env;
    resumed_ = s == "resume" || (s == "auto" && dir.resumes(ct::ResumeMode::kAuto));
  } else {
    resumed_ = dir.resumes(mode);
  }
  return -1;
}

Json TrainCommand::settings() const {
  const ct::RunOptions& run = recipe_->run();
  Json s;
  s["recipe"] = name_;
  s["nproc"] = nproc_;
  s["epochs"] = run.epochs();
  s["max_steps"] = run.max_steps();
  s["batch_size"] = run.batch_size();
  s["lr"] = run.lr();
  s["weight_decay"] = run.weight_decay();
  s["warmup_steps"] = run.warmup_steps();
  s["seed"] = seed_;
  s["run_dir"] = run_dir_;
  s["checkpoint_every"] = run.checkpoint_every();
  s["resume"] = resume_;
  s["train_limit"] = tool_.train_limit;
  s["eval_limit"] = tool_.eval_limit;
  s["threads"] = threads_;
  s["dtype"] = dtype_;
  s["device"] = device_;
  s["log_every"] = run.log_every();
  s["stop_at_step"] = run.stop_at_step();
  s["skip_nonfinite"] = run.skip_nonfinite();
  s["eval"] = !tool_.no_eval;
  s["verify"] = !no_verify_;
  s["timeout_s"] = timeout_s_;
  s["max_restarts"] = max_restarts_;
  recipe_->settings(s);
  return s;
}

// Trains on this process's rank and reports; returns the exit status.
int TrainCommand::train() {
  const auto wall0 = std::chrono::steady_clock::now();
  contrax::note_worker_memory("starting: joining its peers, loading the data set and building the model");
  comm_ = cli::with_thread_hint([&] {
    return contrax::Communicator::from_env(contrax::CommunicatorOptions()
                                               .timeout(std::chrono::seconds(timeout_s_))
                                               .device(device_ == "cuda" ? torch::kCUDA : torch::kCPU));
  });
  const int64_t world = comm_->world_size(), rank = comm_->rank();
  threads_guard_ = std::make_unique<cli::IntraOpThreads>(threads_per_process(world), "rank " + std::to_string(rank));
  console_ = std::make_unique<cli::TrainConsole>(json_);
  const ct::RunDir dir(run_dir_);
  if (rank == 0) {
    console_->open_log(dir, resumed_);
    Json config;
    config["settings"] = settings();
    config["command"] = command_;
    config["resumed"] = resumed_;
    config["world_size"] = world;
    config["threads_per_process"] = at::get_num_threads();
    config["versions"] = {{"contrax", CONTRAX_VERSION}, {"libtorch", TORCH_VERSION}, {"blas", cli::blas_library()}};
    dir.write(ct::RunDir::kConfig, config.dump(2) + "\n");
  }
  const int64_t n = recipe_->load(tool_);
  // epochs x steps per epoch, before anything trains (the loop checks it
  // too, but cannot name the flags).
  auto& run = recipe_->run();
  const int64_t per_epoch = n / run.batch_size() + (n % run.batch_size() != 0);
  cli::usage_check(run.max_steps() > 0 || run.epochs() <= cli::kMaxSteps / std::max<int64_t>(1, per_epoch),
                   "flag '--epochs' x ", per_epoch, " steps per epoch must be <= 2^40 steps, but got --epochs ",
                   run.epochs());
  run.seed(static_cast<uint64_t>(seed_))
      .dtype(dtype_ == "double" ? torch::kDouble : torch::kFloat)
      .run_dir(run_dir_)
      .resume(resumed_)
      .trust_legacy_checkpoint(trust_legacy_)
      .log([this](const std::string& line) { console_->progress_line(line); })
      .on_step([this](const ct::StepProgress& p) {
        console_->live().show(cli::train_step_line(p), p.step == p.total_steps);
      })
      .on_record_error([](const std::string& line) { std::cerr << "contrax train: " << line << std::flush; })
      .stop_requested([] {
        // The loop's first stop check: from here on a signal stops it at a
        // step boundary with a checkpoint; until now it ended the rank at
        // once (stop_signal.h).
        cli::stop_signals(cli::OnSignal::kRequestStop);
        return cli::stop_signal() != 0;
      });
  if (rank == 0) {
    const int64_t t = at::get_num_threads();
    console_->out(c10::str("contrax train: ", recipe_->what(), ", ", world, " process", world > 1 ? "es" : "", " x ",
                           t, " thread", t > 1 ? "s" : "", ", global batch ", recipe_->batch(), ", run dir ", run_dir_,
                           resumed_ ? " (resuming)" : "", "\n"));
  }
  ct::RunResult r;
  // A peer that a signal ended first fails this rank's collective: the
  // signal, not the error, is why the run ended. Otherwise train.log keeps
  // why the run ended, in the words the console gets.
  const auto ended = [this](const std::string& msg) {
    if (cli::stop_signal() != 0) cli::end_by_signal(cli::stop_signal());
    console_->log_only(c10::str("contrax train: error: ", msg, "\n"));
  };
  try {
    contrax::note_worker_memory("training");  // the recipe may say how much a step needs
    r = recipe_->train(comm_);
  } catch (const ct::Diverged& e) {
    // The loop names the step; the flags that may have caused it are the tool's to name.
    const std::string msg = message(e) + divergence_cause();
    ended(msg);
    cli::throw_train_error(e, msg);
  } catch (const ct::TrainError& e) {
    ended(message(e));
    cli::throw_train_error(e, message(e));
  } catch (const c10::Error& e) {
    ended(e.what_without_backtrace());
    throw;
  }
  console_->live().keep();  // the training's last state stays on the screen
  // Evaluation has nothing to save: a signal ends it at once.
  if (!r.interrupted) cli::stop_signals(cli::OnSignal::kEndAtOnce);
  if (r.interrupted) {
    if (rank == 0) {
      console_->err(c10::str("contrax train: stopped at step ", r.steps, "/", r.total_steps, "; checkpoint ",
                             dir.checkpoint(), " written; continue with --resume\n"));
    }
    return cli::stop_signal() != 0 && !contrax::in_launched_worker() ? 128 + cli::stop_signal() : 0;
  }
  return report(r, wall0);
}

// Among the flags that were set, those that likely made a run diverge: a
// temperature below the recipe's (logits up to 1/T), a learning rate above
// it, no warm-up. Empty when none was set.
std::string TrainCommand::divergence_cause() const {
  const ct::RunOptions& run = recipe_->run();
  const auto given = [this](const char* flag) { return app_.count(flag) > 0; };
  std::vector<std::string> causes;
  const double t = recipe_->temperature();
  if (given("--temperature") && t < default_temperature_) {
    causes.push_back(c10::str("--temperature ", t, " (logits up to 1/T = ", 1 / t, "; the recipe's is ",
                              default_temperature_, ")"));
  }
  if (given("--lr") && run.lr() > default_lr_) {
    causes.push_back(c10::str("--lr ", run.lr(), " (the recipe's is ", default_lr_, ")"));
  }
  if (given("--warmup-steps") && run.warmup_steps() == 0) causes.push_back("--warmup-steps 0 (no warm-up)");
  if (causes.empty()) return "";
  std::string s = "; likely cause among the flags set: " + causes[0];
  for (size_t i = 1; i < causes.size(); ++i) s += ", " + causes[i];
  return s;
}

// `contrax verify` over the run's communicator.
Json TrainCommand::verify() const {
  Json v;
  double worst = 0;
  bool ok = true;
  const auto results = contrax::verify(comm_);
  for (const auto& c : results) {
    worst = std::max(worst, c.max_rel_err);
    ok = ok && c.passed;
  }
  v["ok"] = ok;
  cli::put_number(v, "max_rel_err", worst);
  v["cases"] = results.size();
  v["world_size"] = comm_->world_size();
  return v;
}

// The exactness check, then on rank 0 the evaluation, results.json, the
// summary and the curves.
int TrainCommand::report(const ct::RunResult& r, std::chrono::steady_clock::time_point wall0) {
  if (comm_->rank() == 0 && !no_verify_) {
    console_->live().show("verify  the distributed gradients against one device's", true);
  }
  const Json verify_j = no_verify_ ? Json() : verify();
  // Evaluation on rank 0, after the last collective: the other ranks are done
  // and exit, so a slow evaluation can never time out a peer that waits for it
  // (a barrier here failed after its 300 s timeout when a loaded machine slowed
  // the evaluation down). Its parts use the cores the finished ranks left
  // (unless --threads was given) side by side, one thread each, rather than as
  // threads of one part: on a shared 2-core machine two OpenMP threads made
  // the probe's many small L-BFGS steps many times slower (threads spinning
  // against other processes).
  if (comm_->rank() != 0) return 0;
  tool_.eval_threads = threads_ > 0 ? threads_ : std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t steps_run = r.steps - r.start_step;
  Json s;
  s["recipe"] = name_;
  s["world_size"] = comm_->world_size();
  s["steps"] = r.steps;
  s["start_step"] = r.start_step;
  s["steps_run"] = steps_run;
  s["total_steps"] = r.total_steps;
  s["epochs"] = r.epochs_done;
  s["batch_size"] = recipe_->run().batch_size();
  s["skipped_steps"] = r.skipped_steps;
  cli::put_number(s, "final_loss", r.losses.empty() ? std::nan("") : r.losses.back());
  recipe_->summarize(s);
  std::ostringstream table;
  const auto e0 = std::chrono::steady_clock::now();
  std::string part;  // shown at once when it changes; its stages at most ten times a second
  if (!tool_.no_eval) contrax::note_worker_memory("evaluating the trained model (training had finished)");
  const double eval_s = tool_.no_eval ? 0 : recipe_->evaluate(tool_, s, table, [&](const std::string& what) {
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
    const std::string now_part = what.substr(0, what.find(':'));
    console_->live().show("evaluate  " + what + "  (" + ct::format_duration(t) + ")", now_part != part);
    part = now_part;
  });
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  cli::put_number(s, "examples_per_s", r.examples_per_s);
  cli::put_number(s, "train_s", r.train_s);
  cli::put_number(s, "wall_s", wall);
  s["bytes_sent_rank0"] = r.bytes_sent;
  if (!no_verify_) s["verify"] = verify_j;
  s["run_dir"] = run_dir_;
  const ct::RunDir dir(run_dir_);
  dir.write(ct::RunDir::kResults, s.dump(2) + "\n");
  std::ostringstream out;
  if (json_) {
    out << s.dump() << "\n";
  } else {
    out << table.str();
    if (steps_run == 0 && r.start_step >= r.total_steps) {
      // --resume auto (or --resume) of a run that had already finished.
      out << "nothing to train: the run in " << run_dir_ << " had already finished (" << r.steps << " of "
          << r.total_steps << " steps); " << std::fixed << std::setprecision(1);
    } else {
      out << "trained " << steps_run << " step" << (steps_run == 1 ? "" : "s");
      if (r.start_step > 0) out << " (steps " << r.start_step + 1 << "-" << r.steps << " of " << r.total_steps << ")";
      out << " to epoch " << r.epochs_done << " in " << std::fixed << std::setprecision(1) << r.train_s << " s, "
          << std::setprecision(0) << r.examples_per_s << " " << recipe_->rate_note() << std::setprecision(1);
    }
    if (r.skipped_steps > 0) out << r.skipped_steps << " non-finite steps skipped; ";
    if (!tool_.no_eval) out << "evaluated in " << eval_s << " s; ";
    out << "wall " << wall << " s\n";
    if (!no_verify_) {
      out << (verify_j["ok"].get<bool>() ? "distributed gradients equal single-device"
                                         : "MISMATCH: distributed gradients differ from single-device")
          << ": max rel err " << std::setprecision(3) << std::scientific
          << (verify_j["max_rel_err"].is_null() ? std::nan("") : verify_j["max_rel_err"].get<double>()) << " over "
          << verify_j["cases"].get<int64_t>() << " cases (W=" << comm_->world_size() << ")\n";
    }
  }
  console_->result(out.str());
  // A missing matplotlib costs the picture, not the run: the script says why.
  if (!no_plot_ && r.steps > 0 && cli::plot_run(run_dir_, /*quiet=*/true) != 0) {
    console_->err("contrax train: curves.png not drawn (see above); the run itself is complete\n");
  }
  return verify_j.is_null() || verify_j["ok"].get<bool>() ? 0 : 1;
}

int run_train(const std::vector<std::string>& args) {
  TrainCommand train(args);
  if (int st = train.parse(); st >= 0) return st;
  try {
    if (int st = train.start(); st >= 0) return st;
    return train.train();
  } catch (const ct::TrainError& e) {
    // Before the loop (a refused run directory, unreadable data): the
    // library's fact in the tool's words.
    cli::throw_train_error(e, train.message(e));
  }
}

contrax::cli::Command train_cmd("train",
                                "train a recipe (simclr, moco-v3, retrieval) over N processes, then evaluate",
                                run_train);

}  // namespace
