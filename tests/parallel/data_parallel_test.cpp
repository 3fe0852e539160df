// Tests of contrax::DataParallel: gradients averaged by c10d's Reducer equal
// the single-process full-batch gradients (fp64, W = 1..4, uneven batches and
// empty ranks, two iterations so that the reducer's bucket rebuild is
// exercised), rank 0's parameters win at construction, no_sync accumulates
// locally and the reducer communicates once, and every construction error is
// raised on every rank without a hang.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <numeric>
#include <mutex>

#include "contrax/losses/losses.h"
#include "contrax/parallel/data_parallel.h"
#include "support/errors.h"
#include "support/hashed_dropout.h"
#include "support/ranks.h"

namespace {

using contrax::CommunicatorPtr;
using contrax::DataParallel;
using contrax::DataParallelOptions;
using namespace contrax::testing;

// Two towers and a learnable logit scale: what a CLIP model is, in small.
struct TwoTowerImpl : torch::nn::Cloneable<TwoTowerImpl> {
  explicit TwoTowerImpl(int64_t in_a = 6, int64_t in_b = 5, int64_t hidden = 8, int64_t out = 4)
      : in_a(in_a), in_b(in_b), hidden(hidden), out(out) {
    reset();
  }
  void reset() override {
    a1 = register_module("a1", torch::nn::Linear(in_a, hidden));
    a2 = register_module("a2", torch::nn::Linear(hidden, out));
    b1 = register_module("b1", torch::nn::Linear(in_b, hidden));
    b2 = register_module("b2", torch::nn::Linear(hidden, out));
    logit_scale = register_parameter("logit_scale", torch::tensor(std::log(10.0), torch::kDouble));
  }
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& xa, const torch::Tensor& xb,
                                                  const torch::Tensor& ids) {
    auto ha = hashed_dropout(torch::tanh(a1(xa)), ids, 0.3, 1.0);
    auto hb = hashed_dropout(torch::tanh(b1(xb)), ids, 0.3, 2.0);
    return {a2(ha), b2(hb)};
  }
  int64_t in_a, in_b, hidden, out;
  torch::nn::Linear a1{nullptr}, a2{nullptr}, b1{nullptr}, b2{nullptr};
  torch::Tensor logit_scale;
};
TORCH_MODULE(TwoTower);

struct TowerBatch {
  torch::Tensor xa, xb, ids;  // [B, 6], [B, 5], [B]
};

TowerBatch make_tower_batch(int64_t B, int64_t seed) {
  torch::manual_seed(seed);
  TowerBatch b;
  b.xa = torch::randn({B, 6}, torch::kDouble);
  b.xb = torch::randn({B, 5}, torch::kDouble);
  b.ids = torch::arange(B, torch::kDouble) + 1000.0 * static_cast<double>(seed);
  return b;
}

TwoTower make_model(int64_t seed) {
  torch::manual_seed(seed);
  TwoTower m;
  m->to(torch::kDouble);
  return m;
}

TwoTower copy_of(const TwoTower& m) {
  return TwoTower(std::dynamic_pointer_cast<TwoTowerImpl>(m->clone()));
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return g;
}

// Thread ranks share torch's global generator and default-dtype state: build
// models and data under one lock.
std::mutex& model_mutex() {
  static std::mutex m;
  return m;
}

// The single-process reference: `steps` SGD steps of the CLIP loss on the
// whole batch; returns the gradients of the last step.
std::vector<torch::Tensor> reference_grads(const TwoTower& init, const std::vector<TowerBatch>& batches) {
  auto m = copy_of(init);
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  std::vector<torch::Tensor> g;
  for (const auto& b : batches) {
    opt.zero_grad();
    auto [fa, fb] = m->forward(b.xa, b.xb, b.ids);
    contrax::clip_loss(fa, fb, m->logit_scale).backward();
    g = grads_of(*m);
    opt.step();
  }
  return g;
}

void expect_grads_match(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                        double tol, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_LE(rel_err(got[i], want[i]), tol) << where << ": parameter " << i;
  }
}

