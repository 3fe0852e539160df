// Rank 0's console and train.log (see train_console.h).
#include "train/train_console.h"

#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace contrax::cli {

std::string train_step_line(const train::StepProgress& p) {
  const double f = p.total_steps > 0 ? static_cast<double>(p.step) / static_cast<double>(p.total_steps) : 0.0;
  std::ostringstream o;
  o << "train " << progress_bar(f, 24) << " " << std::setw(3) << static_cast<int>(f * 100) << "%  step " << p.step
    << "/" << p.total_steps << "  epoch " << p.epoch << "/" << p.epochs << "  loss " << std::fixed
    << std::setprecision(4) << train::plain_nan(p.loss) << "  " << std::setprecision(0) << p.examples_per_s << " "
    << p.rate_unit << "/s  ETA " << train::format_duration(p.eta_s);
  return o.str();
}

TrainConsole::~TrainConsole() {
  if (file_ != nullptr) std::fclose(file_);
}

void TrainConsole::open_log(const train::RunDir& dir, bool append) {
  path_ = dir.file(train::RunDir::kLog);
  const int fd = dir.open_append(train::RunDir::kLog, /*truncate=*/!append);
  file_ = ::fdopen(fd, "a");
  if (file_ == nullptr) ::close(fd);
  TORCH_CHECK(file_ != nullptr, "cannot write ", path_, ": ", std::strerror(errno));
}

void TrainConsole::out(const std::string& s) { emit(to_stderr_ ? std::cerr : std::cout, s); }

void TrainConsole::result(const std::string& s) { emit(std::cout, s); }

void TrainConsole::err(const std::string& s) { emit(std::cerr, s); }

void TrainConsole::progress_line(const std::string& s) {
  if (live_.on()) {
    log_only(s);
  } else {
    out(s);
  }
}

void TrainConsole::log_only(const std::string& s) {
  if (file_ != nullptr) {
    std::fputs(s.c_str(), file_);
    std::fflush(file_);
  }
}

void TrainConsole::emit(std::ostream& os, const std::string& s) {
  live_.clear();
  os << s << std::flush;
  if (file_ == nullptr) return;
  errno = 0;
  const bool ok = std::fwrite(s.data(), 1, s.size(), file_) == s.size() && std::fflush(file_) == 0;
  TORCH_CHECK(ok, "cannot write ", path_, ": ", errno != 0 ? std::strerror(errno) : "write failed");
}

}  // namespace contrax::cli
