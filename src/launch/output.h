// Forwarding a worker's output: complete lines of its stdout and stderr into
// the launcher's own, prefixed with the rank, one write per line (lines of
// different workers never interleave mid-line), copied unprefixed to the
// rank's log file, and the last stderr line kept as the failure's reason.
// Internal to the launcher (src/launch/), not installed.
#pragma once

#include <string>

#include "launch/worker.h"

namespace contrax::detail {

/// How output is forwarded (LaunchOptions' prefix_output and log_dir).
struct OutputOptions {
  bool prefix = true;
  std::string log_dir;  // for the message when a log cannot be written
};

/// Reads what `s` (one of `w`'s streams) has, forwards its complete lines;
/// at EOF forwards the rest and closes the stream.
void pump(Worker& w, Stream& s, const OutputOptions& o);

/// Reads only what is already in `s` (descendants that escaped the worker's
/// group and kept the pipe open must not hold the launcher) and forwards all
/// of it.
void drain(Worker& w, Stream& s, const OutputOptions& o);

}  // namespace contrax::detail
