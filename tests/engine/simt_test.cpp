// The SIMT emulator itself (support/simt.h): the shuffles' lane arithmetic
// against CUDA's documented rules at every width, 32- and 64-bit values;
// indices over 3-D grids and blocks; __syncthreads ordering shared memory
// under both schedules, and a missing one showing; atomics; and every fault
// it promises to find (a barrier or shuffle some thread never reaches, a
// thread that exits early, lanes at different shuffles, a mask it does not
// model, launches past CUDA's limits) raised at once, not by hanging.
#include "support/simt.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

namespace {

using contrax::simt::Fault;
using contrax::simt::Schedule;

// ---- kernels (plain CUDA, run by the emulator)

// out[kind][t]: what thread t gets from each shuffle of value 100 + lane.
__global__ void shuffles(int* out, int width, int operand) {
  const int t = threadIdx.x, lane = t % warpSize, n = blockDim.x;
  out[0 * n + t] = __shfl_sync(0xffffffffu, 100 + lane, operand, width);
  out[1 * n + t] = __shfl_up_sync(0xffffffffu, 100 + lane, static_cast<unsigned>(operand), width);
  out[2 * n + t] = __shfl_down_sync(0xffffffffu, 100 + lane, static_cast<unsigned>(operand), width);
  out[3 * n + t] = __shfl_xor_sync(0xffffffffu, 100 + lane, operand, width);
}

__global__ void shuffle_double(double* out) {
  const double v = 1e300 * (threadIdx.x + 1) + 0.5;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 5);
}

__global__ void indices(int* out) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const int n = blockDim.x * blockDim.y * blockDim.z;
  out[block * n + thread] = block * 10000 + thread;
}

// Warp w writes its slot, then (after the barrier, when `sync`) every thread
// reads the next warp's.
__global__ void neighbours(int* out, bool sync) {
  __shared__ int slot[8];
  const int warp = threadIdx.x / warpSize;
  if (threadIdx.x % warpSize == 0) slot[warp] = 1000 * (blockIdx.x + 1) + warp;
  if (sync) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slot[(warp + 1) % 8];
}

__global__ void sum_atomically(double* total, int* count) {
  atomicAdd(total, 0.5);
  atomicAdd(count, 1);
  atomicMax(count + 1, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x));
}

__global__ void exits_before_barrier(int) {
  if (threadIdx.x == 70) return;
  __syncthreads();
}

__global__ void two_barriers(int) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void lane_exits_before_shuffle(int) {
  if (threadIdx.x % warpSize == 3) return;
  (void)__shfl_xor_sync(0xffffffffu, 1, 1);
}

__global__ void two_shuffles(int) {
  if (threadIdx.x % 2) {
    (void)__shfl_xor_sync(0xffffffffu, 1, 1);
  } else {
    (void)__shfl_xor_sync(0xffffffffu, 2, 1);
  }
}

__global__ void half_mask(int) { (void)__shfl_xor_sync(0x0000ffffu, 1, 1); }
__global__ void bad_width(int) { (void)__shfl_down_sync(0xffffffffu, 1, 1u, 12); }
__global__ void barrier_vs_shuffle(int) {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    (void)__shfl_xor_sync(0xffffffffu, 1, 1);
  }
}
__global__ void nothing(int) {}

// The expected source lane under CUDA's documented rules (CUDA C++
// Programming Guide, "Warp Shuffle Functions"), written from the text rather
// than from PTX's formula that the emulator uses.
int documented(int kind, int lane, int operand, int width) {
  const int base = lane / width * width;
  switch (kind) {
    case 0:  // __shfl_sync: lane srcLane % width of the caller's segment
      return base + operand % width;
    case 1:  // __shfl_up_sync: lane - delta, unless that leaves the segment
      return lane - base >= operand ? lane - operand : lane;
    case 2:  // __shfl_down_sync: lane + delta, unless that leaves the segment
      return lane - base + operand < width ? lane + operand : lane;
    default: {  // __shfl_xor_sync: lane ^ mask; a later segment gives the caller's own
      const int src = lane ^ operand;
      return src / width > lane / width ? lane : src;
    }
  }
}

// The message of the Fault that `fn` raises ("" when none), and that it
// comes within a second.
template <typename Fn>
std::string fault_of(Fn fn) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  try {
    fn();
  } catch (const Fault& e) {
    message = e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  return message;
}

TEST(Simt, ShufflesFollowCudasLaneRulesAtEveryWidth) {
  for (int width : {32, 16, 8, 4, 2, 1}) {
    for (int operand : {0, 1, 2, 3, 5, 8, 16, 31}) {
      std::vector<int> out(4 * 64, -1);
      contrax::simt::launch(shuffles, dim3(1), dim3(64), out.data(), width, operand);
      for (int kind = 0; kind < 4; ++kind) {
        for (int t = 0; t < 64; ++t) {
          ASSERT_EQ(out[kind * 64 + t], 100 + documented(kind, t % 32, operand, width))
              << "kind " << kind << ", width " << width << ", operand " << operand << ", thread " << t;
        }
      }
    }
  }
  std::vector<double> d(32);
  contrax::simt::launch(shuffle_double, dim3(1), dim3(32), d.data());
  for (int t = 0; t < 32; ++t) EXPECT_EQ(d[t], 1e300 * ((t ^ 5) + 1) + 0.5);
}

