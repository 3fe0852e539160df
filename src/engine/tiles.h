// The tiled path's walks, shared by the engine's tiled blocks
// (engine/tiled_blocks.h) and SigLIP (src/losses/siglip.cpp): the loop over
// the steps of a logits block (the CPU's square tiles or a GPU's row panels,
// engine/panels.h), the diagonal of global entries inside a tile, and the key
// blocks a rank visits (every key at once, or every rank's block in turn as it
// travels around the ring). Internal to the engine (src/engine/), not installed.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

#include "contrax/comm/communicator.h"
#include "engine/panels.h"

namespace contrax::detail {

/// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of a logits block.
struct Tile {
  int64_t r0 = 0, rows = 0, c0 = 0, cols = 0;
};

/// Calls `fn` for every step of `walk` covering rows [0, rows) and columns
/// [0, cols) (tiles of walk.step(rows, cols), the last ones shorter), row
/// steps outer; `columns_outer`: column steps outer, so that what a column
/// tile accumulates (its keys' gradient) stays in cache across the row tiles
/// (panels span every column: the same order). Each step is counted
/// (steps_walked).
///
///   for_each_tile(b, n, walk, [&](const Tile& t) { ... q.narrow(0, t.r0, t.rows) ... });
void for_each_tile(int64_t rows, int64_t cols, const TileWalk& walk, const std::function<void(const Tile&)>& fn,
                   bool columns_outer = false);

/// The entries (i, offset + i) of global coordinates inside a tile whose first
/// row is global row `row0` and first column global column `col0`: a diagonal
/// view of the tile, writable in place (possibly empty). Masks or flips
/// positives by index instead of by buffer.
torch::Tensor tile_diagonal(const torch::Tensor& tile, int64_t row0, int64_t col0, int64_t offset);

/// The key blocks a tiled loss visits.
///
/// With a communicator of W > 1, every rank's block in turn, starting with this
/// rank's own while the others travel around the ring (contrax/comm/collectives.h:
/// at most two remote blocks held); otherwise one block holding every key,
/// owned by this rank. `counts[s]`: rows of rank s's block (ring).
class KeyBlocks {
 public:
  KeyBlocks(const CommunicatorPtr& comm, std::vector<int64_t> counts, int64_t rank);

  using Visit = std::function<void(int64_t owner, int64_t col0, const torch::Tensor& block)>;
  using VisitGrad = std::function<torch::Tensor(int64_t owner, int64_t col0, const torch::Tensor& block)>;

  /// visit(owner, col0, block) for every block; col0 is the block's first
  /// column in the global key order (0 for the single block).
  void for_each(const torch::Tensor& local, const Visit& visit) const;

  /// With `want_grad`, `visit` returns the gradient of its block (its shape),
  /// which travels back summed to the block's owner; the result is the
  /// gradient of `local`. Without, the blocks travel alone (undefined result).
  torch::Tensor for_each_grad(const torch::Tensor& local, bool want_grad, const VisitGrad& visit) const;

  /// Whether the blocks travel around the ring.
  bool ring() const { return comm_ != nullptr; }
  /// This rank's block (and the single block) belongs to `rank()`.
  int64_t rank() const { return rank_; }
  /// The first global column of every rank's block.
  const std::vector<int64_t>& starts() const { return starts_; }

 private:
  CommunicatorPtr comm_;  // null: one block
  std::vector<int64_t> counts_, starts_;
  int64_t rank_ = 0;
};

}  // namespace contrax::detail
