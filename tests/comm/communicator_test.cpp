// Communicator: construction from options and environment, world 1 without a
// process group, the raw collectives (even, uneven, empty ranks), byte
// accounting, and the errors a user can cause (including a peer that never
// arrives, which must end in a timeout error rather than a hang).
#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "contrax/comm/communicator.h"
#include "contrax/comm/detail/c10d.h"
#include "contrax/launch/launcher.h"
#include "comm/sigpipe.h"
#include "util/cuda_side.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::run_ranks;
using contrax::testing::run_ranks_collect_errors;

TEST(Communicator, WorldOfOneHasNoProcessGroup) {
  auto comm = Communicator::single();
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->backend(), "none");
  EXPECT_FALSE(contrax::detail::process_group(*comm));
  auto x = torch::randn({3, 2});
  EXPECT_TRUE(comm->all_gather_rows(x, {3}).equal(x));
  EXPECT_TRUE(comm->reduce_scatter_rows(x, {3}).equal(x));
  comm->barrier();
  EXPECT_EQ(comm->stats().total_bytes_sent(), 0);
  // create() with world_size 1 does no rendezvous either (an unusable port is fine).
  auto c2 = Communicator::create(CommunicatorOptions().world_size(1).master_port(1));
  EXPECT_FALSE(contrax::detail::process_group(*c2));
}

TEST(Communicator, FromEnvWithoutWorldSizeIsSingle) {
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  auto comm = Communicator::from_env();
  EXPECT_EQ(comm->world_size(), 1);
}

TEST(Communicator, FromEnvErrorsNameTheVariable) {
  ::setenv("WORLD_SIZE", "two", 1);
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'WORLD_SIZE' must be a positive integer");
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "5", 1);
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'RANK' must be in [0, 2), but got 5");
  ::setenv("RANK", "1", 1);
  ::unsetenv("MASTER_ADDR");
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'MASTER_ADDR' must be set");
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::unsetenv("MASTER_PORT");
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'MASTER_PORT' must be set");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  ::unsetenv("MASTER_ADDR");
}

TEST(Communicator, CreateErrorsNameTheArgument) {
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(0)),
                       "argument 'world_size' must be >= 1, but got 0");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).rank(2)),
                       "argument 'rank' must be in [0, 2), but got 2");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).backend("ucx")),
                       "argument 'backend' must be one of auto, gloo, nccl, mpi, but got 'ucx'");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).master_port(70000)),
                       "argument 'master_port' must be in [1, 65535], but got 70000");
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).timeout(std::chrono::milliseconds(0))),
                       "argument 'timeout' must be positive");
  const auto nccl = [] {
    return Communicator::create(CommunicatorOptions().world_size(2).backend("nccl").file_store(
        "/tmp/contrax_nccl_probe_" + std::to_string(::getpid())));
  };
  if (contrax::detail::cuda_side_function("nccl_backend") != nullptr) {
    // A CUDA build: NCCL is there, and refused at once where there is no GPU.
    if (contrax::detail::cuda_device_count() == 0) {
      CONTRAX_EXPECT_ERROR(nccl(), "backend 'nccl' needs a CUDA device, but this machine has none; use backend 'gloo'");
    }
  } else {
    CONTRAX_EXPECT_ERROR(nccl(),
                         "backend 'nccl' was requested (or implied by a CUDA device), but this build has no "
                         "NCCL (the CUDA side: " +
                             contrax::detail::cuda_side_origin() + "); use backend 'gloo'");
  }
}

TEST(Communicator, PeerThatNeverArrivesTimesOut) {
  // Rank 0 of 2 alone: the rendezvous must give up after the timeout.
  auto path = std::string("/tmp/contrax_lonely_") + std::to_string(::getpid());
  std::remove(path.c_str());
  auto start = std::chrono::steady_clock::now();
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().world_size(2).rank(0).file_store(path).timeout(
                           std::chrono::milliseconds(1500))),
                       "could not build the process group within 1500 ms");
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 30.0);
  std::remove(path.c_str());
}

