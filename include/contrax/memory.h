// Counting CPU tensor memory: current and peak bytes held by tensor storages.
//
// LibTorch keeps no allocation statistics for CPU tensors, so benchmarks and
// the memory tests install a thin wrapper around the CPU allocator that counts
// every storage's bytes while it lives. Counters are process-wide.
#pragma once

#include <cstdint>

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

// ---- the loss workspace
//
// A materialised loss holds one logits buffer per rank ([b x B] for CLIP,
// [2b x 2B] for NT-Xent). On the CPU, a buffer of 32 MiB or more is kept by
// the calling thread after the loss that used it is gone, and the next loss
// whose buffer fits reuses it: glibc would otherwise map a fresh one and fault
// in every page on every call (about 180 ms for 512 MiB on the benchmark
// machine). Training calls the loss every step with the same shapes, so this
// is paid once. The price is that the buffer stays resident between calls;
// release it when the losses are done, or turn keeping off
// (CONTRAX_KEEP_WORKSPACE=0 in the environment does the same). CUDA tensors
// are not affected (PyTorch's caching allocator already reuses them).

/// Keep the workspace between calls (default: on, unless CONTRAX_KEEP_WORKSPACE=0).
/// Turning it off also releases this thread's buffer.
void set_keep_loss_workspace(bool keep);
bool keep_loss_workspace();
/// Bytes of the buffer this thread keeps (0: none).
int64_t loss_workspace_bytes();
/// Frees this thread's kept buffer (a loss still using it keeps it alive until
/// its backward is done).
void release_loss_workspace();

}  // namespace contrax
