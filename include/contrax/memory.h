// Counting CPU tensor memory: current and peak bytes held by tensor storages.
//
// LibTorch keeps no allocation statistics for CPU tensors, so benchmarks and
// the memory tests install a thin wrapper around the CPU allocator that counts
// every storage's bytes while it lives. Counters are process-wide.
#pragma once

#include <cstdint>

// The loss workspace's functions moved to contrax/workspace.h; included here
// for one release, for code that found them in this header.
#include "contrax/workspace.h"

namespace contrax {

class MemoryTracker {
 public:
  /// Wraps the CPU allocator (idempotent; allocations made before install are
  /// not counted, their frees neither).
  static void install();
  static bool installed();
  /// Bytes currently held by storages allocated since install.
  static int64_t current_bytes();
  /// Highest `current_bytes()` since install or the last reset_peak().
  static int64_t peak_bytes();
  /// Sets the peak to the current value.
  static void reset_peak();
};

/// RAII: measures the peak above the level at construction.
///
///   contrax::PeakScope scope;   // installs the tracker if needed
///   auto loss = ...; loss.backward();
///   int64_t extra = scope.peak_above_start();
class PeakScope {
 public:
  PeakScope();
  int64_t peak_above_start() const;

 private:
  int64_t start_;
};

}  // namespace contrax
