// The only translation unit that builds c10d process groups and calls their
// collectives. When c10d's API moves in a new LibTorch release, this file is
// what adapts: every difference between the supported releases (LibTorch 2.6
// up to the newest) is here, named by the release that brought it.
#include "contrax/communicator.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/version.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
// LibTorch may be built with MPI (Debian's 2.6 defines USE_C10D_MPI) while
// the MPI headers are not installed; MPI is then simply unavailable here.
#if defined(USE_C10D_MPI) && __has_include(<mpi.h>)
#define CONTRAX_HAVE_MPI 1
#include <torch/csrc/distributed/c10d/ProcessGroupMPI.hpp>
#endif

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <sstream>
#include <thread>

#include "contrax/detail/c10d.h"
#include "contrax/failure.h"
#include "contrax/launcher.h"

namespace contrax {

int64_t CommStats::total_bytes_sent() const {
  int64_t n = 0;
  for (const auto& kv : ops) n += kv.second.bytes_sent;
  return n;
}

int64_t CommStats::total_calls() const {
  int64_t n = 0;
  for (const auto& kv : ops) n += kv.second.calls;
  return n;
}

OpStats CommStats::op(const std::string& name) const {
  auto it = ops.find(name);
  return it == ops.end() ? OpStats{} : it->second;
}

namespace {

int64_t row_bytes(const torch::Tensor& t) {
  int64_t n = t.element_size();
  for (int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

bool all_equal(const std::vector<int64_t>& v) {
  for (auto x : v)
    if (x != v.front()) return false;
  return true;
}

std::string join_ranks(const std::vector<int64_t>& ranks) {
  std::ostringstream o;
  for (size_t i = 0; i < ranks.size(); ++i) o << (i ? ", " : "") << ranks[i];
  return o.str();
}

// After a collective failed: which peers are still alive and saw it fail too?
// Each rank that gets here posts its rank and the collective to the store and
// waits a short window for the others' posts. A rank that posts nothing is
// hung (e.g. SIGSTOPped), dead, or in no collective at all. The store lives in
// rank 0's process: when that one is stopped, the store itself does not
// answer, so the whole diagnosis runs on a helper thread that is abandoned
// once the window passes. Returns a sentence for the error message.
std::string diagnose_peers(const detail::CommunicatorImpl& impl, const std::string& what) {
  if (!impl.store || impl.world_size <= 1) return "";
  const auto window = std::min<std::chrono::milliseconds>(
      std::chrono::milliseconds(3000), std::max<std::chrono::milliseconds>(impl.timeout / 2, std::chrono::milliseconds(500)));
  auto store = impl.store;
  const int64_t rank = impl.rank, world = impl.world_size;
  const bool external = impl.external_store;
  const std::string silent_host = "rank 0, which hosts the rendezvous store, did not answer (hung, stopped or dead)";
  auto result = std::make_shared<std::promise<std::string>>();
  auto future = result->get_future();
  std::thread([store, rank, world, what, window, result, external, silent_host] {
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
        result->set_value("rank" + std::string(silent.size() > 1 ? "s " : " ") + join_ranks(silent) +
                          " did not answer (hung, stopped or dead)");
      }
    } catch (const std::exception&) {
      result->set_value(rank == 0 || external ? "the store could not be reached" : silent_host);
    }
  }).detach();
  if (future.wait_for(window + std::chrono::milliseconds(1000)) == std::future_status::ready) return future.get();
  return external ? "the rendezvous store (torchrun's agent) did not answer" : silent_host;
}

// First line of a c10d/Gloo message, without its source-file prefix: the
// raw "[../third_party/gloo/...cc:81] Timed out ..." says nothing to a user
// on its own, so it is kept only as the cause after Contrax's own words.
std::string cause_of(const std::string& raw) {
  std::string s = raw.substr(0, raw.find('\n'));
  if (!s.empty() && s[0] == '[') {
    const auto close = s.find("] ");
    if (close != std::string::npos) s = s.substr(close + 2);
  }
  return s;
}

// The error of a failed collective `op`: names it, this rank, the ranks that
// did not answer and the cause; recorded for the launcher as a consequence.
[[noreturn]] void fail_collective(const std::string& raw, const std::string& op, const detail::CommunicatorImpl& impl) {
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

// Waits for a c10d work item; a failure becomes fail_collective's error.
void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* op, const detail::CommunicatorImpl& impl) {
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

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// MASTER_ADDR resolved once, with an error that says so (not a rendezvous
// that waits out its timeout on a name that never resolves).
sockaddr_storage resolve_master(const std::string& addr, int64_t rank) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(addr.c_str(), nullptr, &hints, &found);
  TORCH_CHECK(rc == 0 && found != nullptr, "Communicator::create(): rank ", rank, " cannot resolve MASTER_ADDR '",
              addr, "': ", ::gai_strerror(rc), " (set MASTER_ADDR to rank 0's host name or IP address)");
  sockaddr_storage out{};
  // IPv4 first when the name has both: the addresses the other ranks are
  // given (and Gloo binds) are IPv4 on every setup this has met.
  const addrinfo* pick = found;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      pick = a;
      break;
    }
  }
  std::memcpy(&out, pick->ai_addr, pick->ai_addrlen);
  ::freeaddrinfo(found);
  return out;
}

