// Rank 0's console in `contrax train`: progress, the table and the summary on
// the terminal (stdout, or stderr for progress under --json), each copied to
// RUN_DIR/train.log. A failed write to the log stops the run with the cause
// (a full disk must not go unnoticed).
//
//   TrainConsole console(/*to_stderr=*/json);
//   console.open_log(dir, resumed);
//   console.out("contrax train: simclr on ...\n");
//   console.progress_line(line);  // the log only while the live line shows
#pragma once

#include <cstdio>
#include <ostream>
#include <string>

#include <c10/macros/Macros.h>

#include "contrax/train/common/loop.h"
#include "contrax/train/common/run_dir.h"
#include "cli/live_line.h"

namespace contrax::cli {

/// The live line of a training step: a bar, then where the run stands
/// ("train [#####   ]  42%  step 5/12  epoch 1/1  loss 4.1234  900 img/s  ETA 3s").
std::string train_step_line(const train::StepProgress& p);

class TrainConsole {
 public:
  explicit TrainConsole(bool to_stderr) : to_stderr_(to_stderr), live_(to_stderr ? stderr : stdout) {}
  ~TrainConsole();
  C10_DISABLE_COPY_AND_ASSIGN(TrainConsole);
  /// Copies what follows to the run directory's train.log, appended to (a
  /// resumed run) or replacing it; no link is followed (RunDir::open_append).
  void open_log(const train::RunDir& dir, bool append);
  /// Progress and headers: stdout, or stderr under --json.
  void out(const std::string& s);
  /// The final summary and the table: always stdout.
  void result(const std::string& s);
  void err(const std::string& s);
  /// The loop's periodic progress lines: the console gets them unless it
  /// shows the live line (a terminal); the log always.
  void progress_line(const std::string& s);
  /// The live line (a terminal only; see live_line.h).
  LiveLine& live() { return live_; }
  /// Only to the log (main() prints errors to the console itself).
  void log_only(const std::string& s);

 private:
  void emit(std::ostream& os, const std::string& s);
  bool to_stderr_;
  LiveLine live_;
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace contrax::cli
