// CPU allocation counting by wrapping LibTorch's CPU allocator.
#include "contrax/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace contrax {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};

struct Tracked {
  c10::DataPtr inner;
  int64_t bytes;
};

void tracked_delete(void* ctx) {
  auto* t = static_cast<Tracked*>(ctx);
  g_current.fetch_sub(t->bytes, std::memory_order_relaxed);
  delete t;  // frees the inner DataPtr through the original allocator
}

// Forwards to the allocator that was current at install time and attributes
// each storage's size to the counters until its DataPtr is destroyed.
c10::DataPtr counted_allocate(c10::Allocator* inner, size_t n) {
  c10::DataPtr p = inner->allocate(n);
  void* data = p.get();
  c10::Device device = p.device();
  auto* t = new Tracked{std::move(p), static_cast<int64_t>(n)};
  const int64_t now = g_current.fetch_add(t->bytes, std::memory_order_relaxed) + t->bytes;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return {data, t, &tracked_delete, device};
}

// Counts every CPU storage: forwards to the allocator that was current at
// install time. Storage copies (clone of a storage) are plain host memcpy.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override { return counted_allocate(inner_, n); }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
};

}  // namespace

void MemoryTracker::install() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator allocator(c10::GetCPUAllocator());
    // Priority above the default so later default registrations do not win.
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
    g_installed = true;
  });
}

bool MemoryTracker::installed() { return g_installed.load(); }
int64_t MemoryTracker::current_bytes() { return g_current.load(); }
int64_t MemoryTracker::peak_bytes() { return g_peak.load(); }
void MemoryTracker::reset_peak() { g_peak.store(g_current.load()); }

PeakScope::PeakScope() {
  MemoryTracker::install();
  MemoryTracker::reset_peak();
  start_ = MemoryTracker::current_bytes();
}

int64_t PeakScope::peak_above_start() const { return MemoryTracker::peak_bytes() - start_; }

}  // namespace contrax
