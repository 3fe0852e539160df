// The recipes of `contrax train` as the tool sees them. What every recipe
// shares is the command's: the flags of the run (bound to the recipe's
// RunOptions, so their defaults are the recipe's) and of the tool
// (train_settings.h), the run directory and the workers (cmd_train.cpp), the
// console and train.log, config.json, results.json and the summary
// (train_run.h). A recipe adds its own flags with its defaults, loads its
// data, trains and evaluates:
//
//   train_image.cpp      simclr, moco-v3: Fashion-MNIST, kNN and linear probe
//   train_retrieval.cpp  retrieval: WordNet reverse dictionary, recall and MRR
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "contrax/comm/communicator.h"
#include "contrax/train/common/loop.h"
#include "cli/json_util.h"

namespace contrax::cli {

/// Limits of the integer flags: far beyond any real run, far below overflow
/// of the products the loop forms (batch x steps examples, epochs x steps).
constexpr int64_t kMaxBatch = int64_t{1} << 20;
constexpr int64_t kMaxSteps = int64_t{1} << 40;

/// The tool's flags that every recipe shares (train_settings.h adds them).
struct TrainToolFlags {
  int64_t train_limit = -1;  // first N training examples
  int64_t eval_limit = -1;   // first N evaluation examples
  bool no_eval = false;
  int64_t eval_threads = 0;  // cores the evaluation may use (> 1: its parts side by side, one thread each)
};

/// A recipe of `contrax train`.
class TrainRecipe {
 public:
  virtual ~TrainRecipe() = default;
  /// The run options within the recipe's options: the shared flags bind to them.
  virtual train::RunOptions& run() = 0;
  /// The loss's temperature (the retrieval recipe's initial one).
  virtual double temperature() const = 0;
  /// Adds the recipe's own flags, their defaults its options' values.
  virtual void add_flags(CLI::App& app) = 0;
  /// After parsing: the checks that span the recipe's flags (UsageError).
  virtual void check_flags() {}
  /// Whether the recipe trains on a GPU with `--device cuda`.
  virtual bool trains_on_gpu() const { return false; }
  /// The recipe's part of config.json's settings.
  virtual void settings(Json& s) const = 0;
  /// Loads the training data on every rank, before anything trains, and
  /// checks every file the run will read; returns the number of examples.
  virtual int64_t load(const TrainToolFlags& flags) = 0;
  /// What ends the message of a data file that cannot be read
  /// (TrainErrorKind::kDataUnreadable): how to install the data, and the flag
  /// that names another directory.
  virtual std::string data_hint() const = 0;
  /// The run's first line: what it trains on ("simclr on 60000 examples of
  /// DIR") and its global batch ("256, gradient cache chunks of 64").
  virtual std::string what() const = 0;
  virtual std::string batch() const = 0;
  /// Trains collectively on every rank (run() complete).
  virtual train::RunResult train(const CommunicatorPtr& comm) = 0;
  /// The recipe's part of the summary, after the run's shared keys.
  virtual void summarize(Json& s) const = 0;
  /// What the evaluation is doing, for the live line ("trained encoder
  /// (1/3): embedding 12/70").
  using EvalProgress = std::function<void(const std::string& what)>;
  /// Rank 0 after the last collective: evaluates into `s` and writes the
  /// table, telling `progress` as it goes; returns the seconds it took.
  virtual double evaluate(const TrainToolFlags& flags, Json& s, std::ostream& table, const EvalProgress& progress) = 0;
  /// What the summary line says after the rate: "examples/s; ".
  virtual std::string rate_note() const = 0;
};

/// The recipes in the order `--recipe` lists them.
const std::vector<std::string>& train_recipe_names();

/// Whether `name` is one of train_recipe_names().
bool is_train_recipe(const std::string& name);

/// The recipe `name` (one of train_recipe_names()), with the defaults of
/// `variant` ("default" or "peer"; the image recipes only).
std::unique_ptr<TrainRecipe> make_train_recipe(const std::string& name, const std::string& variant);

}  // namespace contrax::cli