TEST(Communicator, CollectiveWithMissingPeerTimesOut) {
  // Both ranks rendezvous, then only rank 0 enters a gather: rank 0 must get
  // an error naming the collective once the timeout passes.
  auto errors = run_ranks_collect_errors(
      2,
      [](const CommunicatorPtr& comm) {
        if (comm->rank() == 0) comm->all_gather_rows(torch::ones({2, 3}), {2, 2});
      },
      std::chrono::milliseconds(1500));
  EXPECT_NE(errors[0].find("collective 'all_gather' "), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find(" on rank 0 of 2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("rank 1 did not answer"), std::string::npos) << errors[0];
  EXPECT_TRUE(errors[1].empty()) << errors[1];
}

namespace {

// This process's threads (/proc/self/task).
std::set<pid_t> thread_ids() {
  std::set<pid_t> ids;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    ids.insert(static_cast<pid_t>(std::stol(e.path().filename().string())));
  }
  return ids;
}

// Whether thread `tid` blocks SIGPIPE (the SigBlk mask of its /proc status).
bool blocks_sigpipe(pid_t tid) {
  std::ifstream status("/proc/self/task/" + std::to_string(tid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("SigBlk:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> (SIGPIPE - 1)) & 1;
  }
  ADD_FAILURE() << "no SigBlk line for thread " << tid;
  return false;
}

}  // namespace

// Gloo writes with writev, so a write to a peer that has gone raises SIGPIPE,
// whose default action ended a surviving rank of a C++ program without a word.
// The threads Gloo starts (its event loop and the group's workers, which do
// the writing) block SIGPIPE, so the write fails and the collective reports
// the closed connection; the caller's own mask and the process's disposition
// of SIGPIPE stay as they were.
TEST(Communicator, GlooThreadsBlockSigpipeAndTheCallerKeepsItsMask) {
  at::parallel_for(0, 1 << 16, 1, [](int64_t, int64_t) {});  // the intra-op pool is not Gloo's
  const auto before = thread_ids();
  std::mutex mutex;
  std::set<pid_t> rank_threads;
  std::array<int, 2> caller_blocks = {-1, -1};
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    {
      const std::lock_guard<std::mutex> lock(mutex);
      rank_threads.insert(::gettid());
    }
    caller_blocks[comm->rank()] = blocks_sigpipe(::gettid());
    comm->barrier();
    if (comm->rank() == 0) {
      std::vector<pid_t> gloo;
      for (pid_t t : thread_ids()) {
        if (!before.count(t) && !rank_threads.count(t)) gloo.push_back(t);
      }
      EXPECT_GE(gloo.size(), 2u);  // per rank at least the device's loop and a worker
      for (pid_t t : gloo) EXPECT_TRUE(blocks_sigpipe(t)) << "thread " << t;
    }
    comm->barrier();
  });
  EXPECT_EQ(caller_blocks, (std::array<int, 2>{0, 0}));
  struct sigaction now {};
  ::sigaction(SIGPIPE, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
}

// A point-to-point send writes on the caller's thread (comm/sigpipe.h): a
// write to a closed pipe while SigpipeBlocked lives fails with EPIPE, and the
// SIGPIPE it raised is discarded at the end, not taken when the mask is
// restored.
TEST(Communicator, ASigpipeRaisedWhileBlockedIsDiscarded) {
  static std::atomic<int> taken{0};
  struct sigaction count {}, old {};
  count.sa_handler = [](int) { taken++; };
  sigemptyset(&count.sa_mask);
  ::sigaction(SIGPIPE, &count, &old);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ::close(fds[0]);
  {
    const contrax::detail::SigpipeBlocked blocked;
    EXPECT_EQ(::write(fds[1], "x", 1), -1);
    EXPECT_EQ(errno, EPIPE);
    EXPECT_TRUE(blocks_sigpipe(::gettid()));
  }
  ::close(fds[1]);
  EXPECT_FALSE(blocks_sigpipe(::gettid()));
  ::sigaction(SIGPIPE, &old, nullptr);
  EXPECT_EQ(taken.load(), 0);
}

class CommunicatorWorld : public ::testing::TestWithParam<int64_t> {};

TEST_P(CommunicatorWorld, GatherAndReduceScatterEvenAndUneven) {
  const int64_t W = GetParam();
  for (bool even : {true, false}) {
    std::vector<int64_t> counts;
    for (int64_t r = 0; r < W; ++r) counts.push_back(even ? 3 : (r * 2 + 1) % 5);  // uneven includes 0 at W>=3
    int64_t B = 0;
    for (auto c : counts) B += c;
    auto global = torch::arange(B * 4, torch::kDouble).view({B, 4});
    run_ranks(W, [&](const CommunicatorPtr& comm) {
      const int64_t r = comm->rank();
      auto mine = contrax::testing::shard(global, counts, r).clone();
      auto all = comm->all_gather_rows(mine, counts);
      EXPECT_TRUE(all.equal(global)) << "W=" << W << " rank " << r;
      // Reduce-scatter of (rank+1) * global: slice r of the sum over ranks.
      auto contrib = global * static_cast<double>(r + 1);
      auto got = comm->reduce_scatter_rows(contrib, counts);
      auto want = contrax::testing::shard(global, counts, r) * static_cast<double>(W * (W + 1) / 2);
      EXPECT_TRUE(got.allclose(want)) << "W=" << W << " rank " << r;
      // Byte accounting: all-gather sends our rows to W-1 peers; reduce-scatter
      // sends everything but our own slice.
      auto st = comm->stats();
      EXPECT_EQ(st.op("all_gather").bytes_sent, (W - 1) * counts[r] * 4 * 8);
      EXPECT_EQ(st.op("reduce_scatter").bytes_sent, (B - counts[r]) * 4 * 8);
    });
  }
}

TEST_P(CommunicatorWorld, AllReduceBroadcastRingAndInts) {
  const int64_t W = GetParam();
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    auto t = torch::full({5}, static_cast<double>(r), torch::kDouble);
    comm->all_reduce_sum(t);
    EXPECT_TRUE(t.equal(torch::full({5}, static_cast<double>(W * (W - 1) / 2))));
    auto b = torch::full({3}, static_cast<double>(r + 10));
    comm->broadcast(b, W - 1);
    EXPECT_TRUE(b.equal(torch::full({3}, static_cast<double>(W - 1 + 10))));
    auto ints = comm->all_gather_ints({r, 2 * r});
    ASSERT_EQ(static_cast<int64_t>(ints.size()), W);
    for (int64_t s = 0; s < W; ++s) EXPECT_EQ(ints[s], (std::vector<int64_t>{s, 2 * s}));
    // Ring: each rank sends r and receives from the left neighbour.
    auto recv = comm->ring_exchange(torch::full({2, 2}, static_cast<double>(r)), {2, 2}, 1);
    EXPECT_TRUE(recv.equal(torch::full({2, 2}, static_cast<double>((r - 1 + W) % W))));
    auto pending = comm->ring_exchange_async(torch::full({1}, static_cast<double>(r)), {1}, -1);
    EXPECT_EQ(pending.wait().item<double>(), static_cast<double>((r + 1) % W));
    comm->barrier();
    if (W > 1) {
      EXPECT_EQ(comm->stats().op("all_reduce").bytes_sent, 2 * (W - 1) * 5 * 8 / W);
      EXPECT_EQ(comm->stats().op("ring").calls, 2);
    }
  });
}

