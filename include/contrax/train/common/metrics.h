// The per-step metrics of a training run: one JSON object per line in
// RUN_DIR/metrics.jsonl, written by rank 0 with nlohmann-json, so that any
// strict JSON parser reads every line. Steps and epochs count from 1, as on
// the console. A non-finite number is written as null and its key listed in
// "nonfinite". Every write is checked: a full disk stops the run with an error
// naming the file and the cause instead of silently dropping lines.
//
//   {"step":1,"epoch":1,"step_in_epoch":1,"rows":256,"loss":5.81,"lr":0.0001,
//    "examples_per_s":1812.5,"elapsed_s":0.14,"bytes_sent":2359296,"applied":true}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/macros/Macros.h>

namespace contrax::train {

/// One training step as logged.
struct StepMetrics {
  int64_t step = 0;           ///< global step, from 1
  int64_t epoch = 0;          ///< epoch, from 1
  int64_t step_in_epoch = 0;  ///< step within the epoch, from 1
  int64_t rows = 0;           ///< global rows of the step (the last batch of an epoch may have fewer)
  double loss = 0;            ///< global mean loss of the step (NaN/inf written as null)
  double lr = 0;              ///< learning rate of the step
  double examples_per_s = 0;  ///< throughput since the run (re)started
  double elapsed_s = 0;       ///< seconds since the run (re)started
  int64_t bytes_sent = 0;     ///< bytes rank 0 sent in the step's collectives
  bool applied = true;        ///< false: the step was skipped for a non-finite loss or gradient
};

/// One metrics line (no newline).
std::string metrics_json(const StepMetrics& m);

/// Reads metrics.jsonl strictly; throws naming the file and line on any line
/// that is not a JSON object with the fields above. A missing file is empty.
std::vector<StepMetrics> read_metrics(const std::string& path);

/// Appends metrics lines to a file, checking every write.
class MetricsWriter {
 public:
  /// Opens `path`. keep_through_step < 0: starts an empty file. Otherwise
  /// (resume) keeps the lines of steps <= keep_through_step and drops the
  /// rest: the resumed run writes the steps after its checkpoint again.
  MetricsWriter(const std::string& path, int64_t keep_through_step);
  ~MetricsWriter();
  C10_DISABLE_COPY_AND_ASSIGN(MetricsWriter);
  /// Writes and flushes one line; throws "cannot write PATH: CAUSE" on failure.
  void write(const StepMetrics& m);

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace contrax::train