// Every rank: DataParallel over its copy of the model, forward on its shard,
// distributed CLIP loss (L_r scaled so that the reducer's average is the
// global mean), backward, SGD step; twice.
void run_data_parallel(int64_t W, const std::vector<int64_t>& counts) {
  const int64_t B = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  auto init = make_model(7);
  std::vector<TowerBatch> batches{make_tower_batch(B, 1), make_tower_batch(B, 2)};
  auto want = reference_grads(init, batches);
  auto want_first = reference_grads(init, {batches[0]});

  run_ranks(W, [&](const CommunicatorPtr& comm) {
    TwoTower m{nullptr};
    {
      std::lock_guard<std::mutex> lock(model_mutex());
      m = copy_of(init);
      // Every rank but 0 starts from other weights: construction must
      // broadcast rank 0's.
      if (comm->rank() != 0) {
        torch::NoGradGuard ng;
        for (auto& p : m->parameters()) p.add_(0.5);
      }
    }
    DataParallel dp(m, comm);
    EXPECT_EQ(dp.has_reducer(), W > 1);
    for (size_t i = 0; i < m->parameters().size(); ++i) {
      EXPECT_EQ(rel_err(m->parameters()[i], init->parameters()[i]), 0.0) << "parameter " << i << " not broadcast";
    }
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
    for (size_t s = 0; s < batches.size(); ++s) {
      const auto& b = batches[s];
      opt.zero_grad();
      auto xa = shard(b.xa, counts, comm->rank()), xb = shard(b.xb, counts, comm->rank());
      auto ids = shard(b.ids, counts, comm->rank());
      auto [fa, fb] = dp.forward([&] { return m->forward(xa, xb, ids); });
      contrax::clip_loss(fa, fb, m->logit_scale, {}, contrax::ClipLossOptions().comm(comm)).backward();
      expect_grads_match(grads_of(*m), s == 0 ? want_first : want, 1e-10,
                         c10::str("W=", W, " rank ", comm->rank(), " step ", s));
      opt.step();
    }
    EXPECT_EQ(dp.sync_count(), W > 1 ? 2 : 0);
    if (W == 1) EXPECT_EQ(comm->stats().total_calls(), 0);
  }, std::chrono::seconds(15));  // short: a rank that skips an all-reduce fails fast
}

TEST(DataParallel, WorldOfOneIsThePlainStep) { run_data_parallel(1, {9}); }
TEST(DataParallel, TwoRanksUnevenMatchSingleProcess) { run_data_parallel(2, {5, 3}); }
TEST(DataParallel, ThreeRanksUnevenMatchSingleProcess) { run_data_parallel(3, {4, 1, 3}); }
// A rank with 0 rows (a short last batch): its forward yields [0, d] outputs,
// its backward gives every parameter a zero gradient, so its reducer joins
// the all-reduces and the average stays the full-batch gradient.
TEST(DataParallel, ThreeRanksOneEmptyMatchSingleProcess) { run_data_parallel(3, {5, 0, 4}); }
TEST(DataParallel, FourRanksOneEmptyMatchSingleProcess) { run_data_parallel(4, {6, 3, 0, 5}); }

// A separable loss so that micro-batches can be accumulated: the global
// objective is sum_i |f(x_i)|^2 / B; rank r's micro-batch k contributes its
// rows scaled by W / B (the same convention as the losses).
TEST(DataParallel, NoSyncAccumulatesLocallyAndReducesOnce) {
  const int64_t W = 2;
  const std::vector<int64_t> counts{6, 4};
  const int64_t B = 10;
  auto init = make_model(3);
  auto batch = make_tower_batch(B, 5);
  auto ref = copy_of(init);
  {
    auto [fa, fb] = ref->forward(batch.xa, batch.xb, batch.ids);
    ((fa.pow(2).sum() + fb.pow(2).sum() * ref->logit_scale) / B).backward();
  }
  auto want = grads_of(*ref);

  run_ranks(W, [&](const CommunicatorPtr& comm) {
    TwoTower m{nullptr};
    {
      std::lock_guard<std::mutex> lock(model_mutex());
      m = copy_of(init);
    }
    // Tiny buckets: one per parameter, so that "reduced once" is visible as
    // exactly num_buckets all-reduces rather than a coincidence of one bucket.
    DataParallel dp(m, comm, DataParallelOptions().bucket_bytes(8).first_bucket_bytes(8));
    const int64_t buckets = dp.num_buckets();
    EXPECT_GT(buckets, 1);
    auto xa = shard(batch.xa, counts, comm->rank()), xb = shard(batch.xb, counts, comm->rank());
    auto ids = shard(batch.ids, counts, comm->rank());
    const int64_t n = xa.size(0), half = n / 2;
    auto micro = [&](int64_t start, int64_t len) {
      auto [fa, fb] = dp.forward([&] {
        return m->forward(xa.narrow(0, start, len), xb.narrow(0, start, len), ids.narrow(0, start, len));
      });
      ((fa.pow(2).sum() + fb.pow(2).sum() * m->logit_scale) * (static_cast<double>(W) / B)).backward();
    };
    comm->reset_stats();
    {
      auto guard = dp.no_sync();
      EXPECT_TRUE(dp.in_no_sync());
      EXPECT_FALSE(dp.will_sync());
      micro(0, half);
    }
    EXPECT_EQ(comm->stats().op("reducer_all_reduce").calls, 0);
    micro(half, n - half);
    EXPECT_EQ(comm->stats().op("reducer_all_reduce").calls, buckets);
    EXPECT_EQ(dp.sync_count(), 1);
    expect_grads_match(grads_of(*m), want, 1e-10, c10::str("rank ", comm->rank()));
    // Bytes: a ring all-reduce of all gradients, 2 (W-1)/W of them.
    int64_t grad_bytes = 0;
    for (const auto& p : m->parameters()) grad_bytes += p.numel() * 8;
    EXPECT_EQ(comm->stats().op("reducer_all_reduce").bytes_sent, grad_bytes);  // 2 (W-1)/W = 1 for W = 2
  });
}

