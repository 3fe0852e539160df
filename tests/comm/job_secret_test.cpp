// Tests that a stranger on the host cannot steer a job through its
// rendezvous store once the job has a secret (CONTRAX_JOB_SECRET): it can
// neither stop a starting job, nor pose as one of its ranks, nor read its
// keys; without a secret the same three attacks work (c10d's TCPStore has no
// authentication), which shows the test would catch their return. Also: a
// rank of another job is told so within seconds; the launcher gives each
// one-node launch its own secret through the environment; the store warns
// when it listens beyond loopback.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <future>
#include <set>
#include <thread>

#include "contrax/comm/communicator.h"
#include "contrax/launch/launcher.h"
#include "support/cli.h"
#include "support/processes.h"

using contrax::Communicator;
using contrax::CommunicatorOptions;
using Ms = std::chrono::milliseconds;

namespace {

// Rank `rank` of 2 over TCP on a thread: "" and the all-reduce's sum (3)
// when the job came up, else its error.
std::future<std::string> rank_of(int64_t rank, int64_t port, const std::string& secret, Ms timeout,
                                 const std::string& addr = "127.0.0.1") {
  return std::async(std::launch::async, [=] {
    try {
      auto comm = Communicator::create(CommunicatorOptions()
                                           .rank(rank)
                                           .world_size(2)
                                           .master_addr(addr)
                                           .master_port(port)
                                           .job_secret(secret)
                                           .timeout(timeout));
      auto t = torch::full({1}, static_cast<double>(rank + 1));
      comm->all_reduce_sum(t);
      return t.item<double>() == 3.0 ? std::string() : std::string("wrong sum");
    } catch (const std::exception& e) {
      const std::string m = e.what();
      return m.substr(0, m.find('\n'));
    }
  });
}

// A stranger's connection to the store at `port`, once it listens.
c10::intrusive_ptr<c10d::TCPStore> stranger(int64_t port) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = false;
  so.waitWorkers = false;
  so.useLibUV = false;
  so.timeout = Ms(5000);
  for (int i = 0;; ++i) {
    try {
      return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    } catch (const std::exception&) {
      if (i > 100) throw;
      std::this_thread::sleep_for(Ms(50));
    }
  }
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// What a stranger does to a starting job whose rank 0 is up and rank 1 not
// yet: reads the keys it can name, poses as rank 1, and reports an error
// that would stop every rank. Returns what it could read.
std::string attack(c10d::TCPStore& s) {
  std::string read;
  for (const char* key : {"contrax/rdzv/size/0", "contrax/rdzv/rank/0", "contrax/host"}) {
    if (s.check({key})) read += std::string(key) + " ";
  }
  s.add("contrax/rdzv/rank/1", 1);
  s.set("contrax/rdzv/size/1", bytes("2"));
  s.set("contrax/rdzv/error", bytes("the stranger says stop"));
  return read;
}

}  // namespace

TEST(JobSecret, WithoutOneAStrangerStopsJoinsAndReadsAJob) {
  // c10d's own behaviour, which the secret exists to change.
  const int64_t port = contrax::find_free_port();
  auto r0 = rank_of(0, port, "", Ms(4000));
  auto s = stranger(port);
  std::this_thread::sleep_for(Ms(300));  // rank 0 has announced itself
  const std::string read = attack(*s);
  auto r1 = rank_of(1, port, "", Ms(4000));
  const std::string e0 = r0.get(), e1 = r1.get();
  EXPECT_NE(read.find("contrax/rdzv/size/0"), std::string::npos) << "the stranger read rank 0's key";
  // Rank 0 stops on the stranger's report, or on rank 1's finding that a
  // "rank 1" (the stranger) was there first: either way the job is steered.
  EXPECT_NE(e0.find("another rank reported: "), std::string::npos) << e0;
  EXPECT_FALSE(e1.empty()) << "rank 1 cannot join: the stranger took its place";
}

TEST(JobSecret, WithOneAStrangerCanNeitherStopNorJoinNorReadIt) {
  const int64_t port = contrax::find_free_port();
  const std::string secret = "a secret only this job's ranks know";
  auto r0 = rank_of(0, port, secret, Ms(20000));
  auto s = stranger(port);
  std::this_thread::sleep_for(Ms(300));
  const std::string read = attack(*s);
  auto r1 = rank_of(1, port, secret, Ms(20000));
  EXPECT_EQ(r0.get(), "");
  EXPECT_EQ(r1.get(), "");
  EXPECT_EQ(read, "") << "the stranger could name and read these keys";
}

