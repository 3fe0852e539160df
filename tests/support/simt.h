// A SIMT emulator: the CUDA built-ins that the engine's panel kernels use
// (src/engine/kernels/cuda_*_panel.cuh), defined for a plain C++ compiler, so
// that their unmodified device code compiles on the CPU and runs there as it
// would on a GPU: a grid of blocks, each block's threads as cooperative
// fibers (simt.cpp) that meet at __syncthreads() and at the warp shuffles,
// `__shared__` storage per block. No third-party emulator exists in the
// registries this project uses, and a GPU is at hand only rarely: this is
// what lets the CPU tests find a fault in the kernels' shuffles, barriers or
// tails (tests/engine/simt_kernels_test.cpp, tests/engine/kernel_mutation_test.sh).
//
// What it models (docs/engine.md, "The SIMT emulator"):
//  * threadIdx, blockIdx, blockDim, gridDim; CUDA's launch limits (1,024
//    threads a block, grid y and z at most 65,535, no empty grid).
//  * __syncthreads(): a barrier of every thread of the block. A thread that
//    exits while others wait, or a barrier some thread never reaches, is a
//    fault raised at once (the scheduling is deterministic and cooperative,
//    so "never reaches" is exact: no fiber can run).
//  * __shfl_sync, __shfl_xor_sync, __shfl_down_sync, __shfl_up_sync with
//    PTX's lane arithmetic (segments of `width` lanes). Every lane of the
//    warp must take part, at the same call: a mask other than the full
//    warp's (which the kernels never use) is reported, not emulated.
//  * __syncwarp, atomicAdd / atomicMax / atomicCAS (trivially atomic: one OS
//    thread runs a block's fibers), __ldg, __threadfence, warpSize;
//    __launch_bounds__ ignored.
//  * Two schedules (set_schedule): the lowest-numbered runnable thread first
//    (warp 0 runs ahead of the others as far as the code lets it) or the
//    highest first; a missing barrier shows as a read of another warp's
//    shared memory before it is written, in one order or the other.
// What it does not model: memory-model races beyond that order, bank
// conflicts, timing, and `__shared__` contents between blocks (a block
// starts with what the previous block on that OS thread left, not with
// garbage). compute-sanitizer covers those on a GPU (tools/gpu_check.sh).
//
// Test support, LibTorch-free. Include it before the kernels' headers and
// never under nvcc.
#pragma once

#if defined(__CUDACC__)
#error "support/simt.h emulates CUDA on the CPU; nvcc compiles the real thing"
#endif

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

namespace contrax::simt {

/// CUDA's dim3 / uint3: unsigned components, 1 by default.
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

/// A fault of the code under emulation (a barrier or shuffle not reached by
/// every thread, a bad launch, a mask the emulator does not model): thrown by
/// launch() once the kernel's block is abandoned.
class Fault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Which runnable thread of a block runs next (see the file comment).
enum class Schedule { kLowestFirst, kHighestFirst };
void set_schedule(Schedule s);
Schedule schedule();

/// Kernel launches run by this process (every launch() counts one).
int64_t launches();

namespace detail {

enum class Shuffle { kIdx, kUp, kDown, kXor };

// The calling fiber's view of itself (set by the scheduler before each switch).
struct Self {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
};
extern thread_local const Self* current;
[[noreturn]] void outside_kernel(const char* what);
inline const Self& here(const char* what) {
  if (current == nullptr) outside_kernel(what);
  return *current;
}

void sync_block(const char* file, int line);
void sync_warp(unsigned mask, const char* file, int line);
uint64_t shuffle(Shuffle mode, unsigned mask, uint64_t bits, int b, int width, const char* file, int line);
void run_grid(dim3 grid, dim3 block, const std::function<void()>& body);

template <typename T>
T shuffle_value(Shuffle mode, unsigned mask, T v, int b, int width, const char* file, int line) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t),
                "the shuffles move 32- and 64-bit values");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = shuffle(mode, mask, bits, b, width, file, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace detail

/// Runs `kernel(args...)` over `grid` x `block` threads, block after block,
/// and returns when every thread has finished; throws Fault on a fault. The
/// arguments are copied once, as a launch copies them to the device.
template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) {
  std::tuple<std::decay_t<P>...> copies(std::forward<A>(args)...);
  detail::run_grid(grid, block, [&] { std::apply(kernel, copies); });
}

/// The launcher the kernels' launch sequences take (cuda_*_panel.cuh): the
/// emulator's counterpart of cuda_stream_launch.cuh. Returns 0 (CUDA's
/// success); faults are thrown.
struct Launch {
  template <typename... P, typename... A>
  int operator()(void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) const {
    launch(kernel, grid, block, std::forward<A>(args)...);
    return 0;
  }
};

}  // namespace contrax::simt

// ---- the CUDA names, at global scope as nvcc has them

using dim3 = contrax::simt::dim3;
using uint3 = contrax::simt::dim3;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One copy per OS thread; a block's fibers run on one OS thread, one block at
// a time, so each block sees its own (threads running launches at once, as
// thread-ranks do, each their own).
#define __shared__ static thread_local

#define threadIdx (::contrax::simt::detail::here("threadIdx").thread_idx)
#define blockIdx (::contrax::simt::detail::here("blockIdx").block_idx)
#define blockDim (::contrax::simt::detail::here("blockDim").block_dim)
#define gridDim (::contrax::simt::detail::here("gridDim").grid_dim)

constexpr int warpSize = 32;

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  contrax::simt::detail::sync_block(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  contrax::simt::detail::sync_warp(mask, file, line);
}
inline void __threadfence() {}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, const char* file = __builtin_FILE(),
              int line = __builtin_LINE()) {
  return contrax::simt::detail::shuffle_value(contrax::simt::detail::Shuffle::kIdx, mask, var, src_lane, width, file,
                                              line);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE()) {
  return contrax::simt::detail::shuffle_value(contrax::simt::detail::Shuffle::kUp, mask, var,
                                              static_cast<int>(delta), width, file, line);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, const char* file = __builtin_FILE(),
                   int line = __builtin_LINE()) {
  return contrax::simt::detail::shuffle_value(contrax::simt::detail::Shuffle::kDown, mask, var,
                                              static_cast<int>(delta), width, file, line);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize, const char* file = __builtin_FILE(),
                  int line = __builtin_LINE()) {
  return contrax::simt::detail::shuffle_value(contrax::simt::detail::Shuffle::kXor, mask, var, lane_mask, width,
                                              file, line);
}

// Atomics: a block's fibers never interleave inside one of these, and blocks
// run one at a time on an OS thread.
template <typename T>
T atomicAdd(T* address, T val) {
  const T old = *address;
  *address = old + val;
  return old;
}
template <typename T>
T atomicMax(T* address, T val) {
  const T old = *address;
  if (val > old) *address = val;
  return old;
}
template <typename T>
T atomicCAS(T* address, T compare, T val) {
  const T old = *address;
  if (old == compare) *address = val;
  return old;
}
template <typename T>
T __ldg(const T* p) {
  return *p;
}