std::string numeric_host(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a)->sin_addr, buf, sizeof buf);
  } else {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr, buf, sizeof buf);
  }
  return buf;
}

socklen_t addr_len(const sockaddr_storage& a) {
  return a.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
}

void set_port(sockaddr_storage& a, int64_t port) {
  if (a.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&a)->sin_port = htons(static_cast<uint16_t>(port));
  else reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = htons(static_cast<uint16_t>(port));
}

// The local address this machine uses to reach `master`: a connected UDP
// socket sends nothing, it only asks the routing table. Gloo binds there, so
// that its sockets, like the store's, live on the interface of MASTER_ADDR.
std::string local_address_towards(const sockaddr_storage& master) {
  const int fd = ::socket(master.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_storage probe = master;
  set_port(probe, 9);  // any port: nothing is sent
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  std::string out;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&probe), addr_len(probe)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    out = numeric_host(local);
  }
  ::close(fd);
  return out;
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  // Honour Gloo's usual interface override.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (master_addr == "127.0.0.1" || master_addr == "localhost" || master_addr == "::1") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  // The machine's host name may resolve to an address of another interface
  // (or of no interface at all inside a network namespace): bind where the
  // route to rank 0 leaves this machine instead.
  try {
    const std::string local = local_address_towards(resolve_master(master_addr, -1));
    if (!local.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname(local);
  } catch (const c10::Error&) {
    // Unresolvable: create() has reported that already.
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// The ProcessGroup around one backend, which serves CPU tensors and, for
// Gloo (which copies through host memory) and NCCL, CUDA tensors too.
c10::intrusive_ptr<c10d::ProcessGroup> wrap_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                    int64_t world, c10d::ProcessGroup::BackendType type,
                                                    const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(rank), static_cast<int>(world));
  group->setDefaultBackend(type);
  if (type == c10d::ProcessGroup::BackendType::GLOO) group->setBackend(c10::DeviceType::CPU, type, backend);
  group->setBackend(c10::DeviceType::CUDA, type, backend);
  return group;
}


// Rank 0's listening socket for the store on MASTER_ADDR:port. Failing here
// gives the reason in words (not a local address, port taken) instead of
// TCPStore's "failed to listen on any local network address".
int listen_on_master(const sockaddr_storage& master, const std::string& addr, int64_t port) {
  sockaddr_storage a = master;
  set_port(a, port);
  const int fd = ::socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "Communicator::create(): rank 0 cannot create a socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&a), addr_len(a)) != 0 || ::listen(fd, 1024) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EADDRNOTAVAIL) {
      TORCH_CHECK(false, "Communicator::create(): rank 0 cannot listen on MASTER_ADDR ", addr, " (",
                  numeric_host(master), "): it is not an address of this machine; rank 0 hosts the rendezvous "
                  "store, so MASTER_ADDR must name rank 0's machine");
    }
    if (err == EADDRINUSE) {
      TORCH_CHECK(false, "Communicator::create(): rank 0 cannot listen on MASTER_ADDR ", addr, ":", port,
                  ": the port is in use (another job, or a second process started as rank 0; pick another "
                  "MASTER_PORT)");
    }
    TORCH_CHECK(false, "Communicator::create(): rank 0 cannot listen on MASTER_ADDR ", addr, ":", port, ": ",
                std::strerror(err));
  }
  return fd;
}

// The rendezvous store, bound to MASTER_ADDR on rank 0 (never to every
// interface) and reached by the other ranks within `timeout`.
c10::intrusive_ptr<c10d::Store> make_tcp_store(const CommunicatorOptions& o, const sockaddr_storage& master,
                                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(o.master_port());
  so.isServer = o.rank() == 0;
  so.numWorkers = static_cast<size_t>(o.world_size());
  // Contrax's own rendezvous (below) waits for the workers, against one
  // deadline and naming the ranks that are missing.
  so.waitWorkers = false;
  so.timeout = timeout;
  // TCPStore defaults to a libuv server, which builds without libuv
  // (Debian's 2.6) refuse at run time, and which not every release lets
  // adopt a listening descriptor: the classic server, clients alike.
  so.useLibUV = false;
  const std::string host = numeric_host(master);
  if (o.external_store()) {
    so.isServer = false;
    try {
      return c10::make_intrusive<c10d::TCPStore>(host, so);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " could not reach the rendezvous store of "
                  "torchrun's agent at MASTER_ADDR ", o.master_addr(), ":", o.master_port(), " within ",
                  timeout.count(), " ms: ", cause_of(e.what()));
    }
  }
  if (o.rank() != 0) {
    try {
      return c10::make_intrusive<c10d::TCPStore>(host, so);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " could not reach the rendezvous store of rank 0 "
                  "at MASTER_ADDR ", o.master_addr(), ":", o.master_port(), " within ", timeout.count(),
                  " ms (rank 0 never started, failed before listening, or MASTER_ADDR/MASTER_PORT differ between "
                  "ranks): ", cause_of(e.what()));
    }
  }
  // TCPStore takes over the socket bound to MASTER_ADDR (never every interface).
  so.masterListenFd = listen_on_master(master, o.master_addr(), o.master_port());
  return c10::make_intrusive<c10d::TCPStore>(host, so);
}

