// Tests of the sharded sampler: coverage, reproducibility, rank order, resume.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "contrax/train/common/sampler.h"

namespace ct = contrax::train;

TEST(ShardedSampler, EveryExampleExactlyOncePerEpochAcrossRanks) {
  for (int64_t n : {1, 7, 100, 257}) {
    for (int64_t g : {1, 8, 33, 300}) {
      for (int64_t w : {1, 2, 3, 5, 8}) {
        ct::ShardedSampler s(n, ct::ShardedSamplerOptions().global_batch_size(g).world_size(w).seed(3));
        EXPECT_EQ(s.steps_per_epoch(), (n + g - 1) / g);
        for (int64_t epoch = 0; epoch < 2; ++epoch) {
          std::vector<int> seen(n, 0);
          for (int64_t step = 0; step < s.steps_per_epoch(); ++step) {
            int64_t rows = 0;
            for (int64_t r = 0; r < w; ++r) {
              auto idx = s.local_indices(epoch, step, r);
              rows += idx.size(0);
              for (int64_t i = 0; i < idx.size(0); ++i) seen[idx[i].item<int64_t>()]++;
            }
            EXPECT_EQ(rows, s.global_batch_rows(step));
          }
          for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "n=" << n << " g=" << g << " w=" << w;
        }
      }
    }
  }
}

TEST(ShardedSampler, RankPartsConcatenateToTheGlobalBatch) {
  ct::ShardedSampler single(103, ct::ShardedSamplerOptions().global_batch_size(10).seed(5));
  for (int64_t w : {2, 3, 4, 16}) {
    ct::ShardedSampler multi(103, ct::ShardedSamplerOptions().global_batch_size(10).world_size(w).seed(5));
    for (int64_t step = 0; step < single.steps_per_epoch(); ++step) {
      std::vector<torch::Tensor> parts;
      for (int64_t r = 0; r < w; ++r) parts.push_back(multi.local_indices(1, step, r));
      EXPECT_TRUE(torch::equal(torch::cat(parts), single.global_indices(1, step)));
      EXPECT_TRUE(torch::equal(torch::cat(parts), single.local_indices(1, step, 0)));
    }
  }
}

TEST(ShardedSampler, ShortLastBatchIsKeptAndSplitEvenly) {
  ct::ShardedSampler s(10, ct::ShardedSamplerOptions().global_batch_size(8).world_size(4));
  EXPECT_EQ(s.steps_per_epoch(), 2);
  EXPECT_EQ(s.global_batch_rows(1), 2);
  // Two rows over four ranks: ranks 2 and 3 get none.
  std::vector<int64_t> counts;
  for (int64_t r = 0; r < 4; ++r) counts.push_back(s.local_indices(0, 1, r).size(0));
  EXPECT_EQ(counts, (std::vector<int64_t>{1, 1, 0, 0}));
  auto sl = ct::rank_slice(10, 4, 3);
  EXPECT_EQ(sl.offset, 8);
  EXPECT_EQ(sl.count, 2);
  sl = ct::rank_slice(10, 4, 1);
  EXPECT_EQ(sl.offset, 3);
  EXPECT_EQ(sl.count, 3);
}

TEST(ShardedSampler, LastBatchWithFewerRowsThanRanksCoversEveryExampleOnce) {
  // The trainer's case: 50 examples, global batch 24, 3 ranks -> batches of
  // 24, 24 and 2; in the last one rank 2 holds no row.
  struct Case {
    int64_t n, g, w;
    std::vector<int64_t> last_counts;
  };
  for (const auto& c : std::vector<Case>{{50, 24, 3, {1, 1, 0}}, {17, 8, 8, {1, 0, 0, 0, 0, 0, 0, 0}},
                                         {34, 16, 5, {1, 1, 0, 0, 0}}}) {
    ct::ShardedSampler s(c.n, ct::ShardedSamplerOptions().global_batch_size(c.g).world_size(c.w).seed(11));
    const int64_t last = s.steps_per_epoch() - 1;
    ASSERT_LT(s.global_batch_rows(last), c.w);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      std::vector<int> seen(c.n, 0);
      for (int64_t step = 0; step <= last; ++step) {
        std::vector<int64_t> counts;
        for (int64_t r = 0; r < c.w; ++r) {
          auto idx = s.local_indices(epoch, step, r);
          EXPECT_EQ(idx.dim(), 1);
          counts.push_back(idx.size(0));
          for (int64_t i = 0; i < idx.size(0); ++i) seen[idx[i].item<int64_t>()]++;
        }
        if (step == last) EXPECT_EQ(counts, c.last_counts) << "n=" << c.n << " epoch " << epoch;
      }
      for (int64_t i = 0; i < c.n; ++i) ASSERT_EQ(seen[i], 1) << "n=" << c.n << " example " << i << " epoch " << epoch;
    }
  }
}