// Ring steps over both transports: blocks whose row counts differ by rank
// (an empty one among them), shifts forward, backward and by two, and two
// exchanges in flight at once; each block arrives whole, and the bytes
// counted are the payload either way.
TEST_P(CommunicatorWorld, RingExchangeOverSendRecvAndAllToAll) {
  const int64_t W = GetParam();
  for (auto transport : {RingTransport::kSendRecv, RingTransport::kAllToAll}) {
    auto block = [](int64_t rank) {
      const int64_t n = rank == 2 ? 0 : 1 + 2 * (rank % 2);  // 1, 3, 0 and 3 rows
      return torch::arange(n * 3, torch::kDouble).view({n, 3}) + 100.0 * static_cast<double>(rank);
    };
    run_ranks(
        W,
        [&](const CommunicatorPtr& comm) {
          const int64_t r = comm->rank();
          int64_t bytes = 0;
          for (int64_t shift : {1, -1, 2}) {
            const int64_t from = ((r - shift) % W + W) % W;
            // A ring step counts its payload, what this rank sends: block(r)'s
            // numel x 8 bytes (fp64), once per exchange, two exchanges per shift;
            // a shift by a multiple of W is no exchange and counts nothing.
            if (from != r) bytes += 2 * block(r).numel() * 8;
            auto a = comm->ring_exchange_async(block(r), block(from).sizes(), shift);
            auto b = comm->ring_exchange_async(block(r) * 2.0, block(from).sizes(), shift);
            EXPECT_TRUE(a.wait().equal(block(from))) << "shift " << shift << " rank " << r;
            EXPECT_TRUE(b.wait().equal(block(from) * 2.0)) << "shift " << shift << " rank " << r;
          }
          EXPECT_EQ(comm->stats().op("ring").bytes_sent, bytes);
        },
        std::chrono::seconds(30), [&](int64_t, CommunicatorOptions& o) { o.ring_transport(transport); });
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, CommunicatorWorld, ::testing::Values(1, 2, 3, 4));

TEST(Communicator, RendezvousOverTcp) {
  // The torchrun path: a TCP store on the rank-0 host (threads stand in for
  // processes; the launcher test covers real processes).
  const int64_t port = contrax::find_free_port();
  std::vector<std::thread> ts;
  std::vector<double> got(2, -1);
  for (int64_t r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      auto comm = Communicator::create(CommunicatorOptions().rank(r).world_size(2).master_port(port).timeout(
          std::chrono::seconds(20)));
      auto t = torch::full({1}, static_cast<double>(r + 1));
      comm->all_reduce_sum(t);
      got[r] = t.item<double>();
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(got[0], 3.0);
  EXPECT_EQ(got[1], 3.0);
}

// ---- issue 14 items 7, 8, 9 and issue 13 item 4 (SLURM) ----------------------

namespace {

using Ms = std::chrono::milliseconds;

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// "ADDR:PORT" of every listening TCP socket on `port`, from /proc/net/tcp{,6}.
std::vector<std::string> listeners(int64_t port) {
  std::vector<std::string> out;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state;
      f >> slot >> local >> remote >> state;
      const auto colon = local.find(':');
      if (state != "0A" || std::stol(local.substr(colon + 1), nullptr, 16) != port) continue;
      out.push_back(std::string(file) + " " + local.substr(0, colon));
    }
  }
  return out;
}

// Creates rank `rank` of `world` over TCP on a thread; the future holds its
// error ("" on success). The communicator stays alive until `release` is set.
std::future<std::string> tcp_rank(int64_t rank, int64_t world, int64_t port, Ms timeout,
                                  std::shared_future<void> release, const std::string& addr = "127.0.0.1") {
  return std::async(std::launch::async, [=] {
    try {
      auto comm = Communicator::create(
          CommunicatorOptions().rank(rank).world_size(world).master_addr(addr).master_port(port).timeout(timeout));
      release.wait();
      return std::string();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    } catch (const std::exception& e) {
      return std::string("not a c10::Error: ") + e.what();
    }
  });
}

}  // namespace

