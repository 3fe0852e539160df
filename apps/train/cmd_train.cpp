// `contrax train [RECIPE]`: a recipe trained over N processes, then its
// evaluation and `contrax verify`'s exactness line. The recipes are in
// train_image.cpp (simclr, moco-v3: Fashion-MNIST) and train_retrieval.cpp
// (retrieval: WordNet); the flags every recipe shares are one table
// (train_settings.h), and one rank's run (launch, train, report) is
// train_run.h. This file is the command: it reads the command line into the
// recipe and the table, checks what spans flags, claims the run directory
// (contrax/train/common/run_dir.h), starts the workers, and names the flags
// that likely made a run diverge.
//
//   contrax train                                  # simclr: 2 processes, 10 epochs
//   contrax train moco-v3 --epochs 3 --run-dir runs/moco   # or: contrax train --recipe moco-v3 ...
//   contrax train retrieval --help                 # the retrieval recipe's flags and defaults
//   contrax train --run-dir runs/a --resume auto   # continue a stopped run, or start it
//   contrax train --max-steps 20 --train-limit 2048 --json
//   contrax train --lr 1e-3 --dump-config > run.toml && contrax train --config run.toml
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/json_util.h"
#include "cli/live_line.h"
#include "cli/machine.h"
#include "contrax/launch/launcher.h"
#include "contrax/train/common/run_dir.h"
#include "train/train_errors.h"
#include "train/train_recipe.h"
#include "train/train_run.h"
#include "train/train_settings.h"
#include "train/train_threads.h"

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

// The command: its settings are the table's (the defaults of the run's flags
// are the recipe's options, the one place they are written) and the
// recipe's own.
class TrainCommand {
 public:
  explicit TrainCommand(const std::vector<std::string>& args) : command_(args) {}
  /// -1 to go on, else the status to exit with (--help, a usage error).
  int parse();
  /// -1 when this process trains, else the exit status of its workers.
  int start();
  /// This rank's run: launch, train, report; returns the exit status.
  int train();
  /// The tool's message for a typed error of the trainer library.
  std::string message(const ct::TrainError& e) const { return cli::train_error_message(e, recipe_->data_hint()); }

 private:
  void add_flags(CLI::App& app, cli::TrainRecipe& recipe);
  CLI::App& resolve(const CLI::App& given, const std::string& word, bool help);
  void check_flags();
  int launch_workers(const std::string& start) const;
  void check_tasks(bool top) const;
  Json settings();
  std::string divergence_cause();

  const std::vector<std::string> command_;  // as given
  CLI::App app_{"train a recipe (SimCLR, MoCo v3, two-tower retrieval) over N processes, then evaluate", "train"};
  std::unique_ptr<cli::TrainRecipe> recipe_;
  cli::TrainSettings s_;  // the table's values (train_settings.h)
  // The recipe's values, before the command line applied: divergence_cause() compares with them.
  cli::TrainSettings recipe_s_;
  ct::RunOptions recipe_run_;
  double recipe_temperature_ = 0;
  bool resumed_ = false;
  ct::RunDir::Claim claim_;  // the run directory's lock, held until the run ends
};

// The flags of a run of `recipe` (the shared ones, then the recipe's own),
// their defaults the recipe's.
void TrainCommand::add_flags(CLI::App& app, cli::TrainRecipe& recipe) {
  cli::add_train_flags(app, s_, recipe.run());
  recipe.add_flags(app);
  app.footer("Recipes: contrax train [simclr|moco-v3|retrieval] FLAGS (or --recipe NAME); "
             "contrax train RECIPE --help shows that recipe's flags and defaults.");
}

