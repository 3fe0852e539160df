// `contrax train --recipe retrieval`: the two-tower WordNet reverse-dictionary
// run (contrax/train/retrieval/trainer.h) inside `contrax train`'s run machinery.
// cmd_train.cpp parses the flags, prepares the run directory, starts the
// workers and opens the log; this part loads the corpus, trains, evaluates
// the three systems and writes results.json and the summary.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "contrax/communicator.h"
#include "contrax/train/retrieval/trainer.h"
#include "json_util.h"

namespace contrax::cli {

/// The settings of a retrieval run, resolved from the flags (a flag that was
/// not given keeps RetrievalOptions' default).
struct RetrievalRun {
  contrax::train::RetrievalOptions options;
  std::string wordnet_dir = contrax::train::kDefaultWordNetDir;
  int64_t train_limit = -1;  // first N training synsets
  int64_t eval_limit = -1;   // first N held-out synsets
  bool query_chargrams = true;
  std::string run_dir;
  bool json = false, no_eval = false, no_verify = false, no_plot = false;
};

/// The settings as config.json records them.
Json retrieval_settings_json(const RetrievalRun& run);

/// Console sinks of rank 0 (cmd_train.cpp's Console).
struct RetrievalIo {
  std::function<void(const std::string&)> out, result, err, log_only;
  /// Exit status of a run stopped by a signal or --stop-at-step.
  std::function<int()> interrupted_status;
};

/// Trains and evaluates; returns the process's exit status.
int run_retrieval(const RetrievalRun& run, const CommunicatorPtr& comm, const RetrievalIo& io,
                  std::chrono::steady_clock::time_point wall0);

}  // namespace contrax::cli
