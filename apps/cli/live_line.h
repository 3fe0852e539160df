// One line of progress on a terminal, redrawn in place. `contrax train`
// shows the training (a bar with step, epoch, loss, examples/s and ETA) and
// then the evaluation (which part, how far) on it; output that is not a
// terminal (a log, a pipe, CI) gets the periodic plain lines instead, and
// RUN_DIR/train.log keeps every line either way. CONTRAX_PROGRESS=plain
// asks for plain lines on a terminal too; CONTRAX_PROGRESS=live is how
// `contrax train` tells the workers it launches (whose output reaches the
// terminal through its pipes) that the terminal is one, with COLUMNS its width.
//
//   LiveLine live(stdout);
//   if (live.on()) live.show(progress_bar(0.4, 24) + " step 120/300 ...");
//   live.clear();  // before printing anything else
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace contrax::cli {

class LiveLine {
 public:
  /// Live when CONTRAX_PROGRESS is "live", or when `stream` is a terminal,
  /// TERM is not "dumb" and CONTRAX_PROGRESS is not "plain".
  explicit LiveLine(std::FILE* stream);
  bool on() const { return on_; }
  /// The terminal's width; else COLUMNS (a launcher's worker writes into a
  /// pipe); else 80.
  int columns() const;
  /// Redraws the line with `text` (cut to the terminal's width), at most ten
  /// times a second unless `now`.
  void show(const std::string& text, bool now = false);
  /// Erases the line, so that other output starts on a clean line.
  void clear();
  /// Leaves the line as it is shown (ends it with a newline): a phase's
  /// last state stays on the screen.
  void keep();

 private:
  std::FILE* stream_;
  bool on_ = false;
  bool shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

/// "[#########.........]" for `fraction` in [0, 1], `width` cells inside.
std::string progress_bar(double fraction, int width);

}  // namespace contrax::cli