// The checks that span flags; each single flag's range is checked while
// parsing, and the run directory's rules (--resume, --overwrite) by
// RunDir::claim in start().
void TrainCommand::check_flags() {
  cli::check_procs("--nproc", s_.nproc, s_.force);
  cli::check_procs("--threads", s_.threads, s_.force);
  cli::usage_check(s_.threads <= cli::max_threads(), "flag '--threads' must be <= ", cli::max_threads(), " (",
                   cli::kMaxThreadsPerCore, " per core, even with --force: OpenMP starts every thread at once), but got ",
                   s_.threads);
  const double t = recipe_->temperature(), t_min = min_temperature(s_.dtype);
  cli::usage_check(t >= t_min, "flag '--temperature' must be >= ", t_min, " with --dtype ", s_.dtype,
                   " (logits reach 1/T and the gradients' squares grow as (1/T)^4, which must stay below ", s_.dtype,
                   "'s largest number ", s_.dtype == "double" ? std::numeric_limits<double>::max()
                                                              : std::numeric_limits<float>::max(),
                   "), but got ", t);
  cli::usage_check(recipe_->run().max_steps() != 0, "flag '--max-steps' must be -1 (none) or >= 1, but got 0");
  cli::usage_check(s_.tool.train_limit != 0, "flag '--train-limit' must be -1 (all) or >= 1, but got 0");
  cli::usage_check(app_.count("--run-dir") == 0 || !s_.run_dir.empty(),
                   "flag '--run-dir' must name a directory, but got an empty string (leave it out for runs/RECIPE)");
  cli::usage_check(s_.tool.eval_limit != 0, "flag '--eval-limit' must be -1 (all) or >= 1, but got 0");
  if (s_.device == "cuda") {
    cli::usage_check(recipe_->trains_on_gpu(), "flag '--device' is 'cuda', but the ", s_.recipe,
                     " recipe trains on the CPU only (the image recipes, simclr and moco-v3, train on a GPU)");
    cli::check_cuda_device(s_.device, s_.nproc, "flag '--device' is 'cuda' (each process on its own GPU, NCCL between them)");
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
  if (s_.run_dir.empty()) s_.run_dir = "runs/" + s_.recipe;
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
  const std::string name = cli::is_train_recipe(word) ? word : cli::is_train_recipe(flag) ? flag : "simclr";
  recipe_ = cli::make_train_recipe(name, value("--recipe-variant", "default"));
  s_.recipe = name;
  s_.seed = static_cast<int64_t>(recipe_->run().seed());
  cli::setup_app(app_);
  add_flags(app_, *recipe_);
  // The recipe's values, before the command line's: what divergence_cause()
  // compares with.
  recipe_s_ = s_;
  recipe_run_ = recipe_->run();
  recipe_temperature_ = recipe_->temperature();
  if (help) return app_;
  for (const CLI::Option* o : given.get_options()) {
    if (o->count() == 0 || o->get_lnames().empty() || !o->get_configurable() || o == given.get_config_ptr()) continue;
    const std::string flag_name = "--" + o->get_lnames()[0];
    CLI::Option* mine = app_.get_option_no_throw(flag_name);
    cli::usage_check(mine != nullptr, "flag '", flag_name, "' is not a flag of the ", name, " recipe (contrax train ",
                     name, " --help lists its flags)");
    std::vector<std::string> values = o->results();
    // A bare --resume (its value is optional: CLI11 gives "") means always.
    if (flag_name == "--resume") std::replace(values.begin(), values.end(), std::string(), std::string("always"));
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
  lo.nproc = s_.nproc;
  lo.prefix_output = false;
  lo.grace = std::chrono::seconds(60);  // time to finish a step and write the checkpoint
  lo.max_restarts = s_.max_restarts;
  // Workers inherit the environment: they take the decision made here (and,
  // after a restart, resume from whatever checkpoint the failed attempt left).
  ::setenv(kStartEnv, s_.max_restarts > 0 && start == "fresh" ? "auto" : start.c_str(), 1);
  // The workers' output reaches the terminal through the launcher's pipes:
  // whether it is one (and its width) is decided here (live_line.h).
  const cli::LiveLine live(s_.json ? stderr : stdout);
  ::setenv("CONTRAX_PROGRESS", live.on() ? "live" : "plain", 1);
  if (live.on()) ::setenv("COLUMNS", std::to_string(live.columns()).c_str(), 1);
  auto r = contrax::launch(argv, lo);
  if (r.exit_code != 0) std::cerr << "contrax train: " << r.message << "\n";
  return r.exit_code;
}

// The threads this process will start, against the tasks limit, before any
// starts: the whole run where this process launches it (or trains alone),
// else (a worker of torchrun or srun) its own rank's. Workers of this tool's
// own launcher were counted by the process that started them.
void TrainCommand::check_tasks(bool top) const {
  cli::ThreadPlan p;
  p.threads_given = s_.threads > 0;
  p.evaluates = !s_.tool.no_eval;
  if (top) {
    p.ranks = p.world = s_.nproc;
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
  p.threads = s_.threads_per_process(p.world);
  cli::check_tasks_limit(p);
}

// Decides fresh or resume. The process the user started claims the run
// directory and holds its lock for the whole run (its workers included), then
// starts the workers of a multi-process run (or one under a restart policy);
// a worker of an outside launcher (contrax launch, srun) has no such parent:
// there rank 0 claims the directory and the other ranks only decide. Returns
// -1 when this process trains, else the exit status of the workers.
int TrainCommand::start() {
  const ct::RunDir dir(s_.run_dir);
  const auto mode = ct::resume_mode(s_.resume);
  const char* start_env = std::getenv(kStartEnv);
  const bool top = !contrax::in_launched_worker();
  // The worker's rank as its launcher set it: torchrun-style RANK, or an srun
  // task's SLURM_PROCID (what Communicator::from_env reads when RANK is unset).
  const char* env_rank = std::getenv("RANK") != nullptr ? std::getenv("RANK") : std::getenv("SLURM_PROCID");
  const bool outside_rank0 = !top && start_env == nullptr && env_rank != nullptr && std::string(env_rank) == "0";
  check_tasks(top);
  if (top || outside_rank0) {
    claim_ = dir.claim(mode, s_.overwrite);  // refusals: RunDirRefused, a usage error (run_train)
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

// config.json's "settings": the table's, then the recipe's own.
Json TrainCommand::settings() {
  Json s;
  cli::write_train_settings(s, s_, recipe_->run());
  recipe_->settings(s);
  return s;
}

int TrainCommand::train() {
  cli::TrainRun run(*recipe_, s_, resumed_, [this] { return divergence_cause(); });
  run.launch(settings(), command_);
  return run.report(run.train());
}

// Among the flags that were set, those that likely made a run diverge: a
// temperature below the recipe's (logits up to 1/T), then the table's hints
// (a learning rate above the recipe's, no warm-up). Empty when none was set.
std::string TrainCommand::divergence_cause() {
  const auto given = [this](const std::string& flag) { return app_.count(flag) > 0; };
  std::vector<std::string> causes;
  const double t = recipe_->temperature();
  if (given("--temperature") && t < recipe_temperature_) {
    causes.push_back(c10::str("--temperature ", t, " (logits up to 1/T = ", 1 / t, "; the recipe's is ",
                              recipe_temperature_, ")"));
  }
  for (std::string& c : cli::divergence_hints(given, s_, recipe_->run(), recipe_s_, recipe_run_)) {
    causes.push_back(std::move(c));
  }
  if (causes.empty()) return "";
  std::string s = "; likely cause among the flags set: " + causes[0];
  for (size_t i = 1; i < causes.size(); ++i) s += ", " + causes[i];
  return s;
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