TEST(JobSecret, ARankOfAnotherJobIsToldSoWithinSeconds) {
  const int64_t port = contrax::find_free_port();
  const auto start = std::chrono::steady_clock::now();
  auto r0 = rank_of(0, port, "job A", Ms(8000));
  std::this_thread::sleep_for(Ms(200));
  auto r1 = rank_of(1, port, "job B", Ms(3000));
  const std::string e1 = r1.get();
  EXPECT_NE(e1.find("rank 1 reached a rendezvous store at MASTER_ADDR 127.0.0.1:" + std::to_string(port) +
                    " whose rank 0 is not of this job: no rank 0 with this job's CONTRAX_JOB_SECRET serves it "
                    "(another job holds MASTER_PORT, or the ranks were given different secrets)"),
            std::string::npos)
      << e1;
  // Told after min(its timeout, 10 s), not after waiting for peers that are not there.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 6.0);
  EXPECT_NE(r0.get().find("rank 1 never arrived"), std::string::npos);
}

TEST(JobSecret, TheStoreWarnsWhenItListensBeyondLoopback) {
  // Warnings go to the handler of the thread that raised them: each rank
  // thread installs one.
  struct Capture : c10::WarningHandler {
    std::vector<std::string>* seen;
    std::mutex* m;
    void process(const c10::Warning& w) override {
      std::lock_guard<std::mutex> lock(*m);
      seen->push_back(w.msg());
    }
  };
  for (const std::string secret : {"", "s"}) {
    std::vector<std::string> seen;
    std::mutex m;
    const int64_t port = contrax::find_free_port("0.0.0.0");
    auto rank = [&](int64_t r) {
      return std::async(std::launch::async, [&, r] {
        Capture capture;
        capture.seen = &seen;
        capture.m = &m;
        c10::WarningUtils::WarningHandlerGuard guard(&capture);
        Communicator::create(CommunicatorOptions().rank(r).world_size(2).master_addr("0.0.0.0").master_port(port)
                                 .job_secret(secret).timeout(Ms(20000)));
      });
    };
    auto a = rank(0), b = rank(1);
    a.get();
    b.get();
    ASSERT_EQ(seen.size(), 1u) << "rank 0, which listens, warns once";
    EXPECT_NE(seen[0].find("contrax: the rendezvous store listens on MASTER_ADDR 0.0.0.0:" + std::to_string(port) +
                           ", which other hosts can reach; "),
              std::string::npos)
        << seen[0];
    EXPECT_NE(seen[0].find(secret.empty() ? "no CONTRAX_JOB_SECRET is set, so whoever reaches it can read the job's "
                                            "keys, stop the job or join it as a rank"
                                          : "its keys are bound to CONTRAX_JOB_SECRET"),
              std::string::npos)
        << seen[0];
  }
}

TEST(JobSecret, TheLauncherGivesEachOneNodeLaunchItsOwnSecret) {
  contrax::testing::TempDir tmp;
  const std::string out = tmp.path + "/secrets";
  // The secret reaches the workers' environment, never their command line.
  const std::vector<std::string> argv{"sh", "-c", "echo \"$RANK $CONTRAX_JOB_SECRET\" >> " + out};
  contrax::LaunchOptions o;
  o.nproc = 2;
  const char* before = std::getenv("CONTRAX_JOB_SECRET");
  const std::string saved = before != nullptr ? before : "";
  ::unsetenv("CONTRAX_JOB_SECRET");
  ASSERT_EQ(contrax::launch(argv, o).exit_code, 0);
  ASSERT_EQ(contrax::launch(argv, o).exit_code, 0);
  ::setenv("CONTRAX_JOB_SECRET", "given by the user", 1);
  ASSERT_EQ(contrax::launch(argv, o).exit_code, 0);
  if (saved.empty()) ::unsetenv("CONTRAX_JOB_SECRET");
  else ::setenv("CONTRAX_JOB_SECRET", saved.c_str(), 1);
  std::ifstream in(out);
  std::vector<std::set<std::string>> launches(3);
  std::string rank, secret;
  for (int line = 0; in >> rank; ++line) {
    std::getline(in, secret);
    launches[static_cast<size_t>(line / 2)].insert(secret.substr(1));
  }
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_EQ(launches[i].size(), 1u) << "one secret for every rank of a launch";
    const std::string& s = *launches[i].begin();
    EXPECT_EQ(s.size(), 64u) << s;
    EXPECT_EQ(s.find_first_not_of("0123456789abcdef"), std::string::npos) << s;
  }
  EXPECT_NE(*launches[0].begin(), *launches[1].begin()) << "each launch its own secret";
  EXPECT_EQ(launches[2], std::set<std::string>{"given by the user"});
  // A job over several nodes needs the user's secret: without it, it says so.
  const auto r = contrax::testing::run_shell("env -u CONTRAX_JOB_SECRET " + std::string(CONTRAX_CLI_PATH) +
                                             " launch --nnodes 2 --node-rank 1 --nproc 1 --master-addr 127.0.0.1 "
                                             "--master-port 1 -- true 2>&1");
  EXPECT_EQ(r.status, 0) << r.out;
  const std::string warning =
      "launch: warning: no CONTRAX_JOB_SECRET is set for this 2-node job, so anyone who reaches its rendezvous store "
      "can read its keys, stop it or join it as a rank; give every node the same secret (docs/reliability.md)";
  EXPECT_NE(r.out.find(warning), std::string::npos) << r.out;
}
