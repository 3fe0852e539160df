// One line of progress on a terminal (see live_line.h).
#include "cli/live_line.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

namespace contrax::cli {

LiveLine::LiveLine(std::FILE* stream) : stream_(stream) {
  const char* term = std::getenv("TERM");
  const char* mode = std::getenv("CONTRAX_PROGRESS");
  const std::string m = mode != nullptr ? mode : "";
  on_ = m == "live" || (m != "plain" && ::isatty(::fileno(stream)) == 1 &&
                        !(term != nullptr && std::strcmp(term, "dumb") == 0));
}

int LiveLine::columns() const {
  winsize w{};
  if (::ioctl(::fileno(stream_), TIOCGWINSZ, &w) == 0 && w.ws_col > 0) return w.ws_col;
  const char* env = std::getenv("COLUMNS");
  const int n = env != nullptr ? std::atoi(env) : 0;
  return n > 0 ? n : 80;
}

void LiveLine::show(const std::string& text, bool now) {
  if (!on_) return;
  const auto t = std::chrono::steady_clock::now();
  if (!now && shown_ && t - last_ < std::chrono::milliseconds(100)) return;
  last_ = t;
  // One column short of the width: a full line would wrap on some terminals.
  const size_t width = static_cast<size_t>(std::max(20, columns() - 1));
  const std::string line = text.size() > width ? text.substr(0, width) : text;
  // The text, erase what a longer line left behind, back to the first column.
  // The carriage return comes last: a launcher forwarding its workers' output
  // piece by piece passes each redraw on when it sees it.
  std::fprintf(stream_, "%s\033[K\r", line.c_str());
  std::fflush(stream_);
  shown_ = true;
}

void LiveLine::clear() {
  if (!on_ || !shown_) return;
  std::fputs("\r\033[K", stream_);
  std::fflush(stream_);
  shown_ = false;
}

void LiveLine::keep() {
  if (!on_ || !shown_) return;
  std::fputs("\n", stream_);
  std::fflush(stream_);
  shown_ = false;
}

std::string progress_bar(double fraction, int width) {
  const double f = std::isfinite(fraction) ? std::clamp(fraction, 0.0, 1.0) : 0.0;
  const int full = static_cast<int>(std::lround(f * width));
  return "[" + std::string(static_cast<size_t>(full), '#') + std::string(static_cast<size_t>(width - full), '.') +
         "]";
}

}  // namespace contrax::cli
