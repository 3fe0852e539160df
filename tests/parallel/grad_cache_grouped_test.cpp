// contrax::GradCache with grouped candidates: the second encoder's input has
// g rows per row of the first (parallel/grad_cache_models.h).

#include <gtest/gtest.h>

#include <mutex>

#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "support/ranks.h"
#include "parallel/grad_cache_models.h"

using namespace contrax::testing::grad_cache;

// ---- grouped candidates: the second encoder's input has g rows per row of the first

// Query tower a ([b, 6] inputs), candidate tower b ([b g, 5] inputs: each
// query's positive then g-1 hard negatives), grouped_loss with the loss module's
// logit scale; chunk sizes 2 and 3 (neither divides the other's rows). One
// gradient-cache step against the one-shot step on the whole batch, on one
// process and on W = 3 thread ranks with an empty rank.
namespace {

struct GroupedBatch {
  torch::Tensor x, x_ids, y, y_ids;  // [B, 6], [B], [B g, 5], [B g]
};

GroupedBatch make_grouped_batch(int64_t B, int64_t g, int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({B, 6}, torch::kDouble), torch::arange(B, torch::kDouble),
          torch::randn({B * g, 5}, torch::kDouble), torch::arange(B * g, torch::kDouble) + 1000.0};
}

torch::Tensor grouped_of(const contrax::ClipLoss& clip, const torch::Tensor& q, const torch::Tensor& c,
                         const CommunicatorPtr& comm) {
  // Normalised: without it a shift of every candidate leaves each softmax unchanged, so the candidate
  // tower's output bias would have an all-zero (round-off) gradient that no relative check can compare.
  return contrax::grouped_loss(q, c, clip->logit_scale, {}, contrax::GroupedLossOptions().comm(comm).normalize(true));
}

}  // namespace

TEST(GradCacheGrouped, CandidatesWithGTimesTheRowsMatchTheOneShotStep) {
  const int64_t g = 3;
  const std::vector<int64_t> counts{3, 0, 2};
  const int64_t B = 5;
  auto init = make_models(31);
  auto batch = make_grouped_batch(B, g, 32);
  auto ref = copy_of(init);
  auto fq = ref.a->forward(std::vector<torch::Tensor>{batch.x, batch.x_ids});
  auto fc = ref.b->forward(std::vector<torch::Tensor>{batch.y, batch.y_ids});
  auto want_loss = grouped_of(ref.clip, fq, fc, nullptr);
  want_loss.backward();
  auto want = ref.grads();

  {  // one process
    auto m = copy_of(init);
    GradCache gc({GradCacheEncoder(m.a, 2), GradCacheEncoder(m.b, 3)},
                 [clip = m.clip](const std::vector<torch::Tensor>& r) { return grouped_of(clip, r[0], r[1], nullptr); });
    auto loss = gc.step({std::vector<torch::Tensor>{batch.x, batch.x_ids},
                         std::vector<torch::Tensor>{batch.y, batch.y_ids}});
    EXPECT_LE(rel_err(loss, want_loss.detach()), 1e-12);
    expect_match(m.grads(), want, 1e-10, "grouped, one process");
  }

  run_ranks(3, [&](const CommunicatorPtr& comm) {
    Models m;
    {
      std::lock_guard<std::mutex> lock(init_mutex());
      m = copy_of(init);
    }
    auto dp_a = std::make_shared<DataParallel>(m.a, comm);
    auto dp_b = std::make_shared<DataParallel>(m.b, comm);
    auto dp_loss = std::make_shared<DataParallel>(m.clip, comm);
    GradCache gc({GradCacheEncoder(m.a, 2).data_parallel(dp_a), GradCacheEncoder(m.b, 3).data_parallel(dp_b)},
                 [clip = m.clip, comm](const std::vector<torch::Tensor>& r) { return grouped_of(clip, r[0], r[1], comm); },
                 GradCacheOptions().loss_data_parallel(dp_loss));
    const int64_t r = comm->rank();
    std::vector<int64_t> cand_counts;
    for (auto c : counts) cand_counts.push_back(c * g);
    auto loss = gc.step({std::vector<torch::Tensor>{shard(batch.x, counts, r), shard(batch.x_ids, counts, r)},
                         std::vector<torch::Tensor>{shard(batch.y, cand_counts, r), shard(batch.y_ids, cand_counts, r)}});
    expect_match(m.grads(), want, 1e-10, c10::str("grouped, rank ", r));
  }, std::chrono::seconds(15));
}
