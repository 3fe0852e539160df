// The per-step metrics file (see metrics.h): JSON lines written with a checked
// write per step, and read back strictly; a resumed run keeps the lines up to
// its checkpoint.
#include "contrax/train/common/metrics.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <nlohmann/json.hpp>

#include "contrax/train/common/checkpoint.h"
#include "util/files.h"

namespace contrax::train {

namespace {

using Json = nlohmann::ordered_json;

void put_number(Json& j, const char* key, double v) {
  if (std::isfinite(v)) {
    j[key] = v;
  } else {
    j[key] = nullptr;
    j["nonfinite"].push_back(key);
  }
}

double get_number(const Json& j, const char* key) {
  const auto& v = j.at(key);
  return v.is_null() ? std::nan("") : v.get<double>();
}

}  // namespace

std::string metrics_json(const StepMetrics& m) {
  Json j;
  j["step"] = m.step;
  j["epoch"] = m.epoch;
  j["step_in_epoch"] = m.step_in_epoch;
  j["rows"] = m.rows;
  put_number(j, "loss", m.loss);
  put_number(j, "lr", m.lr);
  put_number(j, "examples_per_s", m.examples_per_s);
  put_number(j, "elapsed_s", m.elapsed_s);
  j["bytes_sent"] = m.bytes_sent;
  j["applied"] = m.applied;
  return j.dump();
}

std::vector<StepMetrics> read_metrics(const std::string& path) {
  std::vector<StepMetrics> out;
  // Read through no link at the file's name (util/files.h).
  const auto fd = contrax::detail::Directory::of_file(path, "read_metrics()")
                      .open(std::filesystem::path(path).filename().string(), O_RDONLY);
  if (!fd.valid()) return out;
  std::string text, line;
  char buf[65536];
  for (ssize_t n; (n = ::read(fd.get(), buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "read_metrics(): cannot read ", path, ": ", contrax::detail::errno_text(errno));
    text.append(buf, static_cast<size_t>(n));
  }
  std::istringstream in(text);
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    try {
      const Json j = Json::parse(line);
      StepMetrics m;
      m.step = j.at("step").get<int64_t>();
      m.epoch = j.at("epoch").get<int64_t>();
      m.step_in_epoch = j.at("step_in_epoch").get<int64_t>();
      m.rows = j.at("rows").get<int64_t>();
      m.loss = get_number(j, "loss");
      m.lr = get_number(j, "lr");
      m.examples_per_s = get_number(j, "examples_per_s");
      m.elapsed_s = get_number(j, "elapsed_s");
      m.bytes_sent = j.at("bytes_sent").get<int64_t>();
      m.applied = j.at("applied").get<bool>();
      out.push_back(m);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "read_metrics(): ", path, " line ", n, " is not a metrics record: ", e.what());
    }
  }
  return out;
}

MetricsWriter::MetricsWriter(const std::string& path, int64_t keep_through_step) : path_(path) {
  std::string kept;
  if (keep_through_step >= 0) {
    for (const auto& m : read_metrics(path)) {
      if (m.step <= keep_through_step) kept += metrics_json(m) + "\n";
    }
  }
  // Atomically, so that a crash here never leaves half of the kept lines.
  try {
    write_file_atomically(path, kept);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "cannot write ", path, ": ", e.what_without_backtrace());
  }
  fd_ = contrax::detail::Directory::of_file(path, "cannot write " + path)
            .open(std::filesystem::path(path).filename().string(), O_WRONLY | O_APPEND)
            .release();
  TORCH_CHECK(fd_ >= 0, "cannot write ", path, ": ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::write(const StepMetrics& m) {
  const std::string line = metrics_json(m) + "\n";
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  size_t done = 0;
  int err = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (err != 0 && before >= 0) {
    // No half line: a reader parses every line of the file strictly.
    if (::ftruncate(fd_, before) != 0) {
    }
  }
  TORCH_CHECK(err == 0, "cannot write ", path_, ": ", std::strerror(err), " (metrics of step ", m.step,
              " not recorded; the run stops rather than lose them silently)");
}

}  // namespace contrax::train