// Every rank announces itself and its world size in the store, and waits
// (one deadline) until all ranks of its world have: a missing rank is named,
// a WORLD_SIZE that differs between ranks or a rank started twice is
// reported at once, never as a Gloo internal error or a timeout.
void rendezvous(c10d::Store& store, int64_t rank, int64_t world, std::chrono::steady_clock::time_point deadline,
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
    const std::string msg = "rank " + std::to_string(rank) + " was started twice (duplicate RANK " +
                            std::to_string(rank) + "; every process needs its own RANK in [0, WORLD_SIZE))";
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
    if (std::chrono::steady_clock::now() >= deadline) {
      TORCH_CHECK(false, "Communicator::create(): rank ", rank, " of ", world, ": rendezvous timed out after ",
                  timeout.count(), " ms; rank", missing.size() > 1 ? "s " : " ", join_ranks(missing),
                  missing.size() > 1 ? " never arrived" : " never arrived",
                  " (not started, failed before connecting, or given another MASTER_ADDR/MASTER_PORT)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int64_t env_int(const char* name, int64_t def, const char* expected) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0', "Communicator::from_env(): environment variable '", name, "' must be ",
              expected, ", but got '", v, "'");
  return x;
}

// The CUDA device an NCCL group stages CPU tensors through: the options'
// device when it is a CUDA one, else the calling thread's current device
// (the one NCCL itself uses when a collective names no device).
c10::Device nccl_stage_device(const c10::Device& requested) {
  if (requested.is_cuda() && requested.has_index()) return requested;
  const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return c10::Device(c10::DeviceType::CUDA, guard->getDevice().index());
}

bool needs_staging(const detail::CommunicatorImpl& impl, const torch::Tensor& t) {
  return impl.stage_device.has_value() && !t.is_cuda();
}

// LibTorch 2.13 renamed ProcessGroup's alltoall_base and _reduce_scatter_base
// to all_to_all_single and reduce_scatter_single (the old names stay, deprecated).
constexpr bool kSingleNames = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13);

template <typename PG = c10d::ProcessGroup>
c10::intrusive_ptr<c10d::Work> all_to_all_single(PG& pg, at::Tensor& out, at::Tensor& in,
                                                 std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits) {
  if constexpr (kSingleNames) return pg.all_to_all_single(out, in, out_splits, in_splits);
  else return pg.alltoall_base(out, in, out_splits, in_splits);
}

template <typename PG = c10d::ProcessGroup>
c10::intrusive_ptr<c10d::Work> reduce_scatter_single(PG& pg, at::Tensor& out, at::Tensor& in) {
  if constexpr (kSingleNames) return pg.reduce_scatter_single(out, in);
  else return pg._reduce_scatter_base(out, in);
}

}  // namespace

// Pending ring exchange: the two c10d work items and the receive buffer.
struct Communicator::Pending::State {
  c10::intrusive_ptr<c10d::Work> send_work, recv_work;
  torch::Tensor send_buffer;  // kept alive until the send completes
  torch::Tensor received;
  c10::optional<torch::Device> deliver_to;  // set when `received` is a host copy of a CUDA exchange
  const detail::CommunicatorImpl* impl = nullptr;
  bool done = false;
};

torch::Tensor Communicator::Pending::wait() {
  TORCH_CHECK(state_, "Communicator::Pending::wait(): this handle holds no transfer");
  if (!state_->done) {
    if (state_->send_work) wait_work(state_->send_work, "ring(send)", *state_->impl);
    if (state_->recv_work) wait_work(state_->recv_work, "ring(recv)", *state_->impl);
    state_->send_buffer = torch::Tensor();
    if (state_->deliver_to) state_->received = state_->received.to(*state_->deliver_to);
    state_->done = true;
  }
  return state_->received;
}