TEST(Communicator, StoreListensOnLoopbackOnlyNotOnEveryInterface) {
  // Before: the TCPStore server listened on [::] and 0.0.0.0, reachable from
  // the network through the machine's address.
  const int64_t port = contrax::find_free_port();
  std::promise<void> release;
  std::shared_future<void> go = release.get_future().share();
  auto r0 = tcp_rank(0, 2, port, Ms(20000), go);
  auto r1 = tcp_rank(1, 2, port, Ms(20000), go);
  // Both ranks up (the store is listening) before looking.
  std::vector<std::string> seen;
  for (int i = 0; i < 200 && seen.empty(); ++i) {
    std::this_thread::sleep_for(Ms(50));
    seen = listeners(port);
  }
  release.set_value();
  EXPECT_EQ(r0.get(), "");
  EXPECT_EQ(r1.get(), "");
  ASSERT_FALSE(seen.empty()) << "no listener on port " << port;
  for (const auto& l : seen) EXPECT_EQ(l, "/proc/net/tcp 0100007F") << "listener not on 127.0.0.1: " << l;
}

TEST(Communicator, MissingPeerOverTcpIsReportedOnceWithinTheTimeoutNamingIt) {
  // Before: rank 0 alone waited for the store's workers and then for Gloo:
  // twice the timeout, with no rank named.
  const auto start = std::chrono::steady_clock::now();
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().rank(0).world_size(3).master_port(contrax::find_free_port()).timeout(
                           Ms(1500))),
                       "Communicator::create(): rank 0 of 3: rendezvous timed out after 1500 ms; ranks 1, 2 never "
                       "arrived (not started, failed before connecting, or given another MASTER_ADDR/MASTER_PORT)");
  const double took = seconds_since(start);
  EXPECT_GE(took, 1.4);
  EXPECT_LT(took, 2.9) << "must not wait twice the timeout";
  // A non-zero rank whose rank 0 never listens.
  const auto start1 = std::chrono::steady_clock::now();
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().rank(1).world_size(2).master_port(contrax::find_free_port()).timeout(
                           Ms(1500))),
                       "Communicator::create(): rank 1 could not reach the rendezvous store of rank 0 at MASTER_ADDR "
                       "127.0.0.1:");
  EXPECT_LT(seconds_since(start1), 4.5);
}