// ---- errors: all raised on every rank, none hangs (the harness's timeout
// would turn a hang into a failure).

struct SmallImpl : torch::nn::Module {
  SmallImpl(int64_t in, int64_t out, bool extra = false, torch::Dtype dtype = torch::kFloat) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    if (extra) register_parameter("extra", torch::zeros({2}));
    fc->to(dtype);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Small);

void expect_all_ranks_fail(int64_t W, const std::function<Small(int64_t rank)>& make, const std::string& message) {
  auto errors = run_ranks_collect_errors(W, [&](const CommunicatorPtr& comm) {
    Small m{nullptr};
    {
      std::lock_guard<std::mutex> lock(model_mutex());
      m = make(comm->rank());
    }
    DataParallel dp(m, comm);
  }, std::chrono::seconds(20));
  ASSERT_EQ(static_cast<int64_t>(errors.size()), W);
  for (int64_t r = 0; r < W; ++r) {
    EXPECT_NE(errors[r].find(message), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

TEST(DataParallel, ShapeMismatchIsAnErrorOnEveryRank) {
  expect_all_ranks_fail(2, [](int64_t r) { return Small(r == 1 ? 3 : 5, 4); },
                        "DataParallel(): parameter 'fc.weight' has shape [4, 3] on rank 1 but [4, 5] on rank 0");
  expect_all_ranks_fail(3, [](int64_t r) { return Small(5, r == 2 ? 2 : 4); },
                        "DataParallel(): parameter 'fc.weight' has shape [2, 5] on rank 2 but [4, 5] on rank 0");
}

TEST(DataParallel, CountMismatchIsAnErrorOnEveryRank) {
  expect_all_ranks_fail(2, [](int64_t r) { return Small(5, 4, r == 1); },
                        "DataParallel(): the module has 3 parameters on rank 1 but 2 on rank 0");
}

TEST(DataParallel, DtypeMismatchIsAnErrorOnEveryRank) {
  expect_all_ranks_fail(2, [](int64_t r) { return Small(5, 4, false, r == 1 ? torch::kDouble : torch::kFloat); },
                        "DataParallel(): parameter 'fc.weight' has dtype Double on rank 1 but Float on rank 0");
}

TEST(DataParallel, ArgumentErrors) {
  CONTRAX_EXPECT_ERROR(DataParallel(std::shared_ptr<torch::nn::Module>(), nullptr),
                       "DataParallel(): argument 'module' is null");
  CONTRAX_EXPECT_ERROR(DataParallel(Small(2, 2), nullptr, DataParallelOptions().bucket_bytes(0)),
                       "DataParallel(): option 'bucket_bytes' must be positive, but got 0");
  CONTRAX_EXPECT_ERROR(DataParallel(Small(2, 2), nullptr, DataParallelOptions().first_bucket_bytes(-1)),
                       "DataParallel(): option 'first_bucket_bytes' must be positive, but got -1");
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    Small m{nullptr};
    {
      std::lock_guard<std::mutex> lock(model_mutex());
      m = Small(3, 2);
    }
    DataParallel dp(m, comm, DataParallelOptions().find_unused_parameters(true));
    CONTRAX_EXPECT_ERROR(dp.prepare_for_backward({}),
                         "DataParallel::prepare_for_backward(): option 'find_unused_parameters' needs the forward's "
                         "output tensors");
  });
}

// find_unused_parameters: a parameter the forward skips is marked ready from
// the graph search, and the used ones are still averaged correctly.
TEST(DataParallel, FindUnusedParameters) {
  auto init = make_model(11);
  auto batch = make_tower_batch(6, 9);
  auto ref = copy_of(init);
  ref->a2(torch::tanh(ref->a1(batch.xa))).pow(2).sum().div(6).backward();
  auto want = grads_of(*ref);
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    TwoTower m{nullptr};
    {
      std::lock_guard<std::mutex> lock(model_mutex());
      m = copy_of(init);
    }
    DataParallel dp(m, comm, DataParallelOptions().find_unused_parameters(true));
    auto xa = shard(batch.xa, {3, 3}, comm->rank());
    auto out = dp.forward([&] { return m->a2(torch::tanh(m->a1(xa))); });
    (out.pow(2).sum() * (2.0 / 6)).backward();
    expect_grads_match(grads_of(*m), want, 1e-10, c10::str("rank ", comm->rank()));
  });
}

}  // namespace