Communicator::Communicator(std::unique_ptr<detail::CommunicatorImpl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() {
  // Destroyed while an exception unwinds: this rank is failing, and tearing
  // down its process group is about to make its peers' collectives fail.
  // Recorded first, so the launcher blames this rank, not the peers that
  // may exit before it.
  if (std::uncaught_exceptions() > 0 && impl_ && impl_->world_size > 1) {
    record_worker_failure(/*caused_by_peer=*/false, "failed with an exception on rank " + std::to_string(impl_->rank));
  }
}

std::shared_ptr<Communicator> Communicator::single() {
  return std::shared_ptr<Communicator>(new Communicator(std::make_unique<detail::CommunicatorImpl>()));
}

std::shared_ptr<Communicator> Communicator::create(const CommunicatorOptions& o) {
  TORCH_CHECK(o.world_size() >= 1, "Communicator::create(): argument 'world_size' must be >= 1, but got ",
              o.world_size());
  TORCH_CHECK(o.rank() >= 0 && o.rank() < o.world_size(), "Communicator::create(): argument 'rank' must be in [0, ",
              o.world_size(), "), but got ", o.rank());
  TORCH_CHECK(o.timeout().count() > 0, "Communicator::create(): argument 'timeout' must be positive, but got ",
              o.timeout().count(), " ms");
  const std::string backend_req = lower(o.backend());
  TORCH_CHECK(backend_req == "auto" || backend_req == "gloo" || backend_req == "nccl" || backend_req == "mpi",
              "Communicator::create(): argument 'backend' must be one of auto, gloo, nccl, mpi, but got '",
              o.backend(), "'");
  if (o.file_store().empty()) {
    TORCH_CHECK(o.master_port() > 0 && o.master_port() < 65536,
                "Communicator::create(): argument 'master_port' must be in [1, 65535], but got ", o.master_port());
  }
  auto impl = std::make_unique<detail::CommunicatorImpl>();
  impl->rank = o.rank();
  impl->world_size = o.world_size();
  impl->local_rank = o.rank();
  impl->timeout = o.timeout();
  if (o.world_size() == 1) {
    return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
  }

  std::string backend = backend_req;
  if (backend == "auto") backend = o.device().is_cuda() ? "nccl" : "gloo";
#ifdef USE_C10D_NCCL
  // Before any rendezvous: NCCL cannot start without a GPU, and its own
  // error would come only after the peers have gathered.
  TORCH_CHECK(backend != "nccl" || torch::cuda::is_available(), "Communicator::create(): backend 'nccl' needs a "
              "CUDA device, but this machine has none; use backend 'gloo'");
#endif

  if (backend == "mpi") {
#ifdef CONTRAX_HAVE_MPI
    auto mpi = c10d::ProcessGroupMPI::createProcessGroupMPI();
    auto group = c10::make_intrusive<c10d::ProcessGroup>(static_cast<int>(mpi->getRank()),
                                                         static_cast<int>(mpi->getSize()));
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::MPI);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::MPI, mpi);
    impl->group = group;
    impl->backend = "mpi";
    return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
#else
    TORCH_CHECK(false, "Communicator::create(): argument 'backend' is 'mpi', but this build has no MPI (LibTorch "
                "without MPI, or mpi.h not installed)");
#endif
  }

  // Rendezvous: one deadline for all of it, so that a missing peer is
  // reported after `timeout`, not after the store's and then Gloo's.
  const auto deadline = std::chrono::steady_clock::now() + o.timeout();
  c10::intrusive_ptr<c10d::Store> store;
  if (!o.file_store().empty()) {
    store = c10::make_intrusive<c10d::FileStore>(o.file_store(), static_cast<int>(o.world_size()));
  } else {
    const sockaddr_storage master = resolve_master(o.master_addr(), o.rank());
    store = make_tcp_store(o, master, o.timeout());
    store->setTimeout(o.timeout());
    if (!o.store_prefix().empty()) store = c10::make_intrusive<c10d::PrefixStore>(o.store_prefix(), store);
    try {
      rendezvous(*store, o.rank(), o.world_size(), deadline, o.timeout());
    } catch (const std::exception& e) {
      const std::string m = e.what();
      if (m.find("Communicator::create()") != std::string::npos) throw;
      // The store went away under us: its host stopped during the rendezvous.
      TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " lost the rendezvous store at MASTER_ADDR ",
                  o.master_addr(), ":", o.master_port(), " (", cause_of(m), "): ",
                  o.external_store() ? "torchrun's agent stopped serving it"
                                     : "rank 0 stopped during the rendezvous; its own error says why");
    }
  }
  store->setTimeout(o.timeout());
  impl->store = store;
  impl->external_store = o.external_store();

  try {
    if (backend == "gloo") {
      auto opts = c10d::ProcessGroupGloo::Options::create();
      opts->timeout = o.timeout();
      opts->devices.push_back(gloo_device(o.master_addr()));
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(o.rank()),
                                                             static_cast<int>(o.world_size()), opts);
      impl->group = wrap_backend(store, o.rank(), o.world_size(), c10d::ProcessGroup::BackendType::GLOO, gloo);
      impl->backend = "gloo";
    } else {
#ifdef USE_C10D_NCCL
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = o.timeout();
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(o.rank()),
                                                             static_cast<int>(o.world_size()), opts);
      impl->group = wrap_backend(store, o.rank(), o.world_size(), c10d::ProcessGroup::BackendType::NCCL, nccl);
      impl->backend = "nccl";
      impl->stage_device = nccl_stage_device(o.device());
#else
      TORCH_CHECK(false,
                  "Communicator::create(): backend 'nccl' was requested (or implied by a CUDA device), but this "
                  "LibTorch was built without NCCL; use backend 'gloo'");
#endif
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " of ", o.world_size(),
                " could not build the process group within ", o.timeout().count(),
                " ms (a peer may never have arrived): ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "Communicator::create(): rank ", o.rank(), " of ", o.world_size(),
                " could not build the process group within ", o.timeout().count(), " ms: ", e.what());
  }
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
}

