// The shared settings of `contrax train`, one row each (train_settings.h).
#include "train/train_settings.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <thread>
#include <type_traits>
#include <utility>

#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/machine.h"

namespace contrax::cli {

namespace ct = contrax::train;

int64_t TrainSettings::threads_per_process(int64_t world) const {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  return threads > 0 ? threads : std::max<int64_t>(1, cores / world);
}

namespace {

// --recipe is checked while parsing against the recipe the command line
// chose, so that --dump-config never writes a recipe other than the one
// whose flags it lists.
void must_name_the_recipe(CLI::Option& o, const TrainSettings& s) {
  const std::string name = s.recipe;  // the recipe chosen, as the flags are bound
  o.check(CLI::Validator(
      [name](std::string& v) -> std::string {
        usage_check(v == name, "flag '--recipe' says ", v, " but the recipe is ", name, " (contrax train ", name,
                    ")");
        return std::string();
      },
      ""));
}

// A bare --resume: "always" (TrainCommand::resolve).
void value_optional(CLI::Option& o, const TrainSettings&) { o.expected(0, 1); }

std::string lr_above_the_recipes(double lr, double recipe) {
  return lr > recipe ? c10::str("--lr ", lr, " (the recipe's is ", recipe, ")") : std::string();
}

std::string no_warmup(double steps, double) { return steps == 0 ? "--warmup-steps 0 (no warm-up)" : ""; }

// An integer flag in [lo, hi]; a number flag (> lo when `lo_open`, else >=
// lo); a string flag limited to `choices`; a string flag of any text; a
// switch.
TrainSetting integer(std::string flag, std::string key, Place<int64_t> where, std::string help,
                     int64_t lo = std::numeric_limits<int64_t>::min(),
                     int64_t hi = std::numeric_limits<int64_t>::max()) {
  TrainSetting s(std::move(flag), std::move(key), where, std::move(help));
  s.lo = lo;
  s.hi = hi;
  return s;
}

TrainSetting number(std::string flag, std::string key, Place<double> where, std::string help, double lo,
                    double hi = std::numeric_limits<double>::max(), bool lo_open = false) {
  TrainSetting s(std::move(flag), std::move(key), where, std::move(help));
  s.number_lo = lo;
  s.number_hi = hi;
  s.lo_open = lo_open;
  return s;
}

TrainSetting choice(std::string flag, std::string key, Place<std::string> where, std::string help,
                    std::vector<std::string> choices) {
  TrainSetting s(std::move(flag), std::move(key), where, std::move(help));
  s.choices = std::move(choices);
  return s;
}

TrainSetting text(std::string flag, std::string key, Place<std::string> where, std::string help) {
  return TrainSetting(std::move(flag), std::move(key), where, std::move(help));
}

TrainSetting toggle(std::string flag, std::string key, Place<bool> where, std::string help) {
  return TrainSetting(std::move(flag), std::move(key), where, std::move(help));
}

}  // namespace

std::vector<TrainSetting> train_settings() {
  using S = TrainSettings;
  using T = TrainToolFlags;
  using R = ct::RunOptions;
  const std::string cap = std::to_string(max_procs());
  const std::string force_note =
      " (at most " + cap + ", " + std::to_string(kMaxProcsPerCore) + " per core, unless --force)";
  return {
      choice("--recipe", "recipe", &S::recipe, "the recipe (or as the word after train: contrax train RECIPE)",
             train_recipe_names())
          .then(must_name_the_recipe),
      integer("--nproc", "nproc", &S::nproc, "local processes (ignored under a launcher)" + force_note, 1),
      integer("--epochs", "epochs", &R::epochs, "epochs over the training subset (unless --max-steps)", 1,
              int64_t{1} << 20),
      integer("--max-steps", "max_steps", &R::max_steps,
              "> 0: train exactly this many steps (the schedule's length); -1: none", -1, kMaxSteps),
      integer("--batch-size", "batch_size", &R::batch_size, "global batch size (all processes together)", 1,
              kMaxBatch),
      number("--lr", "lr", &R::lr, "peak learning rate of AdamW", 0, std::numeric_limits<double>::max(), true)
          .hints(lr_above_the_recipes),
      number("--weight-decay", "weight_decay", &R::weight_decay, "AdamW weight decay", 0),
      integer("--warmup-steps", "warmup_steps", &R::warmup_steps, "linear warm-up steps before the cosine decay", 0,
              kMaxSteps)
          .hints(no_warmup),
      integer("--seed", "seed", &S::seed, "seed of the model, the data order and the augmentations", 0),
      text("--run-dir", "run_dir", &S::run_dir, "directory of the run's files (default: runs/RECIPE)"),
      integer("--checkpoint-every", "checkpoint_every", &R::checkpoint_every,
              "checkpoint every K steps (0: only at the end)", 0, kMaxSteps),
      choice("--resume", "resume", &S::resume,
             "continue the run in --run-dir: --resume (a checkpoint must exist) or --resume auto (continue if "
             "there is a checkpoint, else start)",
             {"never", "always", "auto"})
          .then(value_optional),
      toggle("--trust-legacy-checkpoint", "", &S::trust_legacy,
             "with --resume: read a checkpoint of Contrax's earlier format (a TorchScript archive; reading it "
             "runs the code it holds, so only for one you wrote) and rewrite it as safetensors"),
      toggle("--overwrite", "", &S::overwrite, "replace an existing run in --run-dir"),
      toggle("--json", "", &S::json, "print the summary as one JSON object (progress goes to stderr)"),
      integer("--train-limit", "train_limit", &T::train_limit, "train on the first N training examples (-1: all)",
              -1),
      integer("--eval-limit", "eval_limit", &T::eval_limit,
              "evaluate with the first N train (kNN memory bank) and N test examples (-1: all)", -1),
      integer("--threads", "threads", &S::threads, "intra-op threads per process (0: cores / processes)" + force_note,
              0),
      choice("--dtype", "dtype", &S::dtype, "float or double (exactness tests)", {"float", "double"}),
      choice("--device", "device", &S::device,
             "where each process trains: cpu, or cuda (the image recipes: process r on GPU LOCAL_RANK mod "
             "#GPUs, one GPU per process, NCCL between them; augmentation on the CPU into pinned memory)",
             {"cpu", "cuda"}),
      integer("--log-every", "log_every", &R::log_every, "progress line every N steps (0: none)", 0, kMaxSteps),
      integer("--stop-at-step", "stop_at_step", &R::stop_at_step, ">= 0: stop with a checkpoint at this step (tests)",
              -1, kMaxSteps),
      integer("--skip-nonfinite", "skip_nonfinite", &R::skip_nonfinite,
              "skip up to N steps whose loss or gradient is not finite (0: the first one stops the run)", 0,
              kMaxSteps),
      toggle("--no-eval", "eval", &T::no_eval, "skip the evaluation").negated(),
      toggle("--no-verify", "verify", &S::no_verify, "skip the exactness check after training").negated(),
      toggle("--no-plot", "", &S::no_plot, "do not draw RUN_DIR/curves.png at the end"),
      integer("--timeout", "timeout_s", &S::timeout_s, "seconds any collective may wait for a peer", 1, 24 * 3600),
      integer("--max-restarts", "max_restarts", &S::max_restarts,
              "restart all processes up to N times after a failure, resuming from the last checkpoint", 0, 1000),
      toggle("--force", "", &S::force, "allow --nproc and --threads above " + cap),
  };
}

void add_train_flags(CLI::App& app, TrainSettings& s, ct::RunOptions& run) {
  for (const TrainSetting& row : train_settings()) {
    CLI::Option* o = std::visit(
        [&](const auto& where) -> CLI::Option* {
          auto& value = where.in(s, run);
          using V = std::decay_t<decltype(value)>;
          if constexpr (std::is_same_v<V, int64_t>) {
            return add_int(app, row.flag, value, row.help, row.lo, row.hi);
          } else if constexpr (std::is_same_v<V, double>) {
            return add_double(app, row.flag, value, row.help, row.number_lo, row.number_hi, row.lo_open);
          } else if constexpr (std::is_same_v<V, bool>) {
            return app.add_flag(row.flag, value, row.help);
          } else if (!row.choices.empty()) {
            return add_choice(app, row.flag, value, row.help, row.choices);
          } else {
            return app.add_option(row.flag, value, row.help);
          }
        },
        row.where);
    if (row.finish != nullptr) row.finish(*o, s);
  }
}

void write_train_settings(Json& j, TrainSettings& s, ct::RunOptions& run) {
  for (const TrainSetting& row : train_settings()) {
    if (row.key.empty()) continue;
    std::visit(
        [&](const auto& where) {
          const auto& value = where.in(s, run);
          if constexpr (std::is_same_v<std::decay_t<decltype(value)>, bool>) {
            j[row.key] = row.recorded_negated ? !value : value;
          } else {
            j[row.key] = value;
          }
        },
        row.where);
  }
}

std::vector<std::string> divergence_hints(const std::function<bool(const std::string& flag)>& given,
                                          TrainSettings& s, ct::RunOptions& run, TrainSettings& recipe_s,
                                          ct::RunOptions& recipe_run) {
  std::vector<std::string> causes;
  for (const TrainSetting& row : train_settings()) {
    if (row.hint == nullptr || !given(row.flag)) continue;
    const auto as_number = [](auto& v) -> double {
      if constexpr (std::is_arithmetic_v<std::decay_t<decltype(v)>>) {
        return static_cast<double>(v);
      } else {
        return 0;  // a hint is for a number's row only
      }
    };
    const double now = std::visit([&](const auto& w) { return as_number(w.in(s, run)); }, row.where);
    const double recipe = std::visit([&](const auto& w) { return as_number(w.in(recipe_s, recipe_run)); }, row.where);
    if (std::string cause = row.hint(now, recipe); !cause.empty()) causes.push_back(std::move(cause));
  }
  return causes;
}

}  // namespace contrax::cli
