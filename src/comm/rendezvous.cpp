// The rendezvous (see comm/rendezvous.h).
#include "comm/rendezvous.h"

#include <c10/util/StringUtil.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/util/hash.h>

#include <algorithm>
#include <exception>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/address.h"
#include "comm/c10d_log.h"
#include "comm/failure.h"

namespace contrax::detail {

namespace {

// The rendezvous store, bound to MASTER_ADDR on rank 0 (never to every
// interface) and reached by the other ranks within `timeout`.
c10::intrusive_ptr<c10d::Store> make_tcp_store(const CommunicatorOptions& o, const sockaddr_storage& master,
                                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(o.master_port());
  so.isServer = o.rank() == 0 && !o.external_store();
  so.numWorkers = static_cast<size_t>(o.world_size());
  // Contrax's own arrival check (below) waits for the workers, against one
  // deadline and naming the ranks that are missing.
  so.waitWorkers = false;
  so.timeout = timeout;
  // TCPStore defaults to a libuv server, which builds without libuv
  // (Debian's 2.6) refuse at run time, and which not every release lets
  // adopt a listening descriptor: the classic server, clients alike.
  so.useLibUV = false;
  const std::string host = numeric_host(master);
  if (!so.isServer) {
    // Contrax waits for the store to listen itself, against the deadline:
    // TCPStore's own connect (PyTorch 2.4 and later) retries once after a
    // random back-off of up to the whole timeout and logs each try with a
    // backtrace, which took 31-35 s for a 20 s timeout. Once a connection
    // was accepted, TCPStore connects at once, with what is left of the time.
    const auto start = std::chrono::steady_clock::now(), deadline = start + timeout;
    const bool listening = wait_until_listening(master, o.master_port(), deadline);
    std::string cause = "nothing accepted a connection there";
    if (listening) {
      so.timeout = std::max<std::chrono::milliseconds>(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()),
          std::chrono::milliseconds(1000));
      try {
        const QuietC10dLog quiet;
        return c10::make_intrusive<c10d::TCPStore>(host, so);
      } catch (const std::exception& e) {
        cause = cause_of(e.what());
      }
    }
    const auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    TORCH_CHECK(!o.external_store(), "Communicator::create(): rank ", o.rank(),
                " could not reach the rendezvous store of torchrun's agent at MASTER_ADDR ", o.master_addr(), ":",
                o.master_port(), " after waiting ", waited, " ms (timeout ", timeout.count(), " ms): ", cause);
    TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " could not reach the rendezvous store of rank 0 "
                "at MASTER_ADDR ", o.master_addr(), ":", o.master_port(), " after waiting ", waited, " ms (timeout ",
                timeout.count(), " ms; rank 0 never started, failed before listening, or MASTER_ADDR/MASTER_PORT "
                "differ between ranks): ", cause);
  }
  // TCPStore takes over the socket bound to MASTER_ADDR (never every interface).
  so.masterListenFd = listen_on_master(master, o.master_addr(), o.master_port());
  if (!is_loopback(master)) {
    TORCH_WARN("contrax: the rendezvous store listens on MASTER_ADDR ", o.master_addr(), ":", o.master_port(),
               ", which other hosts can reach; ",
               o.job_secret().empty()
                   ? "no CONTRAX_JOB_SECRET is set, so whoever reaches it can read the job's keys, stop the job or "
                     "join it as a rank: give every rank the same CONTRAX_JOB_SECRET (docs/reliability.md)"
                   : "its keys are bound to CONTRAX_JOB_SECRET, so no one without the secret can read them, stop the "
                     "job or join it, but anyone can connect (docs/reliability.md)");
  }
  return c10::make_intrusive<c10d::TCPStore>(host, so);
}

// The prefix of every key of a job with secret `secret`: a hash of it, so
// that the keys (which c10d prints in its timeouts) never show the secret
// itself, and nobody without it can name one of them.
std::string secret_prefix(const std::string& secret) {
  return "contrax/job_" + c10::sha1("contrax job secret\n" + secret).str() + "/";
}