TEST(Communicator, WorldSizeMismatchIsNamedQuickly) {
  // Before: Gloo's "address.cc:45 sizeof(impl_) == bytes.size(). 136 vs 272".
  const int64_t port = contrax::find_free_port();
  std::promise<void> release;
  std::shared_future<void> go = release.get_future().share();
  release.set_value();
  const auto start = std::chrono::steady_clock::now();
  auto r0 = tcp_rank(0, 2, port, Ms(10000), go);
  auto r1 = tcp_rank(1, 3, port, Ms(10000), go);
  const std::string e0 = r0.get(), e1 = r1.get();
  EXPECT_LT(seconds_since(start), 5.0);
  for (const auto& e : {e0, e1}) {
    EXPECT_NE(e.find("WORLD_SIZE differs between ranks: rank "), std::string::npos) << e;
    EXPECT_EQ(e.find("address.cc"), std::string::npos) << e;
  }
  EXPECT_TRUE(e0.find("rank 0 has 2, rank 1 has 3") != std::string::npos ||
              e1.find("rank 1 has 3, rank 0 has 2") != std::string::npos)
      << e0 << "\n" << e1;
}

TEST(Communicator, DuplicateRankIsNamed) {
  const int64_t port = contrax::find_free_port();
  std::promise<void> release;
  std::shared_future<void> go = release.get_future().share();
  release.set_value();
  auto r0 = tcp_rank(0, 2, port, Ms(5000), go);
  std::this_thread::sleep_for(Ms(200));  // rank 0's store first, so both rank-1s reach it
  auto a = tcp_rank(1, 2, port, Ms(5000), go);
  auto b = tcp_rank(1, 2, port, Ms(5000), go);
  const std::string ea = a.get(), eb = b.get(), e0 = r0.get();
  const std::string dup = "rank 1 was started twice, or MASTER_PORT is another job's (duplicate RANK 1; every process "
                          "needs its own RANK in [0, WORLD_SIZE), and each job its own MASTER_PORT or "
                          "CONTRAX_JOB_SECRET)";
  EXPECT_TRUE(ea.find(dup) != std::string::npos || eb.find(dup) != std::string::npos) << ea << "\n" << eb;
}

TEST(Communicator, SecondRankZeroIsToldThePortIsInUse) {
  const int64_t port = contrax::find_free_port();
  std::promise<void> release;
  std::shared_future<void> go = release.get_future().share();
  auto first = tcp_rank(0, 2, port, Ms(4000), go);  // waits for a rank 1 that never comes
  std::this_thread::sleep_for(Ms(300));
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().rank(0).world_size(2).master_port(port).timeout(
                           Ms(4000))),
                       "rank 0 cannot listen on MASTER_ADDR 127.0.0.1:" + std::to_string(port) +
                           ": the port is in use (another job, or a second process started as rank 0; pick another "
                           "MASTER_PORT)");
  release.set_value();
  EXPECT_NE(first.get().find("rank 1 never arrived"), std::string::npos);
}

