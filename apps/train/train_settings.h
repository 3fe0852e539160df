// The settings of a `contrax train` run that every recipe shares, in one
// ordered table (train_settings.cpp). Each row names a flag, the key
// config.json records it under, where its value lives (the tool's own
// TrainSettings, the TrainToolFlags a recipe reads, or the recipe's
// RunOptions, whose values are the flags' defaults), its help and checks,
// and, for a flag that can make a run diverge, the hint that says so. The
// one table drives
//
//   * the flags (add_train_flags), in its order: `contrax train --help`;
//   * config.json's "settings" (write_train_settings), in the same order,
//     before the recipe's own keys (TrainRecipe::settings);
//   * the divergence hints (divergence_hints): the flags set that likely
//     made a run diverge.
//
// A recipe's own flags (--temperature, --chunk-size ...) are the recipe's
// (TrainRecipe::add_flags).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "cli/json_util.h"
#include "contrax/train/common/loop.h"
#include "train/train_recipe.h"

namespace contrax::cli {

/// The tool's own settings of a run; the others are the recipe's RunOptions.
struct TrainSettings {
  std::string recipe;  // --recipe: the recipe's name
  int64_t nproc = 2, threads = 0, seed = 0, timeout_s = 300, max_restarts = 0;
  std::string run_dir, resume = "never", dtype = "float", device = "cpu";
  bool overwrite = false, json = false, no_verify = false, no_plot = false, force = false, trust_legacy = false;
  TrainToolFlags tool;  // the ones the recipe reads

  /// Intra-op threads of each of `world` processes: --threads, else this
  /// machine's cores shared out (at least 1).
  int64_t threads_per_process(int64_t world) const;
};

/// Where a setting's value lives: a field of TrainSettings or of its
/// TrainToolFlags, or an option of the recipe's RunOptions. Made implicitly
/// from the member's address, so that a row reads `&TrainSettings::nproc` or
/// `&train::RunOptions::epochs`.
template <typename T>
class Place {
 public:
  Place(T TrainSettings::*own) : own_(own) {}
  Place(T TrainToolFlags::*tool) : tool_(tool) {}
  Place(T& (train::RunOptions::*run)()) : run_(run) {}
  T& in(TrainSettings& s, train::RunOptions& run) const {
    if (own_ != nullptr) return s.*own_;
    if (tool_ != nullptr) return s.tool.*tool_;
    return (run.*run_)();
  }

 private:
  T TrainSettings::*own_ = nullptr;
  T TrainToolFlags::*tool_ = nullptr;
  T& (train::RunOptions::*run_)() = nullptr;
};

/// One row of the table (train_settings.cpp makes them: integer(), number(),
/// choice(), text(), toggle(), refined by the setters below).
struct TrainSetting {
  using Where = std::variant<Place<int64_t>, Place<double>, Place<std::string>, Place<bool>>;
  /// "" when the recipe's default applies; else the cause, as the divergence
  /// message names it ("--lr 1e+30 (the recipe's is 0.002)").
  using Hint = std::string (*)(double value, double recipe);
  /// What a row does to its flag beyond the common checks.
  using Finish = void (*)(CLI::Option& option, const TrainSettings& s);

  TrainSetting(std::string flag_, std::string key_, Where where_, std::string help_)
      : flag(std::move(flag_)), key(std::move(key_)), where(std::move(where_)), help(std::move(help_)) {}

  std::string flag;  // "--epochs"
  std::string key;   // config.json's "epochs"; "" for a switch of the tool that it does not record
  Where where;
  std::string help;
  int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();  // integer()
  double number_lo = -std::numeric_limits<double>::max(), number_hi = std::numeric_limits<double>::max();
  bool lo_open = false;                // number(): the value must be > number_lo
  std::vector<std::string> choices;    // choice(): the values allowed
  bool recorded_negated = false;       // a --no-X switch that config.json records as X
  Hint hint = nullptr;
  Finish finish = nullptr;

  /// A --no-X switch, recorded in config.json as X: the opposite value.
  TrainSetting& negated() {
    recorded_negated = true;
    return *this;
  }
  TrainSetting& hints(Hint h) {
    hint = h;
    return *this;
  }
  TrainSetting& then(Finish f) {
    finish = f;
    return *this;
  }
};

/// The shared settings of `contrax train`, in the order of its --help and of
/// config.json's keys.
std::vector<TrainSetting> train_settings();

/// Adds the table's flags to `app`, bound to `s` and `run` (the recipe's run
/// options: their values are the flags' defaults).
void add_train_flags(CLI::App& app, TrainSettings& s, train::RunOptions& run);

/// Each recorded setting's key and value into `j`, in the table's order.
void write_train_settings(Json& j, TrainSettings& s, train::RunOptions& run);

/// The causes the table's hints find among the flags `given` (by name), in
/// its order: each compares the value now (`s`, `run`) with the recipe's
/// (`recipe_s`, `recipe_run`: the values before the command line applied).
std::vector<std::string> divergence_hints(const std::function<bool(const std::string& flag)>& given,
                                          TrainSettings& s, train::RunOptions& run, TrainSettings& recipe_s,
                                          train::RunOptions& recipe_run);

}  // namespace contrax::cli
