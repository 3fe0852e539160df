// The SIMT emulator's scheduler (see simt.h): a block's threads are fibers
// on stacks of their own, switched cooperatively on the calling OS thread
// (a few instructions on x86-64, ucontext elsewhere), so a block of 256
// threads meeting at hundreds of shuffles costs milliseconds, and the order
// in which they run is a choice of ours: deterministic, and chosen to make
// races show (Schedule). A thread runs until it waits at a barrier or a
// shuffle, or finishes; the next to run is the lowest- (or highest-)
// numbered runnable thread. A barrier or shuffle that cannot complete (a
// thread of its block or warp has exited, or waits elsewhere) is found the
// moment it is known, and faults the launch instead of hanging.
#include "support/simt.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// A fiber's first and only frame (defined below, called from the trampoline).
extern "C" void contrax_simt_fiber_main(void* fiber);

namespace contrax::simt {

namespace {

std::atomic<Schedule> schedule_setting{Schedule::kLowestFirst};
std::atomic<int64_t> launch_count{0};

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kStackBytes = size_t{64} << 10;  // the kernels keep a few hundred bytes of registers each

// ---- context switching

#if defined(__x86_64__)
// switch_to(&save, to): pushes the callee-saved registers, stores the stack
// pointer in *save and resumes the context whose stack pointer is `to`. A new
// fiber's stack holds zeros for those registers, its Fiber* in rbx's slot and
// the trampoline as the return address; the trampoline passes rbx on.
extern "C" void contrax_simt_switch(void** save, void* to);
extern "C" void contrax_simt_trampoline();
asm(R"(
  .text
  .p2align 4
  .globl contrax_simt_switch
  .hidden contrax_simt_switch
  .type contrax_simt_switch, @function
contrax_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size contrax_simt_switch, .-contrax_simt_switch

  .p2align 4
  .globl contrax_simt_trampoline
  .hidden contrax_simt_trampoline
  .type contrax_simt_trampoline, @function
contrax_simt_trampoline:
  movq %rbx, %rdi
  call contrax_simt_fiber_main@PLT
  ud2
  .size contrax_simt_trampoline, .-contrax_simt_trampoline
)");
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

// ---- a block's state

enum class State { kRunnable, kAtBarrier, kAtWarp, kDone };

struct Fiber {
  Context ctx;
  detail::Self self;
  int id = 0;  // linear thread index in the block
  State state = State::kRunnable;
  const char* file = "";  // where it waits
  int line = 0;
};

// A warp's collective in progress: its kind and call site as the first lane
// arrived with them, the lanes' values and operands, and the results.
struct WarpSync {
  int arrived = 0;
  bool shuffle = false;
  detail::Shuffle mode = detail::Shuffle::kIdx;
  int width = kWarp;
  const char* file = "";
  int line = 0;
  uint64_t value[kWarp] = {}, result[kWarp] = {};
  int operand[kWarp] = {};
};

struct Block {
  std::vector<Fiber> fibers;
  uint64_t runnable[kMaxThreads / 64] = {};  // bit i: fiber i is kRunnable
  std::vector<int> warp_exited;              // finished lanes per warp
  std::vector<WarpSync> warps;
  int threads = 0, finished = 0;
  int barrier_arrived = 0;
  const char* barrier_file = "";
  int barrier_line = 0;
  int exited = -1;  // the first thread that finished
  Context scheduler;
  const std::function<void()>* body = nullptr;
  std::string fault;  // set: the block is abandoned
  Fiber* running = nullptr;
};

// Fiber stacks, kept per OS thread between launches (guard page below each).
struct Stacks {
  std::vector<char*> base;
  ~Stacks() {
    for (char* b : base) munmap(b, kStackBytes);
  }
  char* top(int i) {
    while (static_cast<int>(base.size()) <= i) {
      void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw Fault("simt: cannot map a fiber stack");
      mprotect(p, static_cast<size_t>(sysconf(_SC_PAGESIZE)), PROT_NONE);
      base.push_back(static_cast<char*>(p));
    }
    return base[static_cast<size_t>(i)] + kStackBytes;
  }
};

thread_local Block* block_here = nullptr;
thread_local Stacks stacks;

std::string where(const char* file, int line) {
  std::string f = file;
  const auto slash = f.rfind('/');
  return (slash == std::string::npos ? f : f.substr(slash + 1)) + ":" + std::to_string(line);
}

std::string thread_name(const Block& b, int id) {
  const auto& s = b.fibers[static_cast<size_t>(id)].self;
  std::ostringstream os;
  os << "thread " << id << " (warp " << id / kWarp << ", lane " << id % kWarp << ") of block (" << s.block_idx.x
     << ", " << s.block_idx.y << ", " << s.block_idx.z << ")";
  return os.str();
}

void switch_context(Context& from, Context& to) {
#if defined(__x86_64__)
  contrax_simt_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

void set_state(Block& b, Fiber& f, State s) {
  f.state = s;
  uint64_t& word = b.runnable[f.id / 64];
  const uint64_t bit = uint64_t{1} << (f.id % 64);
  word = s == State::kRunnable ? word | bit : word & ~bit;
}

// The next fiber to run under the schedule, or null when none can.
Fiber* next_runnable(Block& b) {
  const int words = (b.threads + 63) / 64;
  if (schedule_setting.load(std::memory_order_relaxed) == Schedule::kLowestFirst) {
    for (int k = 0; k < words; ++k) {
      if (b.runnable[k]) return &b.fibers[static_cast<size_t>(k * 64 + __builtin_ctzll(b.runnable[k]))];
    }
  } else {
    for (int k = words - 1; k >= 0; --k) {
      if (b.runnable[k]) return &b.fibers[static_cast<size_t>(k * 64 + 63 - __builtin_clzll(b.runnable[k]))];
    }
  }
  return nullptr;
}

bool same_site(const char* f1, int l1, const char* f2, int l2) {
  return l1 == l2 && (f1 == f2 || std::strcmp(f1, f2) == 0);
}

// What every unfinished thread waits at, for a fault's message.
std::string waiting(const Block& b) {
  std::ostringstream os;
  int shown = 0;
  for (const Fiber& f : b.fibers) {
    if (f.state == State::kDone || f.state == State::kRunnable) continue;
    if (shown++ == 4) {
      os << "; ...";
      break;
    }
    os << "; " << thread_name(b, f.id) << " waits at " << (f.state == State::kAtBarrier ? "__syncthreads()" : "a warp collective")
       << " at " << where(f.file, f.line);
  }
  os << "; " << b.finished << " of " << b.threads << " threads have finished";
  return os.str();
}

// Leaves the calling fiber for good: the block is abandoned with `message`.
[[noreturn]] void fault(Block& b, const std::string& message) {
  b.fault = message;
  Fiber* self = b.running;
  detail::current = nullptr;
  switch_context(self->ctx, b.scheduler);
  __builtin_unreachable();
}

// Hands the OS thread from the calling fiber to the next runnable one (the
// caller itself when it is runnable and first under the schedule), or back
// to the scheduler when every thread has finished.
void yield(Block& b) {
  Fiber* self = b.running;
  Fiber* next = next_runnable(b);
  if (next == nullptr) {
    if (b.finished == b.threads) {
      detail::current = nullptr;
      switch_context(self->ctx, b.scheduler);
      return;  // never resumed
    }
    fault(b, "simt: the block can go no further (a barrier or shuffle not every thread reaches)" + waiting(b));
  }
  if (next == self) return;
  b.running = next;
  detail::current = &next->self;
  switch_context(self->ctx, next->ctx);
  // Resumed: whoever switched here set b.running and current.
}

Block& block_of(const char* what) {
  if (block_here == nullptr || block_here->running == nullptr) detail::outside_kernel(what);
  return *block_here;
}

}  // namespace

void set_schedule(Schedule s) { schedule_setting.store(s); }
Schedule schedule() { return schedule_setting.load(); }
int64_t launches() { return launch_count.load(); }

namespace detail {

thread_local const Self* current = nullptr;

void outside_kernel(const char* what) {
  throw Fault(std::string("simt: ") + what + " used outside a kernel launched by contrax::simt::launch");
}

void sync_block(const char* file, int line) {
  Block& b = block_of("__syncthreads()");
  Fiber& self = *b.running;
  if (b.exited >= 0) {
    fault(b, "simt: __syncthreads() at " + where(file, line) + " in " + thread_name(b, self.id) +
                 " can never complete: " + thread_name(b, b.exited) + " has exited");
  }
  if (b.barrier_arrived == 0) {
    b.barrier_file = file, b.barrier_line = line;
  } else if (!same_site(b.barrier_file, b.barrier_line, file, line)) {
    fault(b, "simt: " + thread_name(b, self.id) + " reached __syncthreads() at " + where(file, line) +
                 " while others wait at the one at " + where(b.barrier_file, b.barrier_line));
  }
  self.file = file, self.line = line;
  if (++b.barrier_arrived == b.threads) {
    b.barrier_arrived = 0;
    for (Fiber& f : b.fibers) set_state(b, f, State::kRunnable);
    return;  // the last to arrive goes on; the others run when the schedule picks them
  }
  set_state(b, self, State::kAtBarrier);
  yield(b);
}

// One lane's arrival at a warp collective (a shuffle, or __syncwarp when
// `shuffle` is false); the last lane to arrive completes it for all.
void arrive(Block& b, bool shuffle, Shuffle mode, unsigned mask, uint64_t bits, int operand, int width,
            const char* file, int line) {
  Fiber& self = *b.running;
  const int warp = self.id / kWarp, lane = self.id % kWarp;
  const int lanes = std::min(kWarp, b.threads - warp * kWarp);
  const char* what = shuffle ? "a warp shuffle" : "__syncwarp()";
  if (mask != 0xffffffffu) {
    std::ostringstream os;
    os << "simt: " << what << " at " << where(file, line) << " with mask 0x" << std::hex << mask
       << ": only the full warp's mask (0xffffffff) is modelled";
    fault(b, os.str());
  }
  if (lanes != kWarp) fault(b, std::string("simt: ") + what + " at " + where(file, line) + " in a partial warp");
  if (width < 1 || width > kWarp || (width & (width - 1)) != 0) {
    fault(b, "simt: a warp shuffle at " + where(file, line) + " with width " + std::to_string(width) +
                 " (a power of two up to 32)");
  }
  if (b.warp_exited[static_cast<size_t>(warp)] > 0) {
    for (int l = 0; l < kWarp; ++l) {
      if (b.fibers[static_cast<size_t>(warp * kWarp + l)].state == State::kDone) {
        fault(b, std::string("simt: ") + what + " at " + where(file, line) + " in " + thread_name(b, self.id) +
                     " can never complete: " + thread_name(b, warp * kWarp + l) + " has exited");
      }
    }
  }
  WarpSync& w = b.warps[static_cast<size_t>(warp)];
  if (w.arrived == 0) {
    w.shuffle = shuffle, w.mode = mode, w.width = width, w.file = file, w.line = line;
  } else if (w.shuffle != shuffle || w.mode != mode || w.width != width ||
             !same_site(w.file, w.line, file, line)) {
    fault(b, "simt: " + thread_name(b, self.id) + " reached " + what + " at " + where(file, line) +
                 " while other lanes of its warp wait at " + where(w.file, w.line) +
                 " (every lane must take part in the same collective)");
  }
  w.value[lane] = bits, w.operand[lane] = operand;
  self.file = file, self.line = line;
  if (++w.arrived < kWarp) {
    set_state(b, self, State::kAtWarp);
    yield(b);
    return;
  }
  // PTX's shfl.sync: segments of `width` lanes; a source lane outside the
  // caller's segment bounds (or past its end) yields the caller's own value.
  const int seg = kWarp - w.width;  // the segment mask's complement bits (c[12:8])
  for (int l = 0; l < kWarp; ++l) {
    const int max_lane = (l & seg) | (31 & ~seg), min_lane = l & seg, bv = w.operand[l];
    int j = l;
    bool ok = true;
    switch (w.mode) {
      case Shuffle::kUp:
        j = l - bv, ok = j >= min_lane;
        break;
      case Shuffle::kDown:
        j = l + bv, ok = j <= max_lane;
        break;
      case Shuffle::kXor:
        j = l ^ bv, ok = j <= max_lane;
        break;
      case Shuffle::kIdx:
        j = min_lane | (bv & ~seg & 31), ok = j <= max_lane;
        break;
    }
    w.result[l] = w.value[ok && j >= 0 && j < kWarp ? j : l];
  }
  w.arrived = 0;
  for (int l = 0; l < kWarp; ++l) set_state(b, b.fibers[static_cast<size_t>(warp * kWarp + l)], State::kRunnable);
}

void sync_warp(unsigned mask, const char* file, int line) {
  arrive(block_of("__syncwarp()"), false, Shuffle::kIdx, mask, 0, 0, kWarp, file, line);
}

uint64_t shuffle(Shuffle mode, unsigned mask, uint64_t bits, int b, int width, const char* file, int line) {
  Block& blk = block_of("a warp shuffle");
  arrive(blk, true, mode, mask, bits, b, width, file, line);
  return blk.warps[static_cast<size_t>(blk.running->id / kWarp)].result[blk.running->id % kWarp];
}

}  // namespace detail

}  // namespace contrax::simt

// Where a fiber starts (through the trampoline or makecontext): the kernel
// body, then done; the last thread to finish returns to the scheduler. Global
// and kept (`used`): only the trampoline's assembly calls it.
extern "C" __attribute__((used, visibility("hidden"), noreturn)) void contrax_simt_fiber_main(void* fiber) {
  using namespace contrax::simt;
  Fiber* f = static_cast<Fiber*>(fiber);
  Block& b = *block_here;
  std::string thrown;  // faulted outside the handler, so that no caught exception is left behind
  try {
    (*b.body)();
  } catch (const std::exception& e) {
    thrown = e.what();
  } catch (...) {
    thrown = "an exception of unknown type";
  }
  if (!thrown.empty()) fault(b, "simt: " + thread_name(b, f->id) + " threw: " + thrown);
  set_state(b, *f, State::kDone);
  ++b.finished;
  ++b.warp_exited[static_cast<size_t>(f->id / kWarp)];
  if (b.exited < 0) b.exited = f->id;
  // A thread that finishes while others of its block wait at a barrier, or of
  // its warp at a collective, leaves them waiting for good.
  if (b.barrier_arrived > 0) {
    fault(b, "simt: " + thread_name(b, f->id) + " exited while " + std::to_string(b.barrier_arrived) +
                 " threads wait at __syncthreads() at " + where(b.barrier_file, b.barrier_line));
  }
  const WarpSync& w = b.warps[static_cast<size_t>(f->id / kWarp)];
  if (w.arrived > 0) {
    fault(b, "simt: " + thread_name(b, f->id) + " exited while " + std::to_string(w.arrived) +
                 " lanes of its warp wait at " + (w.shuffle ? "a shuffle" : "__syncwarp()") + " at " +
                 where(w.file, w.line));
  }
  yield(b);
  __builtin_unreachable();
}

namespace contrax::simt {

namespace {

#if !defined(__x86_64__)
void fiber_entry_ucontext(int hi, int lo) {
  const uintptr_t p = (static_cast<uintptr_t>(static_cast<unsigned>(hi)) << 32) | static_cast<unsigned>(lo);
  contrax_simt_fiber_main(reinterpret_cast<void*>(p));
}
#endif

void start_fiber(Fiber& f, char* top) {
#if defined(__x86_64__)
  auto* sp = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(top) & ~uintptr_t{15}) - 72);
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[4] = &f;  // rbx
  sp[6] = reinterpret_cast<void*>(&contrax_simt_trampoline);
  f.ctx.sp = sp;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = top - kStackBytes;
  f.ctx.uc.uc_stack.ss_size = kStackBytes;
  f.ctx.uc.uc_link = nullptr;
  const auto p = reinterpret_cast<uintptr_t>(&f);
  makecontext(&f.ctx.uc, reinterpret_cast<void (*)()>(&fiber_entry_ucontext), 2, static_cast<int>(p >> 32),
              static_cast<int>(p & 0xffffffffu));
#endif
}

std::string dims(dim3 d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

}  // namespace

namespace detail {

void run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
  if (block_here != nullptr) throw Fault("simt: a launch from inside a kernel (dynamic parallelism) is not modelled");
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreads || block.z > 64) {
    throw Fault("simt: a launch with block " + dims(block) + " (1 to 1,024 threads, z at most 64)");
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    throw Fault("simt: a launch with grid " + dims(grid) + " (x 1 to 2^31 - 1, y and z 1 to 65,535)");
  }
  launch_count.fetch_add(1, std::memory_order_relaxed);
  Block b;
  b.threads = static_cast<int>(threads);
  b.fibers.resize(threads);
  b.warps.resize((threads + kWarp - 1) / kWarp);
  b.warp_exited.resize(b.warps.size());
  b.body = &body;
  for (int i = 0; i < b.threads; ++i) stacks.top(i);  // map before any fiber runs
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        b.finished = 0, b.barrier_arrived = 0, b.exited = -1;
        for (auto& w : b.warps) w.arrived = 0;
        std::fill(b.warp_exited.begin(), b.warp_exited.end(), 0);
        for (int i = 0; i < b.threads; ++i) {
          Fiber& f = b.fibers[static_cast<size_t>(i)];
          f.id = i;
          set_state(b, f, State::kRunnable);
          const unsigned u = static_cast<unsigned>(i);
          f.self = {dim3(u % block.x, u / block.x % block.y, u / (block.x * block.y)), dim3(bx, by, bz), block, grid};
          start_fiber(f, stacks.top(i));
        }
        block_here = &b;
        b.running = next_runnable(b);
        current = &b.running->self;
        switch_context(b.scheduler, b.running->ctx);
        block_here = nullptr;
        current = nullptr;
        b.running = nullptr;
        if (!b.fault.empty()) throw Fault(b.fault);
      }
    }
  }
}

}  // namespace detail

}  // namespace contrax::simt