TEST(Communicator, UnresolvableOrForeignMasterAddrIsNamedAtOnce) {
  // Before: an unresolvable MASTER_ADDR waited out the whole timeout.
  const auto start = std::chrono::steady_clock::now();
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().rank(1).world_size(2).master_addr(
                           "no-such-host.invalid").master_port(contrax::find_free_port()).timeout(Ms(20000))),
                       "Communicator::create(): rank 1 cannot resolve MASTER_ADDR 'no-such-host.invalid': ");
  EXPECT_LT(seconds_since(start), 10.0);
  // 192.0.2.1 (TEST-NET-1) is no address of this machine: rank 0 cannot host
  // the store there. Nothing is sent; the bind fails locally.
  CONTRAX_EXPECT_ERROR(Communicator::create(CommunicatorOptions().rank(0).world_size(2).master_addr("192.0.2.1")
                                                .master_port(contrax::find_free_port()).timeout(Ms(20000))),
                       "rank 0 cannot listen on MASTER_ADDR 192.0.2.1 (192.0.2.1): it is not an address of this machine");
}

TEST(Communicator, HungPeerIsReportedWithinTimeoutPlusSecondsNamingCollectiveAndRank) {
  // Rank 1 is alive but never enters the collective (as if SIGSTOPped).
  const auto start = std::chrono::steady_clock::now();
  double failed_after = -1;
  auto errors = run_ranks_collect_errors(
      2,
      [&](const CommunicatorPtr& comm) {
        if (comm->rank() == 0) {
          auto t = torch::ones({4});
          try {
            comm->all_reduce_sum(t);
          } catch (...) {
            failed_after = seconds_since(start);
            throw;
          }
        } else {
          std::this_thread::sleep_for(Ms(6000));
        }
      },
      Ms(1500));
  EXPECT_NE(errors[0].find("contrax: collective 'all_reduce' timed out on rank 0 of 2 (backend gloo, timeout 1500 ms); "
                           "rank 1 did not answer (hung, stopped or dead); cause: "),
            std::string::npos)
      << errors[0];
  EXPECT_EQ(errors[0].find("contrax: collective 'all_reduce' timed out on rank 0 of 2 (backend gloo, timeout 1500 ms); "
                           "rank 1 did not answer (hung, stopped or dead); cause: ["),
            std::string::npos)
      << "the raw Gloo source location is stripped: " << errors[0];
  EXPECT_GT(failed_after, 1.4);
  EXPECT_LT(failed_after, 1.5 + 4.0);
}

TEST(Communicator, FromEnvUnderSlurm) {
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  ::unsetenv("MASTER_ADDR");
  ::unsetenv("MASTER_PORT");
  ::setenv("SLURM_NTASKS", "1", 1);
  ::setenv("SLURM_PROCID", "0", 1);
  ::setenv("SLURM_LOCALID", "0", 1);
  auto one = Communicator::from_env();
  EXPECT_EQ(one->world_size(), 1);
  ::setenv("SLURM_NTASKS", "2", 1);
  ::setenv("SLURM_PROCID", "2", 1);
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "environment variable 'SLURM_PROCID' must be in [0, 2), but got 2");
  ::setenv("SLURM_PROCID", "1", 1);
  ::unsetenv("SLURM_JOB_NODELIST");
  ::unsetenv("SLURM_NODELIST");
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "under SLURM (SLURM_NTASKS=2) either MASTER_ADDR or SLURM_JOB_NODELIST "
                                                 "must be set");
  // The first host of the list is the master; it must resolve.
  ::setenv("SLURM_JOB_NODELIST", "no-such-node[7-9].invalid", 1);
  CONTRAX_EXPECT_ERROR(Communicator::from_env(), "cannot resolve MASTER_ADDR 'no-such-node7.invalid'");
  for (const char* v : {"SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_NODELIST"}) ::unsetenv(v);
}