std::vector<std::string> expand_slurm_nodelist(const std::string& list) {
  constexpr size_t kMaxHosts = 1 << 20;  // a corrupt range must not allocate without bound
  std::vector<std::string> hosts;
  // Split at top-level commas (commas inside brackets separate ranges).
  std::vector<std::string> entries;
  int depth = 0;
  std::string cur;
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    TORCH_CHECK(depth >= 0 && depth <= 1, "expand_slurm_nodelist(): unbalanced or nested brackets in '", list, "'");
    if (c == ',' && depth == 0) {
      entries.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  TORCH_CHECK(depth == 0, "expand_slurm_nodelist(): unbalanced brackets in '", list, "'");
  entries.push_back(cur);
  for (const auto& entry : entries) {
    if (entry.empty()) continue;
    // Expand bracket groups left to right: "rack[1-2]-n[01,03]" has four hosts.
    std::vector<std::string> partial{""};
    size_t pos = 0;
    while (pos < entry.size()) {
      const size_t open = entry.find('[', pos);
      const std::string literal = entry.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
      for (auto& p : partial) p += literal;
      if (open == std::string::npos) break;
      const size_t close = entry.find(']', open);
      std::vector<std::string> items;
      std::stringstream ranges(entry.substr(open + 1, close - open - 1));
      std::string range;
      while (std::getline(ranges, range, ',')) {
        const size_t dash = range.find('-');
        const std::string lo = range.substr(0, dash);
        const std::string hi = dash == std::string::npos ? lo : range.substr(dash + 1);
        TORCH_CHECK(!lo.empty() && !hi.empty() && lo.find_first_not_of("0123456789") == std::string::npos &&
                        hi.find_first_not_of("0123456789") == std::string::npos && lo.size() <= 9 && hi.size() <= 9,
                    "expand_slurm_nodelist(): range '", range, "' in '", list, "' is not N or N-M");
        const long a = std::stol(lo), b = std::stol(hi);
        TORCH_CHECK(a <= b, "expand_slurm_nodelist(): range '", range, "' in '", list, "' is descending");
        TORCH_CHECK(static_cast<size_t>(b - a) < kMaxHosts, "expand_slurm_nodelist(): range '", range, "' in '",
                    list, "' is too long");
        for (long v = a; v <= b; ++v) {
          std::string num = std::to_string(v);
          // SLURM keeps the zero padding of the lower bound: node[01-10].
          if (num.size() < lo.size()) num = std::string(lo.size() - num.size(), '0') + num;
          items.push_back(num);
        }
      }
      std::vector<std::string> next;
      for (const auto& p : partial) {
        for (const auto& it : items) next.push_back(p + it);
      }
      TORCH_CHECK(next.size() <= kMaxHosts, "expand_slurm_nodelist(): '", list, "' names too many hosts");
      partial.swap(next);
      pos = close + 1;
    }
    hosts.insert(hosts.end(), partial.begin(), partial.end());
    TORCH_CHECK(hosts.size() <= kMaxHosts, "expand_slurm_nodelist(): '", list, "' names too many hosts");
  }
  return hosts;
}

int64_t slurm_default_master_port() {
  const char* job = std::getenv("SLURM_JOB_ID");
  if (job == nullptr || *job == '\0') return 29500;
  char* end = nullptr;
  const unsigned long long id = std::strtoull(job, &end, 10);
  return end != job && *end == '\0' ? 29500 + static_cast<int64_t>(id % 1000) : 29500;
}

std::shared_ptr<Communicator> Communicator::from_env(const CommunicatorOptions& base) {
  // torchrun's variables win; SLURM's are the fallback, so that `srun` starts
  // a job without a launcher and a launcher inside an allocation still works.
  const bool torchrun = std::getenv("WORLD_SIZE") != nullptr && *std::getenv("WORLD_SIZE") != '\0';
  const bool slurm = !torchrun && std::getenv("SLURM_NTASKS") != nullptr && *std::getenv("SLURM_NTASKS") != '\0';
  const char* world_var = slurm ? "SLURM_NTASKS" : "WORLD_SIZE";
  const char* rank_var = slurm ? "SLURM_PROCID" : "RANK";
  const char* local_var = slurm ? "SLURM_LOCALID" : "LOCAL_RANK";
  const int64_t world = env_int(world_var, 1, "a positive integer");
  TORCH_CHECK(world >= 1, "Communicator::from_env(): environment variable '", world_var,
              "' must be a positive integer, but got ", world);
  const int64_t rank = env_int(rank_var, 0, "an integer in [0, WORLD_SIZE)");
  TORCH_CHECK(rank >= 0 && rank < world, "Communicator::from_env(): environment variable '", rank_var,
              "' must be in [0, ", world, "), but got ", rank);
  const int64_t local_rank = env_int(local_var, rank, "a non-negative integer");
  CommunicatorOptions o = base;
  o.rank(rank).world_size(world);
  if (world > 1) {
    const char* addr = std::getenv("MASTER_ADDR");
    std::string master = addr != nullptr ? addr : "";
    if (slurm && master.empty()) {
      const char* list = std::getenv("SLURM_JOB_NODELIST");
      if (list == nullptr || *list == '\0') list = std::getenv("SLURM_NODELIST");
      TORCH_CHECK(list != nullptr && *list != '\0', "Communicator::from_env(): under SLURM (SLURM_NTASKS=", world,
                  ") either MASTER_ADDR or SLURM_JOB_NODELIST must be set");
      const auto hosts = expand_slurm_nodelist(list);
      TORCH_CHECK(!hosts.empty(), "Communicator::from_env(): SLURM_JOB_NODELIST '", list, "' names no host");
      master = hosts.front();
    }
    TORCH_CHECK(!master.empty(),
                "Communicator::from_env(): environment variable 'MASTER_ADDR' must be set when WORLD_SIZE > 1");
    int64_t port = 0;
    if (slurm && std::getenv("MASTER_PORT") == nullptr) {
      port = slurm_default_master_port();
    } else {
      TORCH_CHECK(std::getenv("MASTER_PORT") != nullptr,
                  "Communicator::from_env(): environment variable 'MASTER_PORT' must be set when WORLD_SIZE > 1");
      port = env_int("MASTER_PORT", 0, "a port number");
    }
    o.master_addr(master).master_port(port);
    // torchrun's agent serves the store on MASTER_ADDR:MASTER_PORT and says so;
    // it keeps serving it across restarts, so each attempt has its own keys.
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (agent != nullptr && std::string(agent) == "True") {
      const int64_t attempt = env_int("TORCHELASTIC_RESTART_COUNT", 0, "a non-negative integer");
      o.external_store(true).store_prefix("contrax/attempt_" + std::to_string(attempt) + "/");
    }
  }
  auto comm = create(o);
  comm->impl_->local_rank = local_rank;
  return comm;
}

int64_t Communicator::rank() const { return impl_->rank; }
int64_t Communicator::world_size() const { return impl_->world_size; }
int64_t Communicator::local_rank() const { return impl_->local_rank; }
std::string Communicator::backend() const { return impl_->backend; }
std::chrono::milliseconds Communicator::timeout() const { return impl_->timeout; }

void Communicator::record(const std::string& name, int64_t bytes_sent, int64_t calls) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  auto& s = stats_.ops[name];
  s.calls += calls;
  s.bytes_sent += bytes_sent;
}

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

