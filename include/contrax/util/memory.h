// Host memory: counting CPU tensor memory (current and peak bytes held by
// tensor storages, for benchmarks and the memory tests), and how much more
// this process may allocate.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace contrax {

/// Process-wide counters of the bytes held by CPU tensor storages, kept by a
/// wrapper around LibTorch's CPU allocator (LibTorch keeps no such statistics).
class MemoryTracker {
 public:
  /// Wraps the CPU allocator (idempotent; allocations made before install are
  /// not counted, their frees neither).
  static void install();
  /// Whether install() has run.
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
  /// The highest `MemoryTracker::current_bytes()` since construction, less the
  /// level at construction (the constructor resets the process-wide peak).
  int64_t peak_above_start() const;

 private:
  int64_t start_;
};

/// Bytes this process may still allocate on the host: /proc/meminfo's
/// MemAvailable, capped by the tightest memory limit of its cgroup and their
/// ancestors (cgroup v2 memory.max - memory.current, v1 memory.limit_in_bytes
/// - memory.usage_in_bytes) where one is set; 0 when neither can be read.
int64_t available_memory_bytes();

/// Bytes still free where `device` allocates: available_memory_bytes() for
/// the CPU; for a CUDA device, the driver's free memory on that GPU
/// (cudaMemGetInfo, looked up in the CUDA runtime LibTorch has loaded, so
/// that Contrax needs no CUDA headers); 0 when unknown (no GPU, a CPU-only
/// LibTorch, another device type).
int64_t available_device_memory_bytes(const c10::Device& device);

/// Total bytes of a CUDA device (cudaMemGetInfo's total, looked up as above);
/// 0 for any other device or when unknown.
int64_t device_memory_bytes(const c10::Device& device);

/// `bytes` for a person: "512 B", "3.2 MiB", "7.5 GiB", "175 TiB".
std::string format_bytes(double bytes);

}  // namespace contrax
