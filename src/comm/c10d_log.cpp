// c10d's log lines muted where Contrax reports the failure (see comm/c10d_log.h).
#include "comm/c10d_log.h"

#include <c10/util/Logging.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

namespace contrax::detail {

namespace {

std::mutex g_mutex;
int g_depth = 0;  // QuietC10dLog objects alive
int g_saved = 0;  // the threshold before the outermost one

// c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL.
constexpr int kFatal = 3;

bool user_asked_for_logs() {
  return std::getenv("TORCH_CPP_LOG_LEVEL") != nullptr || std::getenv("TORCH_DISTRIBUTED_DEBUG") != nullptr;
}

}  // namespace

QuietC10dLog::QuietC10dLog() : active_(!user_asked_for_logs()) {
  if (!active_) return;
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (g_depth++ == 0) {
    g_saved = FLAGS_caffe2_log_level;
    FLAGS_caffe2_log_level = std::max(g_saved, kFatal);
  }
}

QuietC10dLog::~QuietC10dLog() {
  if (!active_) return;
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (--g_depth == 0) FLAGS_caffe2_log_level = g_saved;
}

}  // namespace contrax::detail