TEST(Simt, IndicesCoverThreeDimensionalGridsAndBlocks) {
  const dim3 grid(3, 2, 2), block(8, 4, 2);
  std::vector<int> out(12 * 64, -1);
  contrax::simt::launch(indices, grid, block, out.data());
  for (int b = 0; b < 12; ++b) {
    for (int t = 0; t < 64; ++t) EXPECT_EQ(out[b * 64 + t], b * 10000 + t);
  }
  EXPECT_THROW((void)threadIdx.x, Fault);  // outside a kernel
}

TEST(Simt, BarriersOrderSharedMemoryAndAMissingOneShows) {
  for (auto s : {Schedule::kLowestFirst, Schedule::kHighestFirst}) {
    contrax::simt::set_schedule(s);
    std::vector<int> out(3 * 256);
    contrax::simt::launch(neighbours, dim3(3), dim3(256), out.data(), true);
    for (int t = 0; t < 3 * 256; ++t) EXPECT_EQ(out[t], 1000 * (t / 256 + 1) + (t % 256 / 32 + 1) % 8);
  }
  // Without the barrier: the lowest-first schedule runs warp 0 to its end
  // before warp 1 writes, so warp 0 reads the previous block's value; the
  // highest-first one lets warp 7 read warp 0's slot too early.
  for (auto s : {Schedule::kLowestFirst, Schedule::kHighestFirst}) {
    contrax::simt::set_schedule(s);
    std::vector<int> out(3 * 256);
    contrax::simt::launch(neighbours, dim3(3), dim3(256), out.data(), false);
    const int t = s == Schedule::kLowestFirst ? 256 : 256 + 7 * 32;  // block 1: warp 0, or warp 7
    EXPECT_NE(out[t], 1000 * 2 + (t % 256 / 32 + 1) % 8) << "schedule " << static_cast<int>(s);
  }
  contrax::simt::set_schedule(Schedule::kLowestFirst);
}

TEST(Simt, AtomicsAndLaunchCount) {
  double total = 0;
  int count[2] = {0, -1};
  const int64_t before = contrax::simt::launches();
  contrax::simt::launch(sum_atomically, dim3(5), dim3(96), &total, count);
  EXPECT_EQ(total, 0.5 * 480);
  EXPECT_EQ(count[0], 480);
  EXPECT_EQ(count[1], 479);
  EXPECT_EQ(contrax::simt::launches() - before, 1);
}

TEST(Simt, BarriersAndShufflesNotEveryThreadReachesFailAtOnce) {
  auto m = fault_of([] { contrax::simt::launch(exits_before_barrier, dim3(2), dim3(128), 0); });
  EXPECT_NE(m.find("thread 70 (warp 2, lane 6) of block (0, 0, 0) exited while"), std::string::npos) << m;
  EXPECT_NE(m.find("__syncthreads() at simt_test.cpp:"), std::string::npos) << m;
  m = fault_of([] { contrax::simt::launch(two_barriers, dim3(1), dim3(64), 0); });
  EXPECT_NE(m.find("while others wait at the one at simt_test.cpp:"), std::string::npos) << m;
  m = fault_of([] { contrax::simt::launch(lane_exits_before_shuffle, dim3(1), dim3(32), 0); });
  EXPECT_NE(m.find("thread 3 (warp 0, lane 3) of block (0, 0, 0) exited while 3 lanes of its warp wait at a shuffle"),
            std::string::npos)
      << m;
  m = fault_of([] { contrax::simt::launch(two_shuffles, dim3(1), dim3(32), 0); });
  EXPECT_NE(m.find("every lane must take part in the same collective"), std::string::npos) << m;
  m = fault_of([] { contrax::simt::launch(barrier_vs_shuffle, dim3(1), dim3(32), 0); });
  EXPECT_NE(m.find("the block can go no further"), std::string::npos) << m;
  m = fault_of([] { contrax::simt::launch(half_mask, dim3(1), dim3(32), 0); });
  EXPECT_NE(m.find("with mask 0xffff: only the full warp's mask (0xffffffff) is modelled"), std::string::npos) << m;
  m = fault_of([] { contrax::simt::launch(bad_width, dim3(1), dim3(32), 0); });
  EXPECT_NE(m.find("with width 12"), std::string::npos) << m;
  // The emulator is whole again after a fault.
  std::vector<int> out(4 * 64);
  contrax::simt::launch(shuffles, dim3(1), dim3(64), out.data(), 32, 1);
  EXPECT_EQ(out[3 * 64 + 2], 103);
}

TEST(Simt, LaunchesPastCudasLimitsAreFaults) {
  EXPECT_NE(fault_of([] { contrax::simt::launch(nothing, dim3(1, 65536), dim3(32), 0); }).find("grid (1, 65536, 1)"),
            std::string::npos);
  EXPECT_NE(fault_of([] { contrax::simt::launch(nothing, dim3(0), dim3(32), 0); }).find("grid (0, 1, 1)"),
            std::string::npos);
  EXPECT_NE(fault_of([] { contrax::simt::launch(nothing, dim3(1), dim3(1025), 0); }).find("block (1025, 1, 1)"),
            std::string::npos);
  EXPECT_EQ(fault_of([] { contrax::simt::launch(nothing, dim3(1, 65535), dim3(1), 0); }), "");
}

}  // namespace
