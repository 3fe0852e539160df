// The threads of a `contrax train` run against the tasks limit (see
// train_threads.h).
#include "train/train_threads.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>

#include "cli/cli.h"
#include "contrax/launch/launcher.h"
#include "contrax/util/tasks.h"

namespace contrax::cli {

namespace {

// One rank's threads, counted as train_threads.h says.
int64_t rank_tasks(int64_t threads, int64_t world) {
  const int64_t intra_op = 2 * threads - 1;
  return world > 1 ? intra_op + 2 * threads + 1 : intra_op;
}

// Set while a rank's threads may still fail to start; g_who names the rank
// (written before arming, read only by the handlers).
std::atomic<bool> g_armed{false};
std::string g_who;
std::terminate_handler g_previous_terminate = nullptr;

// The tasks limit as the end of a message.
std::string limit_text() {
  const TasksLimit lim = tasks_limit();
  return lim.left < 0 ? "no tasks limit is visible to this process (a limit it cannot read, or the machine's)"
                      : "the tasks limit: " + lim.what;
}

[[noreturn]] void end_for_threads(const std::string& cause) {
  const std::string msg = "contrax train: error: " + g_who + " could not start its threads (" + cause + "); " +
                          limit_text() + "; use fewer --threads or --nproc\n";
  contrax::record_worker_failure(false, msg);
  (void)!::write(2, msg.data(), msg.size());
  // Now, before PyTorch's exit handlers: its pthreadpool would join threads
  // that were never made (SIGSEGV).
  ::_exit(1);
}

// libgomp ends the process with exit(1) when a thread of its team cannot
// start; registered after PyTorch's pthreadpool exists, so this runs first.
void on_library_exit() {
  if (g_armed.exchange(false)) end_for_threads("libgomp: Thread creation failed");
}

// c10d's ProcessGroupGloo constructor that cannot start its second worker
// thread destroys the first while it is joinable: std::terminate. Only with
// the tasks limit used up is that this failure; anything else aborts as ever.
void on_terminate() {
  if (g_armed.exchange(false) && tasks_limit().left == 0) {
    end_for_threads("a thread pool of c10d could not start a thread: std::terminate");
  }
  (g_previous_terminate != nullptr ? g_previous_terminate : std::abort)();
}

}  // namespace

int64_t tasks_needed(const ThreadPlan& p) {
  return p.ranks * rank_tasks(p.threads, p.world) + (p.world > 1 && p.hosts_store ? 1 : 0) + (p.launcher ? 1 : 0) +
         (p.evaluates ? 3 : 0);
}

void check_tasks_limit(const ThreadPlan& p) {
  const char* skip = std::getenv("CONTRAX_TASKS_CHECK");
  if (skip != nullptr && std::strcmp(skip, "0") == 0) return;
  const TasksLimit lim = tasks_limit();
  // This process is one of them, and already counted by the limit.
  const auto more = [](const ThreadPlan& q) { return tasks_needed(q) - 1; };
  if (lim.left < 0 || more(p) <= lim.left) return;
  // The largest --threads that fits with these processes, if any does.
  int64_t fits = 0;
  for (ThreadPlan q = p; q.threads > 1;) {
    --q.threads;
    if (more(q) <= lim.left) {
      fits = q.threads;
      break;
    }
  }
  usage_check(false, "--nproc ", p.ranks, " and --threads ",
              p.threads_given ? std::to_string(p.threads) : "0 (cores / processes: " + std::to_string(p.threads) + ")",
              " would start ", more(p), " more threads and processes (", rank_tasks(p.threads, p.world),
              " per training process", p.launcher ? ", and a launcher" : "", "), but the tasks limit allows ",
              lim.left, " more: ", lim.what,
              fits > 0 ? "; at most --threads " + std::to_string(fits) + " fits with --nproc " + std::to_string(p.ranks)
                       : "; use a smaller --nproc (not even --threads 1 fits)",
              " (CONTRAX_TASKS_CHECK=0 skips this check)");
}

std::string threads_failed_message(const std::string& cause) {
  const bool named = cause.find("the tasks limit") != std::string::npos ||
                     cause.find("no tasks limit is visible") != std::string::npos;
  const TasksLimit lim = tasks_limit();
  return cause + (named ? std::string()
                  : lim.left < 0 ? std::string("; no tasks limit is visible to this process")
                                 : "; the tasks limit: " + lim.what) +
         "; use fewer --threads or --nproc";
}

void threads_failed(const std::string& cause) { TORCH_CHECK(false, threads_failed_message(cause)); }

// c10d's ProcessGroupGloo constructor whose second worker thread cannot
// start may also hang for good instead of throwing: unwinding, it destroys
// the condition variable its first worker waits on, and glibc's
// pthread_cond_destroy waits for that waiter (seen with gdb: the main thread
// in pthread_cond_destroy under the constructor, one pt_gloo_runloop in
// pthread_cond_wait). Nothing returns, so the watchdog decides: a tasks
// limit that stays used up for `hang` while the communicator is still being
// built means the threads it still needs cannot start either (a build that
// fits exactly returns within microseconds of its last thread).
ThreadStartScope::ThreadStartScope(const std::string& who, std::chrono::milliseconds hang) {
  g_who = who;
  g_previous_terminate = std::set_terminate(on_terminate);
  g_armed = true;
  try {
    watchdog_ = std::thread([this, hang] {
      std::unique_lock<std::mutex> lock(mutex_);
      auto used_up_since = std::chrono::steady_clock::time_point::max();
      while (!done_cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return done_; })) {
        const auto now = std::chrono::steady_clock::now();
        if (tasks_limit().left != 0) {
          used_up_since = std::chrono::steady_clock::time_point::max();
        } else if (used_up_since == std::chrono::steady_clock::time_point::max()) {
          used_up_since = now;
        } else if (now - used_up_since >= hang && g_armed.exchange(false)) {
          end_for_threads("a thread of c10d's process group could not start, and its constructor hung");
        }
      }
    });
  } catch (...) {
    g_armed = false;
    std::set_terminate(g_previous_terminate);
    throw;
  }
}

ThreadStartScope::~ThreadStartScope() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  done_cv_.notify_one();
  watchdog_.join();
  g_armed = false;
  std::set_terminate(g_previous_terminate);
}

std::string env_rank() {
  const char* r = std::getenv("RANK") != nullptr ? std::getenv("RANK") : std::getenv("SLURM_PROCID");
  return r != nullptr ? std::string("rank ") + r : std::string("this process");
}

IntraOpThreads::IntraOpThreads(int64_t threads, const std::string& who) {
  // PyTorch's pthreadpool is made here: its exit handler is registered
  // before ours, so ours runs first.
  at::set_num_threads(static_cast<int>(threads));
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(on_library_exit); });
  g_who = who;
  g_armed = true;
  // The OpenMP team starts now, at a known point, not in the first step.
  at::parallel_for(0, threads, 1, [](int64_t, int64_t) {});
}

IntraOpThreads::~IntraOpThreads() { g_armed = false; }

}  // namespace contrax::cli