void Communicator::reset_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_ = CommStats();
}

torch::Tensor Communicator::all_gather_rows(const torch::Tensor& local, const std::vector<int64_t>& counts,
                                            const std::string& stat_name) {
  const int64_t W = world_size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W, "all_gather_rows: counts has ", counts.size(),
                        " entries for world size ", W);
  TORCH_INTERNAL_ASSERT(local.dim() >= 1 && local.size(0) == counts[rank()]);
  if (W == 1) return local;
  if (needs_staging(*impl_, local)) {
    return all_gather_rows(local.to(*impl_->stage_device), counts, stat_name).to(local.device());
  }
  int64_t total = 0;
  for (auto c : counts) total += c;
  auto shape = local.sizes().vec();
  shape[0] = total;
  auto out = torch::empty(shape, local.options());
  if (total == 0) return out;
  auto src = local.contiguous();
  auto& pg = *impl_->group;
  if (all_equal(counts)) {
    // Gloo copies into the output list; views into one buffer avoid a cat.
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int64_t s = 0; s < W; ++s) outputs[0].push_back(out.narrow(0, s * counts[0], counts[0]));
    std::vector<at::Tensor> inputs{src};
    wait_work(pg.allgather(outputs, inputs), "all_gather", *impl_);
  } else {
    // Uneven rows: an all-to-all whose input is our rows once per destination
    // moves exactly each rank's rows to every other rank, with no padding.
    auto rep_shape = local.sizes().vec();
    rep_shape.insert(rep_shape.begin(), W);
    auto input = src.unsqueeze(0).expand(rep_shape).contiguous().view(
        [&] { auto s = local.sizes().vec(); s[0] = W * local.size(0); return s; }());
    std::vector<int64_t> in_splits(W, local.size(0));
    std::vector<int64_t> out_splits(counts.begin(), counts.end());
    wait_work(all_to_all_single(pg, out, input, out_splits, in_splits), "all_gather", *impl_);
  }
  record(stat_name, (W - 1) * local.size(0) * row_bytes(local));
  return out;
}

