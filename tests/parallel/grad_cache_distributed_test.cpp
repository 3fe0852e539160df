// contrax::GradCache on thread ranks through DataParallel, with uneven and
// empty ranks, tied encoders, and the materialised, tiled and ring losses:
// two steps with an optimizer in between equal the single-process full-batch
// steps (parallel/grad_cache_models.h; fp64, rel err <= 1e-10).

#include <gtest/gtest.h>

#include <mutex>
#include <numeric>

#include "contrax/losses/losses.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "support/ranks.h"
#include "parallel/grad_cache_models.h"

using namespace contrax::testing::grad_cache;

// ---- several ranks, through DataParallel

// The loss the distributed step runs on the cached representations.
enum class LossPath { kMaterialised, kTiled, kRing };

struct DistributedSetup {
  std::vector<int64_t> counts;  // rows per rank (W = counts.size()); may hold 0
  bool tied = false;
  LossPath path = LossPath::kMaterialised;
};

// Each rank: one DataParallel per tower (one shared for tied towers), one over
// the loss module, distributed CLIP loss on the local rows (materialised, or
// tiled with tiles of 3 rows, which divide no row count here, gathered or
// around the ring). Two steps with an optimizer in between, compared with the
// single-process full-batch steps; every reducer synchronises once per step.
// Short collective timeouts: a rank that skips a collective (an empty rank
// that runs no chunk) fails the test in seconds instead of hanging it.
void run_distributed(const DistributedSetup& setup) {
  const auto& counts = setup.counts;
  const bool tied = setup.tied;
  const int64_t W = static_cast<int64_t>(counts.size());
  const int64_t B = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  auto init = make_models(20, tied);
  std::vector<Batch> batches{make_batch(B, 21), make_batch(B, 22)};
  auto ref = copy_of(init, tied);
  torch::optim::SGD opt_ref(ref.params(), torch::optim::SGDOptions(0.3));
  std::vector<std::vector<torch::Tensor>> want;
  for (const auto& b : batches) {
    opt_ref.zero_grad();
    full_batch_step(ref, b, tied);
    want.push_back(ref.grads());
    opt_ref.step();
  }

  run_ranks(W, [&](const CommunicatorPtr& comm) {
    Models m;
    {
      std::lock_guard<std::mutex> lock(init_mutex());
      m = copy_of(init, tied);
    }
    // Tiny buckets: several per module, so "once" means num_buckets calls.
    auto opts = contrax::DataParallelOptions().bucket_bytes(200).first_bucket_bytes(100);
    auto dp_a = std::make_shared<DataParallel>(m.a, comm, opts);
    auto dp_b = tied ? dp_a : std::make_shared<DataParallel>(m.b, comm, opts);
    auto dp_loss = std::make_shared<DataParallel>(m.clip, comm, opts);
    contrax::ClipLoss clip = m.clip;
    clip->options.comm(comm);
    contrax::RepresentationLossFn loss = [clip](const std::vector<torch::Tensor>& r) {
      return clip.ptr()->forward(r[0], r[1]);
    };
    if (setup.path != LossPath::kMaterialised) {
      clip->options.path(contrax::MemoryPath::kTiled).tile_size(3).ring(setup.path == LossPath::kRing);
    }
    GradCache gc({GradCacheEncoder(m.a, 2).data_parallel(dp_a), GradCacheEncoder(m.b, 3).data_parallel(dp_b)},
                 loss, GradCacheOptions().loss_data_parallel(dp_loss));
    torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.3));
    for (size_t s = 0; s < batches.size(); ++s) {
      Batch local{shard(batches[s].x, counts, comm->rank()), shard(batches[s].y, counts, comm->rank()),
                  shard(batches[s].ids, counts, comm->rank())};
      opt.zero_grad();
      const int64_t calls_before = comm->stats().op("reducer_all_reduce").calls;
      gc.step(list_inputs(local, tied));
      const int64_t calls = comm->stats().op("reducer_all_reduce").calls - calls_before;
      // After the step: the reducer re-buckets once, at the start of the
      // second synchronised backward (gradient-ready order), as DDP does.
      const int64_t buckets = dp_a->num_buckets() + (tied ? 0 : dp_b->num_buckets()) + dp_loss->num_buckets();
      expect_match(m.grads(), want[s], 1e-10,
                   c10::str("W=", W, " tied=", tied, " rank ", comm->rank(), " step ", s));
      if (W > 1) {
        EXPECT_EQ(dp_a->sync_count(), static_cast<int64_t>(s + 1));
        EXPECT_EQ(dp_b->sync_count(), static_cast<int64_t>(s + 1));
        EXPECT_EQ(dp_loss->sync_count(), static_cast<int64_t>(s + 1));
        // Several chunks per encoder (2 and 3 rows), yet each bucket of each
        // reducer is all-reduced once: no-sync held for all other chunks.
        EXPECT_EQ(calls, buckets) << "each reducer must synchronise exactly once per step";
      } else {
        EXPECT_EQ(calls, 0);
      }
      opt.step();
    }
  }, std::chrono::seconds(15));
}

TEST(GradCacheDistributed, WorldOfOne) { run_distributed({{9}}); }
TEST(GradCacheDistributed, TwoRanksUneven) { run_distributed({{7, 4}}); }
TEST(GradCacheDistributed, ThreeRanksUneven) { run_distributed({{5, 2, 4}}); }
TEST(GradCacheDistributed, TwoRanksTiedEncoders) { run_distributed({{3, 6}, true}); }

// A rank with no rows (a short last batch, or verify's row pattern) still
// takes part in every collective: its loss, its reducers' all-reduces.
TEST(GradCacheDistributed, ThreeRanksOneEmpty) { run_distributed({{5, 0, 4}}); }
TEST(GradCacheDistributed, FourRanksOneEmpty) { run_distributed({{6, 3, 0, 5}}); }
TEST(GradCacheDistributed, TwoRanksOneEmptyTiedEncoders) { run_distributed({{0, 5}, true}); }

// The memory-bounded losses under the gradient cache: tiles of 3 rows against
// 2- and 3-row chunks and uneven ranks; gathered keys and the ring.
TEST(GradCacheDistributed, TiledLossTwoRanks) { run_distributed({{7, 4}, false, LossPath::kTiled}); }
TEST(GradCacheDistributed, TiledLossThreeRanks) { run_distributed({{5, 2, 4}, false, LossPath::kTiled}); }
TEST(GradCacheDistributed, RingLossTwoRanks) { run_distributed({{7, 4}, false, LossPath::kRing}); }
TEST(GradCacheDistributed, RingLossThreeRanks) { run_distributed({{5, 2, 4}, false, LossPath::kRing}); }
TEST(GradCacheDistributed, RingLossFourRanksOneEmpty) { run_distributed({{6, 3, 0, 5}, false, LossPath::kRing}); }
TEST(GradCacheDistributed, RingLossWorldOfOne) { run_distributed({{9}, false, LossPath::kRing}); }
