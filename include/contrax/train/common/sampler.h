// Sharded sampling: which examples each rank trains on at each step.
//
// Exactness across world sizes needs the ranks' local batches, concatenated in
// rank order, to be the global batch a single process would see. So the sampler
// draws one seeded global permutation per epoch (the same on every rank), cuts
// it into global batches of `global_batch_size` rows (the last one short and
// KEPT: the losses are exact for uneven batches), and gives rank r a contiguous
// part of each, as even as possible: the first `G mod W` ranks get one row
// more; in a tiny last batch some ranks get none. Everything is a pure function
// of (seed, epoch, step, rank), so a resumed run replays the same batches.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace contrax::train {

/// Options for `ShardedSampler`. Defaults: global batch 256, one rank, seed 0,
/// shuffled.
struct ShardedSamplerOptions {
  /// Rows per global batch (all ranks together), G >= 1.
  TORCH_ARG(int64_t, global_batch_size) = 256;
  /// Number of ranks W >= 1.
  TORCH_ARG(int64_t, world_size) = 1;
  /// Base seed; epoch e shuffles with a generator derived from (seed, e).
  TORCH_ARG(uint64_t, seed) = 0;
  /// false: the identity order every epoch (evaluation, debugging).
  TORCH_ARG(bool, shuffle) = true;
};

/// A position in training: `step` counts global batches within `epoch`.
struct SamplerPosition {
  int64_t epoch = 0;  ///< from 0
  int64_t step = 0;   ///< global batch within the epoch, from 0
  /// Equal epoch and step.
  bool operator==(const SamplerPosition& o) const { return epoch == o.epoch && step == o.step; }
};

/// Where one rank's rows sit inside a global batch.
struct RankSlice {
  int64_t offset = 0;  ///< off_r: first row of this rank within the global batch
  int64_t count = 0;   ///< b_r: rows of this rank (possibly 0)
};

/// Rank `rank`'s contiguous part of a global batch of `rows` rows split over
/// `world_size` ranks: the first `rows mod W` ranks get `rows / W + 1` rows,
/// the others `rows / W`.
///
///   contrax::train::rank_slice(10, 4, 3);   // {offset 8, count 2}
RankSlice rank_slice(int64_t rows, int64_t world_size, int64_t rank);

/// SplitMix64's finaliser: spreads a 64-bit value over the whole 64-bit
/// space. The mixer behind every seeded stream of the training data: the
/// epochs' permutations, the augmentations' per-example generators, the
/// retrieval corpus's split, feature hashes and hard-negative draws.
uint64_t splitmix64(uint64_t x);

/// Seeded Fisher-Yates permutation of [0, n) from a 64-bit Mersenne Twister
/// (fully specified by the C++ standard, so identical on every platform and
/// LibTorch release). Returns int64 [n].
torch::Tensor seeded_permutation(int64_t n, uint64_t seed);

/// Deterministic sharded sampler over a data set of `dataset_size` examples.
///
///   contrax::train::ShardedSampler sampler(60000,
///       contrax::train::ShardedSamplerOptions().global_batch_size(512).world_size(2).seed(1));
///   for (int64_t step = 0; step < sampler.steps_per_epoch(); ++step) {
///     auto idx = sampler.local_indices(epoch, step, rank);   // [b_r] int64
///   }
class ShardedSampler {
 public:
  /// A sampler over `dataset_size` (>= 1) examples; checks the options.
  ShardedSampler(int64_t dataset_size, ShardedSamplerOptions options = {});

  /// Number of examples N the sampler draws from.
  int64_t dataset_size() const { return dataset_size_; }
  /// The options the sampler was built with.
  const ShardedSamplerOptions& options() const { return options_; }

  /// ceil(N / G): the last global batch holds N mod G rows when that is non-zero.
  int64_t steps_per_epoch() const;

  /// Rows of global batch `step` (G, or fewer for the last one).
  int64_t global_batch_rows(int64_t step) const;

  /// The example order of `epoch`: int64 [N], the same on every rank.
  torch::Tensor permutation(int64_t epoch) const;

  /// Dataset indices of global batch `step` of `epoch`: int64 [rows].
  torch::Tensor global_indices(int64_t epoch, int64_t step) const;

  /// Dataset indices rank `rank` processes at (epoch, step): int64 [b_r], the
  /// rows [off_r, off_r + b_r) of the global batch.
  torch::Tensor local_indices(int64_t epoch, int64_t step, int64_t rank) const;

  /// Where `rank`'s rows sit in global batch `step`.
  RankSlice slice(int64_t step, int64_t rank) const;

  /// Global step count (over epochs) <-> position, for resuming from a step counter.
  SamplerPosition position(int64_t global_step) const;
  /// The global step count of position `pos` (the inverse of position()).
  int64_t global_step(const SamplerPosition& pos) const;
  /// The position after `pos` (rolls over into the next epoch).
  SamplerPosition next(const SamplerPosition& pos) const;

 private:
  int64_t dataset_size_;
  ShardedSamplerOptions options_;
  // The permutation of the most recent epoch: every step of an epoch reuses it.
  mutable std::mutex cache_mutex_;
  mutable int64_t cached_epoch_ = -1;
  mutable torch::Tensor cached_perm_;
};

}  // namespace contrax::train
