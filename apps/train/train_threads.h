// The threads of a `contrax train` run against the tasks limit
// (contrax/util/tasks.h): how many a run starts, the refusal of one that cannot
// fit (before any thread starts, as a step that cannot fit in memory is
// refused), and the start of a rank's intra-op threads at a known point, where
// a thread that cannot be created ends the process with an error (status 1)
// instead of libgomp's exit(1) and a SIGSEGV among the exit handlers
// (PyTorch's pthreadpool joining threads it never made), or the SIGABRT of
// c10d's ProcessGroupGloo constructor (std::terminate on a joinable thread).
//
// Counted on PyPI torch 2.15.0 (/proc/PID/task of each process while a run
// trains): with T intra-op threads a rank holds 2T - 1 threads (its main
// thread, T - 1 OpenMP workers, T - 1 in PyTorch's pthreadpool); a rank of
// a multi-process run 2T + 1 more (Gloo's 2T workers and its event loop),
// rank 0 one more (the store's server thread); the launcher is one process.
//
//   cli::check_tasks_limit(plan);                 // before any thread starts (UsageError)
//   cli::IntraOpThreads threads(t, "rank 0");      // the rank's pool, started here
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

namespace contrax::cli {

/// What a run will start on this machine.
struct ThreadPlan {
  int64_t ranks = 1;          // processes training on this machine
  int64_t world = 1;          // processes of the whole run (Gloo's threads exist when > 1)
  int64_t threads = 1;        // intra-op threads per process
  bool launcher = false;      // a launcher process stays around them
  bool hosts_store = true;    // one of them hosts the rendezvous store
  bool evaluates = false;     // rank 0 evaluates (up to three parts side by side)
  bool threads_given = false; // --threads was set (else cores / processes)
};

/// Threads and processes the run starts (what the tasks limit counts).
int64_t tasks_needed(const ThreadPlan& p);

/// Throws UsageError when the run cannot fit in the tasks limit, naming
/// --threads / --nproc, the largest --threads that fits, and the limit.
/// CONTRAX_TASKS_CHECK=0 skips it (for a limit read wrongly).
void check_tasks_limit(const ThreadPlan& p);

/// Runs `make` (the communicator: the store's and Gloo's threads start
/// there). A thread that cannot start (EAGAIN, as a std::system_error or in
/// the library's error) becomes an error naming the tasks limit and the flags
/// that lower the count.
///
///   comm = cli::with_thread_hint([&] { return Communicator::from_env(o); });
template <typename F>
auto with_thread_hint(F make) -> decltype(make());

/// The error of a thread that could not start (`cause`), naming the tasks
/// limit and --threads / --nproc.
std::string threads_failed_message(const std::string& cause);

/// Throws threads_failed_message(cause).
[[noreturn]] void threads_failed(const std::string& cause);

/// Sets this process's intra-op threads and starts them at once (an OpenMP
/// region over all of them). While it lives, a library that ends the process
/// with exit() (libgomp's "Thread creation failed") ends it instead with
/// status 1 and one line naming `who`, the tasks limit and the flags, before
/// any other exit handler runs.
class IntraOpThreads {
 public:
  IntraOpThreads(int64_t threads, const std::string& who);
  ~IntraOpThreads();
  C10_DISABLE_COPY_AND_ASSIGN(IntraOpThreads);
};

/// While it lives, a std::terminate with the tasks limit used up (c10d's
/// ProcessGroupGloo constructor that cannot start a thread) ends the process
/// with status 1 and one line naming `who`, the limit and the flags; so does
/// a tasks limit that stays used up for `hang` (that constructor can also
/// hang for good, see train_threads.cpp), which a watchdog thread started
/// here, while threads can still start, looks for. Its peers, stopped by the
/// launcher, end within seconds instead of waiting out their timeout.
class ThreadStartScope {
 public:
  explicit ThreadStartScope(const std::string& who,
                            std::chrono::milliseconds hang = std::chrono::milliseconds(2000));
  ~ThreadStartScope();
  C10_DISABLE_COPY_AND_ASSIGN(ThreadStartScope);

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread watchdog_;
};

/// "rank R" from RANK or SLURM_PROCID, else "this process".
std::string env_rank();

template <typename F>
auto with_thread_hint(F make) -> decltype(make()) {
  try {
    const ThreadStartScope scope(env_rank());  // its watchdog thread may not start either
    return make();
  } catch (const std::system_error& e) {
    if (e.code() != std::errc::resource_unavailable_try_again) throw;
    threads_failed(std::string("could not start a thread: ") + e.what());
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find("a thread could not be started") == std::string::npos) throw;
    threads_failed(msg);
  }
}

}  // namespace contrax::cli