// With a secret, rank 0 marks the store as its job's at once, and the other
// ranks look for the mark (under their own secret's prefix): a rank that
// reached another job's store (or was given another secret) is told so
// within seconds instead of waiting out the timeout for peers that are not
// there.
void check_host(c10d::Store& store, const CommunicatorOptions& o) {
  const std::string key = "contrax/host";
  if (o.rank() == 0) {
    store.set(key, std::vector<uint8_t>{1});
    return;
  }
  const auto grace = std::min<std::chrono::milliseconds>(o.timeout(), std::chrono::seconds(10));
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (!store.check({key})) {
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "Communicator::create(): rank ", o.rank(),
                " reached a rendezvous store at MASTER_ADDR ", o.master_addr(), ":", o.master_port(),
                " whose rank 0 is not of this job: no rank 0 with this job's CONTRAX_JOB_SECRET serves it (another job "
                "holds MASTER_PORT, or the ranks were given different secrets)");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Every rank announces itself and its world size in the store, and waits
// (one deadline) until all ranks of its world have: a missing rank is named,
// a WORLD_SIZE that differs between ranks or a rank started twice is
// reported at once, never as a Gloo internal error or a timeout.
void await_ranks(c10d::Store& store, int64_t rank, int64_t world, std::chrono::steady_clock::time_point deadline,
                 std::chrono::milliseconds timeout) {
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  auto text = [](const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); };
  const std::string error_key = "contrax/rdzv/error";
  // Rank 0 hosts the store: leaving at once would take the store, and with it
  // the reason, away from the peers that are still polling for it.
  auto fail = [&](const std::string& msg) {
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    TORCH_CHECK(false, "Communicator::create(): ", msg);
  };
  const int64_t arrivals = store.add("contrax/rdzv/rank/" + std::to_string(rank), 1);
  if (arrivals > 1) {
    const std::string msg = "rank " + std::to_string(rank) + " was started twice, or MASTER_PORT is another job's " +
                            "(duplicate RANK " + std::to_string(rank) + "; every process needs its own RANK in [0, " +
                            "WORLD_SIZE), and each job its own MASTER_PORT or CONTRAX_JOB_SECRET)";
    store.set(error_key, bytes(msg));
    TORCH_CHECK(false, "Communicator::create(): ", msg);
  }
  store.set("contrax/rdzv/size/" + std::to_string(rank), bytes(std::to_string(world)));
  std::vector<bool> seen(static_cast<size_t>(world), false);
  for (;;) {
    if (store.check({error_key})) {
      fail("rank " + std::to_string(rank) + " stops: another rank reported: " + text(store.get(error_key)));
    }
    std::vector<int64_t> missing;
    for (int64_t r = 0; r < world; ++r) {
      if (seen[static_cast<size_t>(r)]) continue;
      const std::string key = "contrax/rdzv/size/" + std::to_string(r);
      if (!store.check({key})) {
        missing.push_back(r);
        continue;
      }
      const std::string theirs = text(store.get(key));
      if (theirs != std::to_string(world)) {
        const std::string msg = "WORLD_SIZE differs between ranks: rank " + std::to_string(rank) + " has " +
                                std::to_string(world) + ", rank " + std::to_string(r) + " has " + theirs;
        store.set(error_key, bytes(msg));
        fail(msg);
      }
      seen[static_cast<size_t>(r)] = true;
    }
    if (missing.empty()) return;
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "Communicator::create(): rank ", rank, " of ", world,
                ": rendezvous timed out after ", timeout.count(), " ms; rank", missing.size() > 1 ? "s " : " ",
                c10::Join(", ", missing), " never arrived",
                " (not started, failed before connecting, or given another MASTER_ADDR/MASTER_PORT)");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Store> rendezvous(const CommunicatorOptions& o) {
  // One deadline for all of it, so that a missing peer is reported after
  // `timeout`, not after the store's and then Gloo's.
  const auto deadline = std::chrono::steady_clock::now() + o.timeout();
  c10::intrusive_ptr<c10d::Store> store;
  if (!o.file_store().empty()) {
    store = c10::make_intrusive<c10d::FileStore>(o.file_store(), static_cast<int>(o.world_size()));
    store->setTimeout(o.timeout());
    return store;
  }
  const sockaddr_storage master = resolve_master(o.master_addr(), o.rank());
  store = make_tcp_store(o, master, o.timeout());
  store->setTimeout(o.timeout());
  if (!o.job_secret().empty()) store = c10::make_intrusive<c10d::PrefixStore>(secret_prefix(o.job_secret()), store);
  if (!o.store_prefix().empty()) store = c10::make_intrusive<c10d::PrefixStore>(o.store_prefix(), store);
  try {
    if (!o.job_secret().empty() && !o.external_store()) check_host(*store, o);
    await_ranks(*store, o.rank(), o.world_size(), deadline, o.timeout());
  } catch (const std::exception& e) {
    const std::string m = e.what();
    if (m.find("Communicator::create()") != std::string::npos) throw;
    // The store went away under us: its host stopped during the rendezvous.
    TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " lost the rendezvous store at MASTER_ADDR ",
                o.master_addr(), ":", o.master_port(), " (", cause_of(m), "): ",
                o.external_store() ? "torchrun's agent stopped serving it"
                                   : "rank 0 stopped during the rendezvous; its own error says why");
  }
  store->setTimeout(o.timeout());
  return store;
}

}  // namespace contrax::detail
