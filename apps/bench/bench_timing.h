// How the bench commands time their contenders: each runs in turn, iteration
// by iteration, so that a burst of load on a shared machine hits all of them
// alike (timing all of one and then all of the other let a ratio swing by
// +-15% between identical runs under a load average of ~8).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "contrax/util/memory.h"

namespace contrax::cli {

/// "12.3 MiB": a byte count (a Timed's peak) as the benchmarks print it.
inline std::string mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

/// The upper median of `v` (not empty).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// One run, or a contender's summary: wall and process CPU seconds (on a shared
/// machine wall time measures the neighbours; with --threads 1 CPU time is the
/// run's own cost), and the peak bytes above the level before the run
/// (contrax's CPU allocator tracker; it does not see GPU memory).
struct Timed {
  double seconds = 0;
  double cpu = 0;
  int64_t peak = 0;
};

/// Times `fn`, from when `device`'s pending work has finished until its own has.
inline Timed timed(const std::function<void()>& fn, const torch::Device& device = torch::kCPU) {
  auto cpu_seconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
  PeakScope scope;
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = cpu_seconds();
  fn();
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), cpu_seconds() - c0,
          scope.peak_above_start()};
}

/// Runs `run(i)` for each of `n` contenders, `iters` times in alternation;
/// per contender the median seconds and CPU seconds and the highest peak.
inline std::vector<Timed> alternate(size_t n, int64_t iters, const std::function<Timed(size_t)>& run) {
  std::vector<std::vector<double>> wall(n), cpu(n);
  std::vector<Timed> out(n);
  for (int64_t it = 0; it < iters; ++it) {
    for (size_t i = 0; i < n; ++i) {
      const Timed t = run(i);
      wall[i].push_back(t.seconds);
      cpu[i].push_back(t.cpu);
      out[i].peak = std::max(out[i].peak, t.peak);
    }
  }
  for (size_t i = 0; i < n; ++i) out[i] = {median(wall[i]), median(cpu[i]), out[i].peak};
  return out;
}

}  // namespace contrax::cli