torch::Tensor Communicator::reduce_scatter_rows(const torch::Tensor& full, const std::vector<int64_t>& counts,
                                                const std::string& stat_name) {
  const int64_t W = world_size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W);
  if (W == 1) return full;
  if (needs_staging(*impl_, full)) {
    return reduce_scatter_rows(full.to(*impl_->stage_device), counts, stat_name).to(full.device());
  }
  const int64_t mine = counts[rank()];
  int64_t total = 0;
  for (auto c : counts) total += c;
  TORCH_INTERNAL_ASSERT(full.size(0) == total, "reduce_scatter_rows: ", full.size(0), " rows, expected ", total);
  auto shape = full.sizes().vec();
  shape[0] = mine;
  if (total == 0) return torch::zeros(shape, full.options());
  auto src = full.contiguous();
  auto& pg = *impl_->group;
  torch::Tensor result;
  if (impl_->backend == "nccl" && all_equal(counts)) {
    result = torch::empty(shape, full.options());
    wait_work(reduce_scatter_single(pg, result, src), "reduce_scatter", *impl_);
  } else {
    // Gloo has no true reduce-scatter: its reduce_scatter_tensor sends an all-reduce's bytes, twice the volume
    // (measured: python/bench/gloo_reduce_scatter_bytes.py). So every rank
    // sends slice s to rank s (all-to-all) and sums the W contributions it
    // received. Volume: total - mine rows sent, the reduce-scatter's.
    auto recv_shape = full.sizes().vec();
    recv_shape[0] = W * mine;
    auto recv = torch::empty(recv_shape, full.options());
    std::vector<int64_t> out_splits(W, mine);
    std::vector<int64_t> in_splits(counts.begin(), counts.end());
    wait_work(all_to_all_single(pg, recv, src, out_splits, in_splits), "reduce_scatter", *impl_);
    auto parts = recv.view([&] {
      auto s = full.sizes().vec();
      s[0] = mine;
      s.insert(s.begin(), W);
      return s;
    }());
    result = parts.sum(0);
  }
  record(stat_name, (total - mine) * row_bytes(full));
  return result;
}

void Communicator::all_reduce_sum(torch::Tensor& tensor, const std::string& stat_name) {
  const int64_t W = world_size();
  if (W == 1) return;
  TORCH_CHECK(tensor.is_contiguous(), "Communicator::all_reduce_sum(): argument 'tensor' must be contiguous");
  if (needs_staging(*impl_, tensor)) {
    auto staged = tensor.to(*impl_->stage_device);
    all_reduce_sum(staged, stat_name);
    tensor.copy_(staged);
    return;
  }
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_work(impl_->group->allreduce(ts, opts), "all_reduce", *impl_);
  record(stat_name, 2 * (W - 1) * tensor.numel() * tensor.element_size() / W);
}

std::vector<std::vector<int64_t>> Communicator::all_gather_ints(const std::vector<int64_t>& values,
                                                                const std::string& stat_name) {
  const int64_t W = world_size();
  if (W == 1) return {values};
  const int64_t n = static_cast<int64_t>(values.size());
  auto local = torch::tensor(values, torch::kInt64);
  // A length mismatch would corrupt the gather; lead every vector by its length
  // so that a caller bug shows up as an internal assert, not garbage.
  auto framed = torch::cat({torch::tensor({n}, torch::kInt64), local});
  std::vector<int64_t> counts(W, 1);
  auto all = all_gather_rows(framed.unsqueeze(0), counts, stat_name);
  std::vector<std::vector<int64_t>> out(W);
  auto acc = all.accessor<int64_t, 2>();
  for (int64_t s = 0; s < W; ++s) {
    TORCH_INTERNAL_ASSERT(acc[s][0] == n, "all_gather_ints: rank ", s, " sent ", acc[s][0], " values, expected ", n);
    for (int64_t i = 0; i < n; ++i) out[s].push_back(acc[s][i + 1]);
  }
  return out;
}

void Communicator::broadcast(torch::Tensor& tensor, int64_t root, const std::string& stat_name) {
  if (world_size() == 1) return;
  TORCH_CHECK(root >= 0 && root < world_size(), "Communicator::broadcast(): argument 'root' must be in [0, ",
              world_size(), "), but got ", root);
  TORCH_CHECK(tensor.is_contiguous(), "Communicator::broadcast(): argument 'tensor' must be contiguous");
  if (needs_staging(*impl_, tensor)) {
    auto staged = tensor.to(*impl_->stage_device);
    broadcast(staged, root, stat_name);
    tensor.copy_(staged);
    return;
  }
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  wait_work(impl_->group->broadcast(ts, opts), "broadcast", *impl_);
  record(stat_name, rank() == root ? tensor.numel() * tensor.element_size() : 0);
}

Communicator::Pending Communicator::ring_exchange_async(const torch::Tensor& send, at::IntArrayRef recv_shape,
                                                        int64_t shift, const std::string& stat_name) {
  const int64_t W = world_size();
  Pending p;
  p.state_ = std::make_shared<Pending::State>();
  p.state_->impl = impl_.get();
  const int64_t s = ((shift % W) + W) % W;
  if (W == 1 || s == 0) {
    TORCH_INTERNAL_ASSERT(send.sizes() == recv_shape, "ring_exchange: a self-exchange must keep the shape");
    p.state_->received = send;
    p.state_->done = true;
    return p;
  }
  const int dst = static_cast<int>((rank() + s) % W);
  const int src = static_cast<int>((rank() - s + W) % W);
  // Every rank calls ring exchanges in the same order, so a per-communicator
  // counter gives matching tags without any negotiation.
  static_assert(sizeof(int) >= 4, "");
  const int tag = static_cast<int>(ring_tag_++ & 0x3fffffff);
  // Gloo's send/recv hand the tensor's pointer to its TCP transport as host
  // memory (its collectives stage CUDA tensors; its point-to-point does not):
  // a CUDA exchange over Gloo goes through host copies both ways.
  const bool via_host = send.is_cuda() && impl_->backend == "gloo";
  p.state_->send_buffer = via_host ? send.to(torch::kCPU).contiguous() : send.contiguous();
  p.state_->received = torch::empty(recv_shape, send.options().device(via_host ? torch::Device(torch::kCPU)
                                                                                : send.device()));
  if (via_host) p.state_->deliver_to = send.device();
  std::vector<at::Tensor> sv{p.state_->send_buffer}, rv{p.state_->received};
  if (p.state_->send_buffer.numel() > 0) p.state_->send_work = impl_->group->send(sv, dst, tag);
  if (p.state_->received.numel() > 0) p.state_->recv_work = impl_->group->recv(rv, src, tag);
  record(stat_name, send.numel() * send.element_size());
  return p;
}

