// Host memory: CPU allocation counting by wrapping LibTorch's CPU allocator,
// and the memory this process may still allocate (see contrax/util/memory.h).
#include "contrax/util/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "util/cgroup.h"

namespace contrax {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};

// The live storages, by data pointer: the DataPtr each came with (which frees
// it through the original allocator) and its size. Keyed by the pointer so
// that every DataPtr handed out has its data as its context, as LibTorch's
// raw_allocate() requires (oneDNN's scratch buffers go through it). Never
// destroyed: storages may outlive static destruction.
struct Tracked {
  c10::DataPtr inner;
  int64_t bytes;
};
std::mutex& live_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::unordered_map<void*, Tracked>& live() {
  static auto* m = new std::unordered_map<void*, Tracked>();
  return *m;
}

void counted_delete(void* data) {
  c10::DataPtr inner;  // frees the storage after the lock is released
  {
    std::lock_guard<std::mutex> lock(live_mutex());
    auto it = live().find(data);
    if (it == live().end()) return;
    g_current.fetch_sub(it->second.bytes, std::memory_order_relaxed);
    inner = std::move(it->second.inner);
    live().erase(it);
  }
}

// Forwards to the allocator that was current at install time and attributes
// each storage's size to the counters until it is freed.
c10::DataPtr counted_allocate(c10::Allocator* inner, size_t n) {
  c10::DataPtr p = inner->allocate(n);
  void* data = p.get();
  if (data == nullptr) return p;  // zero bytes: nothing to count
  const c10::Device device = p.device();
  const int64_t bytes = static_cast<int64_t>(n);
  {
    std::lock_guard<std::mutex> lock(live_mutex());
    live().emplace(data, Tracked{std::move(p), bytes});
  }
  const int64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return {data, data, &counted_delete, device};
}

// Counts every CPU storage: forwards to the allocator that was current at
// install time. Storage copies (clone of a storage) are plain host memcpy.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override { return counted_allocate(inner_, n); }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
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

int64_t available_memory_bytes() {
  int64_t avail = 0;
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  int64_t kb = 0;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") {
      avail = kb * 1024;
      break;
    }
  }
  const auto m = detail::memory_limit();
  if (m.limit >= 0) {
    const int64_t left = std::max<int64_t>(m.limit - m.used, 0);
    avail = avail > 0 ? std::min(avail, left) : left;
  }
  return avail;
}

namespace {

// The free and total bytes of a CUDA device (cudaMemGetInfo), {0, 0} when
// unknown. The CUDA runtime's C entry points (cudaError_t is an int; 0 is
// success) are found among the libraries already loaded: LibTorch's CUDA
// build brings the runtime, a CPU-only one does not (then the answer is
// "unknown").
std::pair<int64_t, int64_t> cuda_memory_info(const c10::Device& device) {
  using GetDevice = int (*)(int*);
  using SetDevice = int (*)(int);
  using MemGetInfo = int (*)(size_t*, size_t*);
  auto get = reinterpret_cast<GetDevice>(::dlsym(RTLD_DEFAULT, "cudaGetDevice"));
  auto set = reinterpret_cast<SetDevice>(::dlsym(RTLD_DEFAULT, "cudaSetDevice"));
  auto info = reinterpret_cast<MemGetInfo>(::dlsym(RTLD_DEFAULT, "cudaMemGetInfo"));
  if (get == nullptr || set == nullptr || info == nullptr) return {0, 0};
  int current = 0;
  if (get(&current) != 0) return {0, 0};
  const int wanted = device.has_index() ? device.index() : current;
  if (wanted != current && set(wanted) != 0) return {0, 0};
  size_t free_bytes = 0, total_bytes = 0;
  const bool ok = info(&free_bytes, &total_bytes) == 0;
  if (wanted != current) set(current);
  if (!ok) return {0, 0};
  return {static_cast<int64_t>(free_bytes), static_cast<int64_t>(total_bytes)};
}

}  // namespace

int64_t available_device_memory_bytes(const c10::Device& device) {
  if (device.is_cpu()) return available_memory_bytes();
  if (!device.is_cuda()) return 0;
  return cuda_memory_info(device).first;
}

int64_t device_memory_bytes(const c10::Device& device) {
  if (!device.is_cuda()) return 0;
  return cuda_memory_info(device).second;
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : bytes < 10 ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

}  // namespace contrax