TEST(ShardedSampler, ReproducibleAndEpochsDiffer) {
  auto o = ct::ShardedSamplerOptions().global_batch_size(16).world_size(2).seed(42);
  ct::ShardedSampler a(500, o), b(500, o);
  EXPECT_TRUE(torch::equal(a.permutation(3), b.permutation(3)));
  EXPECT_FALSE(torch::equal(a.permutation(3), a.permutation(4)));
  ct::ShardedSampler c(500, o.seed(43));
  EXPECT_FALSE(torch::equal(a.permutation(3), c.permutation(3)));
  // Identical across independently built samplers, e.g. on different ranks.
  EXPECT_TRUE(torch::equal(ct::seeded_permutation(5, 1), ct::seeded_permutation(5, 1)));
  auto p = ct::seeded_permutation(1000, 9);
  EXPECT_TRUE(torch::equal(std::get<0>(p.sort()), torch::arange(1000, torch::kInt64)));
  ct::ShardedSampler plain(5, ct::ShardedSamplerOptions().shuffle(false).global_batch_size(2));
  EXPECT_TRUE(torch::equal(plain.global_indices(7, 2), torch::tensor({4}, torch::kInt64)));
}

TEST(ShardedSampler, ResumeReplaysTheSameBatches) {
  ct::ShardedSampler s(37, ct::ShardedSamplerOptions().global_batch_size(5).world_size(3).seed(1));
  std::vector<torch::Tensor> uninterrupted;
  ct::SamplerPosition pos;
  for (int64_t i = 0; i < 20; ++i, pos = s.next(pos)) uninterrupted.push_back(s.local_indices(pos.epoch, pos.step, 1));
  EXPECT_EQ(pos.epoch, 2);
  EXPECT_EQ(pos.step, 4);
  // A fresh sampler resuming at global step 11 continues identically.
  ct::ShardedSampler resumed(37, s.options());
  pos = resumed.position(11);
  EXPECT_EQ(resumed.global_step(pos), 11);
  for (int64_t i = 11; i < 20; ++i, pos = resumed.next(pos)) {
    EXPECT_TRUE(torch::equal(resumed.local_indices(pos.epoch, pos.step, 1), uninterrupted[i]));
  }
}

TEST(ShardedSampler, ErrorsNameTheArgument) {
  auto msg = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg([] { ct::ShardedSampler(0); }).find("ShardedSampler(): argument 'dataset_size' must be >= 1, but got 0"),
            std::string::npos);
  EXPECT_NE(msg([] { ct::ShardedSampler(5, ct::ShardedSamplerOptions().global_batch_size(0)); })
                .find("option 'global_batch_size' must be >= 1, but got 0"),
            std::string::npos);
  EXPECT_NE(msg([] { ct::ShardedSampler(5, ct::ShardedSamplerOptions().world_size(0)); })
                .find("option 'world_size' must be >= 1, but got 0"),
            std::string::npos);
  ct::ShardedSampler s(5, ct::ShardedSamplerOptions().global_batch_size(2).world_size(2));
  EXPECT_NE(msg([&] { s.local_indices(0, 3, 0); }).find("argument 'step' must be in [0, 3), but got 3"),
            std::string::npos);
  EXPECT_NE(msg([&] { s.local_indices(0, 0, 2); }).find("argument 'rank' must be in [0, 2), but got 2"),
            std::string::npos);
  EXPECT_NE(msg([&] { s.permutation(-1); }).find("argument 'epoch' must be >= 0, but got -1"), std::string::npos);
  EXPECT_NE(msg([] { ct::rank_slice(3, 2, 5); }).find("rank_slice(): argument 'rank' must be in [0, 2), but got 5"),
            std::string::npos);
}