torch::Tensor Communicator::ring_exchange(const torch::Tensor& send, at::IntArrayRef recv_shape, int64_t shift,
                                          const std::string& stat_name) {
  return ring_exchange_async(send, recv_shape, shift, stat_name).wait();
}

void Communicator::barrier() {
  if (world_size() == 1) return;
  wait_work(impl_->group->barrier(), "barrier", *impl_);
}

void with_collective_context(const Communicator& comm, const std::string& op, const std::function<void()>& fn) {
  std::string raw;
  try {
    fn();
    return;
  } catch (const c10::Error& e) {
    raw = e.what_without_backtrace();
    if (comm.world_size() == 1 || !is_transport_failure(raw)) throw;
  } catch (const std::exception& e) {
    // Autograd may carry a backward-time failure as a plain std::exception.
    raw = e.what();
    if (comm.world_size() == 1 || !is_transport_failure(raw)) throw;
  }
  fail_collective(raw, op, comm.impl());
}

namespace detail {

std::shared_ptr<Communicator> wrap_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                 std::chrono::milliseconds timeout) {
  auto comm = Communicator::single();
  if (!group || group->getSize() == 1) return comm;
  auto& impl = comm->impl();
  impl.rank = group->getRank();
  impl.world_size = group->getSize();
  impl.local_rank = impl.rank;
  impl.timeout = timeout;
  impl.backend = lower(group->getBackendName());
  if (impl.backend == "nccl") impl.stage_device = nccl_stage_device(torch::kCPU);
  impl.group = std::move(group);
  return comm;
}

c10::intrusive_ptr<c10d::ProcessGroup> process_group(const Communicator& comm) { return comm.impl().group; }

std::unique_ptr<c10d::Reducer> make_reducer(const Communicator& comm, const std::vector<at::Tensor>& params,
                                            int64_t first_bucket_bytes, int64_t bucket_bytes,
                                            bool find_unused_parameters, bool gradient_as_bucket_view,
                                            std::unordered_map<size_t, std::string> names) {
  auto group = comm.impl().group;
  TORCH_INTERNAL_ASSERT(group, "make_reducer(): world size ", comm.world_size(), " but no process group");
  // As torch.nn.parallel.DistributedDataParallel: buckets of [first cap,
  // cap] bytes, in reverse (gradients become ready roughly in reverse
  // registration order).
  std::vector<bool> expect_sparse(params.size(), false);
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> limits;
  std::tie(buckets, limits) = c10d::compute_bucket_assignment_by_size(
      params, {static_cast<size_t>(first_bucket_bytes), static_cast<size_t>(bucket_bytes)}, expect_sparse);
  std::reverse(buckets.begin(), buckets.end());
  std::reverse(limits.begin(), limits.end());
  // The constructor's arguments, by release: 2.6 takes the per-bucket size
  // limits third; 2.7 dropped them; 2.8 added skip_all_reduce_unused_params
  // and use_python_reducer; 2.11 added bucket_bytes_cap_list (empty: the
  // Reducer's own limits when it rebuilds its buckets).
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 7
  return std::make_unique<c10d::Reducer>(params, std::move(buckets), limits, group, expect_sparse, bucket_bytes,
                                         find_unused_parameters, gradient_as_bucket_view, std::move(names),
                                         first_bucket_bytes);
#elif TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 8
  return std::make_unique<c10d::Reducer>(params, std::move(buckets), group, expect_sparse, bucket_bytes,
                                         find_unused_parameters, gradient_as_bucket_view, std::move(names),
                                         first_bucket_bytes);
#elif TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 11
  return std::make_unique<c10d::Reducer>(params, std::move(buckets), group, expect_sparse, bucket_bytes,
                                         find_unused_parameters, gradient_as_bucket_view, std::move(names),
                                         first_bucket_bytes, /*skip_all_reduce_unused_params=*/false,
                                         /*use_python_reducer=*/false);
#else
  return std::make_unique<c10d::Reducer>(params, std::move(buckets), group, expect_sparse, bucket_bytes,
                                         find_unused_parameters, gradient_as_bucket_view, std::move(names),
                                         first_bucket_bytes, /*skip_all_reduce_unused_params=*/false,
                                         /*use_python_reducer=*/false, /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
#endif
}

}  // namespace detail
}  // namespace contrax
