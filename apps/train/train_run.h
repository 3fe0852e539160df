// One rank's run of `contrax train`, once the command has read its flags and
// decided fresh or resume (cmd_train.cpp), in three steps:
//
//   launch  join the peers, start this rank's intra-op threads and the
//           console; on rank 0 train.log and config.json;
//   train   load the data, the loop's options from the settings, the
//           recipe's loop; its errors in the tool's words;
//   report  an interrupted run's stop message; else the exactness check,
//           then on rank 0 the evaluation, results.json, the summary and
//           the curves.
//
//   TrainRun run(recipe, settings, resumed, [&] { return divergence_cause(); });
//   run.launch(config_settings, command);
//   return run.report(run.train());
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli/json_util.h"
#include "contrax/comm/communicator.h"
#include "contrax/train/common/errors.h"
#include "contrax/train/common/loop.h"
#include "train/train_console.h"
#include "train/train_recipe.h"
#include "train/train_settings.h"
#include "train/train_threads.h"

namespace contrax::cli {

class TrainRun {
 public:
  /// `divergence_cause`: what ends the message of a diverged run, the flags
  /// set that likely caused it ("" when none).
  TrainRun(TrainRecipe& recipe, TrainSettings& settings, bool resumed, std::function<std::string()> divergence_cause);
  /// Joins the peers and starts this rank; rank 0 writes config.json with
  /// `settings` (the run's, TrainCommand::settings) and `command` (as given).
  void launch(const Json& settings, const std::vector<std::string>& command);
  /// Trains collectively; a library error is rethrown in the tool's words.
  train::RunResult train();
  /// Reports `r`; returns the exit status.
  int report(const train::RunResult& r);

 private:
  void prepare_loop();
  void announce() const;
  Json verify() const;
  int stopped(const train::RunResult& r) const;
  std::string summary(const train::RunResult& r, const Json& verify_j, double eval_s, double wall) const;
  std::string message(const train::TrainError& e) const;

  TrainRecipe& recipe_;
  TrainSettings& s_;
  const bool resumed_;
  const std::function<std::string()> divergence_cause_;
  std::chrono::steady_clock::time_point wall0_;
  CommunicatorPtr comm_;
  std::unique_ptr<TrainConsole> console_;
  std::unique_ptr<IntraOpThreads> threads_guard_;  // this rank's intra-op threads, started
};

}  // namespace contrax::cli
