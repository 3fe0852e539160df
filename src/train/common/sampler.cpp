// Sharded sampler: seeded per-epoch permutation, global batches, contiguous
// rank slices. Pure functions of (seed, epoch, step, rank).
#include "contrax/train/common/sampler.h"

#include <random>

namespace contrax::train {
namespace {

// Uniform integer in [0, bound) without modulo bias (rejection on the top
// partial range). std::uniform_int_distribution's algorithm is
// implementation-defined; this one is not.
uint64_t bounded(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - (UINT64_MAX % bound);
  uint64_t x = rng();
  while (x >= limit) x = rng();
  return x % bound;
}

}  // namespace

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

RankSlice rank_slice(int64_t rows, int64_t world_size, int64_t rank) {
  TORCH_CHECK(rows >= 0, "rank_slice(): argument 'rows' must be >= 0, but got ", rows);
  TORCH_CHECK(world_size >= 1, "rank_slice(): argument 'world_size' must be >= 1, but got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "rank_slice(): argument 'rank' must be in [0, ", world_size,
              "), but got ", rank);
  const int64_t base = rows / world_size;
  const int64_t extra = rows % world_size;
  return RankSlice{rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

torch::Tensor seeded_permutation(int64_t n, uint64_t seed) {
  TORCH_CHECK(n >= 0, "seeded_permutation(): argument 'n' must be >= 0, but got ", n);
  auto perm = torch::arange(n, torch::kInt64);
  auto* p = perm.data_ptr<int64_t>();
  std::mt19937_64 rng(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(p[i], p[bounded(rng, static_cast<uint64_t>(i) + 1)]);
  }
  return perm;
}

ShardedSampler::ShardedSampler(int64_t dataset_size, ShardedSamplerOptions options)
    : dataset_size_(dataset_size), options_(std::move(options)) {
  TORCH_CHECK(dataset_size >= 1, "ShardedSampler(): argument 'dataset_size' must be >= 1, but got ",
              dataset_size);
  TORCH_CHECK(options_.global_batch_size() >= 1,
              "ShardedSampler(): option 'global_batch_size' must be >= 1, but got ",
              options_.global_batch_size());
  TORCH_CHECK(options_.world_size() >= 1, "ShardedSampler(): option 'world_size' must be >= 1, but got ",
              options_.world_size());
}

int64_t ShardedSampler::steps_per_epoch() const {
  const int64_t g = options_.global_batch_size();
  return (dataset_size_ + g - 1) / g;
}

int64_t ShardedSampler::global_batch_rows(int64_t step) const {
  TORCH_CHECK(step >= 0 && step < steps_per_epoch(), "ShardedSampler: argument 'step' must be in [0, ",
              steps_per_epoch(), "), but got ", step);
  const int64_t g = options_.global_batch_size();
  return std::min(g, dataset_size_ - step * g);
}

torch::Tensor ShardedSampler::permutation(int64_t epoch) const {
  TORCH_CHECK(epoch >= 0, "ShardedSampler: argument 'epoch' must be >= 0, but got ", epoch);
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (epoch != cached_epoch_) {
    cached_perm_ = options_.shuffle()
                       ? seeded_permutation(dataset_size_, splitmix64(options_.seed() ^ splitmix64(uint64_t(epoch))))
                       : torch::arange(dataset_size_, torch::kInt64);
    cached_epoch_ = epoch;
  }
  return cached_perm_;
}

torch::Tensor ShardedSampler::global_indices(int64_t epoch, int64_t step) const {
  const int64_t rows = global_batch_rows(step);
  return permutation(epoch).narrow(0, step * options_.global_batch_size(), rows).clone();
}

RankSlice ShardedSampler::slice(int64_t step, int64_t rank) const {
  TORCH_CHECK(rank >= 0 && rank < options_.world_size(), "ShardedSampler: argument 'rank' must be in [0, ",
              options_.world_size(), "), but got ", rank);
  return rank_slice(global_batch_rows(step), options_.world_size(), rank);
}

torch::Tensor ShardedSampler::local_indices(int64_t epoch, int64_t step, int64_t rank) const {
  const RankSlice s = slice(step, rank);
  return permutation(epoch)
      .narrow(0, step * options_.global_batch_size() + s.offset, s.count)
      .clone();
}

SamplerPosition ShardedSampler::position(int64_t global_step) const {
  TORCH_CHECK(global_step >= 0, "ShardedSampler: argument 'global_step' must be >= 0, but got ", global_step);
  return SamplerPosition{global_step / steps_per_epoch(), global_step % steps_per_epoch()};
}

int64_t ShardedSampler::global_step(const SamplerPosition& pos) const {
  return pos.epoch * steps_per_epoch() + pos.step;
}

SamplerPosition ShardedSampler::next(const SamplerPosition& pos) const {
  return pos.step + 1 < steps_per_epoch() ? SamplerPosition{pos.epoch, pos.step + 1}
                                          : SamplerPosition{pos.epoch + 1, 0};
}

}  // namespace contrax::train
