// Failure diagnosis of the collectives (comm/failure.h) and its public side,
// with_collective_context (contrax/comm/failure.h).
#include "contrax/comm/failure.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <exception>
#include <future>
#include <memory>
#include <sstream>
#include <system_error>
#include <thread>
#include <vector>

#include "comm/c10d_log.h"
#include "comm/failure.h"
#include "contrax/launch/launcher.h"

namespace contrax {

namespace detail {

namespace {

// After a collective failed: which peers are still alive and saw it fail too?
// Each rank that gets here posts its rank and the collective to the store and
// waits a short window for the others' posts. A rank that posts nothing is
// hung (e.g. SIGSTOPped), dead, or in no collective at all. The store lives in
// rank 0's process: when that one is stopped, the store itself does not
// answer, so the whole diagnosis runs on a helper thread that is abandoned
// once the window passes. Returns a sentence for the error message.
std::string diagnose_peers(const CommunicatorImpl& impl, const std::string& what) {
  if (!impl.store || impl.world_size <= 1) return "";
  const auto window = std::min<std::chrono::milliseconds>(
      std::chrono::milliseconds(3000),
      std::max<std::chrono::milliseconds>(impl.timeout / 2, std::chrono::milliseconds(500)));
  auto store = impl.store;
  const int64_t rank = impl.rank, world = impl.world_size;
  const bool external = impl.external_store;
  const std::string silent_host = "rank 0, which hosts the rendezvous store, did not answer (hung, stopped or dead)";
  auto result = std::make_shared<std::promise<std::string>>();
  auto future = result->get_future();
  try {
    std::thread([store, rank, world, what, window, result, external, silent_host] {
      // The store's host may be gone: c10d would log each failed call with a
      // backtrace before the exception this thread turns into a sentence.
      const QuietC10dLog quiet;
      try {
        store->set("contrax/failed/" + std::to_string(rank), std::vector<uint8_t>(what.begin(), what.end()));
        const auto deadline = std::chrono::steady_clock::now() + window;
        std::vector<int64_t> silent;
        for (;;) {
          silent.clear();
          for (int64_t r = 0; r < world; ++r) {
            if (r != rank && !store->check({"contrax/failed/" + std::to_string(r)})) silent.push_back(r);
          }
          if (silent.empty() || std::chrono::steady_clock::now() >= deadline) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        if (silent.empty()) {
          result->set_value("every other rank saw this collective fail as well");
        } else {
          result->set_value("rank" + std::string(silent.size() > 1 ? "s " : " ") + c10::Join(", ", silent) +
                            " did not answer (hung, stopped or dead)");
        }
      } catch (const std::exception& e) {
        // Refused, reset or closed, not silent: the host's process is gone.
        const std::string m = e.what();
        const bool gone = m.find("onnection") != std::string::npos || m.find("Broken pipe") != std::string::npos ||
                          m.find("got 0 bytes") != std::string::npos;
        result->set_value(rank == 0 || external ? "the store could not be reached"
                          : gone ? "rank 0, which hosts the rendezvous store, has ended (exited, killed or crashed: its "
                                   "own output, or the launcher's last line, says why)"
                                 : silent_host);
      }
    }).detach();
  } catch (const std::system_error&) {
    // No thread to ask with (the tasks limit used up): the collective's
    // own failure is reported without the peers' answers.
    return "the peers could not be asked (no thread could be started)";
  }
  if (future.wait_for(window + std::chrono::milliseconds(1000)) == std::future_status::ready) return future.get();
  return external ? "the rendezvous store (torchrun's agent) did not answer" : silent_host;
}

// Text of a c10d/Gloo transport failure (as opposed to any other error that
// may cross the same region, which must pass through untouched).
bool is_transport_failure(const std::string& m) {
  if (m.rfind("contrax: collective", 0) == 0) return false;  // already told with context
  for (const char* s : {"gloo", "Gloo", "Connection closed", "Connection reset", "Timed out", "timed out",
                        "Broken pipe"}) {
    if (m.find(s) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

std::string cause_of(const std::string& raw) {
  // The raw "[../third_party/gloo/...cc:81] Timed out ..." says nothing to a
  // user on its own, so it is kept only as the cause after Contrax's own words.
  std::string s = raw.substr(0, raw.find('\n'));
  if (!s.empty() && s[0] == '[') {
    const auto close = s.find("] ");
    if (close != std::string::npos) s = s.substr(close + 2);
  }
  // Gloo's guess at the cause ("This is typically caused by a remote worker
  // crashing ... GLHF!") contradicts a peer that exited on its own error;
  // the diagnosis before the cause says what the peer did.
  const auto hint = s.find(". This is typically caused by");
  if (hint != std::string::npos) s = s.substr(0, hint);
  return s;
}

void fail_collective(const std::string& raw, const std::string& op, const CommunicatorImpl& impl) {
  const std::string cause = cause_of(raw);
  const bool timed_out = cause.find("Timed out") != std::string::npos || cause.find("timed out") != std::string::npos;
  const std::string peers = diagnose_peers(impl, op);
  std::ostringstream msg;
  msg << "contrax: collective '" << op << "' " << (timed_out ? "timed out" : "failed") << " on rank " << impl.rank
      << " of " << impl.world_size << " (backend " << impl.backend << ", timeout " << impl.timeout.count()
      << " ms)";
  if (!peers.empty()) msg << "; " << peers;
  msg << "; cause: " << cause;
  record_worker_failure(/*caused_by_peer=*/true, msg.str());
  TORCH_CHECK(false, msg.str());
  TORCH_INTERNAL_ASSERT(false);  // TORCH_CHECK(false) always throws
}

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* op, const CommunicatorImpl& impl) {
  std::string raw;
  try {
    work->wait();
    return;
  } catch (const c10::Error& e) {
    raw = e.what_without_backtrace();
  } catch (const std::exception& e) {
    raw = e.what();
  }
  fail_collective(raw, op, impl);
}

}  // namespace detail

void with_collective_context(const Communicator& comm, const std::string& op, const std::function<void()>& fn) {
  std::string raw;
  try {
    fn();
    return;
  } catch (const c10::Error& e) {
    raw = e.what_without_backtrace();
    if (comm.world_size() == 1 || !detail::is_transport_failure(raw)) throw;
  } catch (const std::exception& e) {
    // Autograd may carry a backward-time failure as a plain std::exception.
    raw = e.what();
    if (comm.world_size() == 1 || !detail::is_transport_failure(raw)) throw;
  }
  detail::fail_collective(raw, op, comm.impl());
}

}  // namespace contrax
