// The tiled path's walks (see engine/tiles.h).
#include "engine/tiles.h"

#include <algorithm>

#include "contrax/comm/collectives.h"

namespace contrax::detail {

void for_each_tile(int64_t rows, int64_t cols, const TileWalk& walk, const std::function<void(const Tile&)>& fn,
                   bool columns_outer) {
  const auto step = walk.step(rows, cols);
  const int64_t R = std::max<int64_t>(step.rows, 1), C = std::max<int64_t>(step.cols, 1);
  auto visit = [&](int64_t r0, int64_t c0) {
    count_steps(1);
    fn({r0, std::min(R, rows - r0), c0, std::min(C, cols - c0)});
  };
  if (columns_outer) {
    for (int64_t c0 = 0; c0 < cols; c0 += C) {
      for (int64_t r0 = 0; r0 < rows; r0 += R) visit(r0, c0);
    }
    return;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    for (int64_t c0 = 0; c0 < cols; c0 += C) visit(r0, c0);
  }
}

torch::Tensor tile_diagonal(const torch::Tensor& tile, int64_t row0, int64_t col0, int64_t offset) {
  // Entry (i, offset + i) sits at tile (i - row0, offset + i - col0): the tile
  // diagonal with column shift offset + row0 - col0.
  const int64_t shift = offset + row0 - col0;
  if (shift >= tile.size(1) || -shift >= tile.size(0)) return tile.narrow(0, 0, 0).select(1, 0);
  return tile.diagonal(shift);
}

KeyBlocks::KeyBlocks(const CommunicatorPtr& comm, std::vector<int64_t> counts, int64_t rank)
    : comm_(comm && comm->world_size() > 1 ? comm : nullptr), counts_(std::move(counts)), rank_(rank) {
  starts_.assign(counts_.size(), 0);
  for (size_t s = 1; s < counts_.size(); ++s) starts_[s] = starts_[s - 1] + counts_[s - 1];
}

void KeyBlocks::for_each(const torch::Tensor& local, const Visit& visit) const {
  if (!comm_) return visit(rank_, 0, local);
  ring_for_each_block(comm_, counts_, local,
                      [&](int64_t owner, const torch::Tensor& block) { visit(owner, starts_[owner], block); });
}

torch::Tensor KeyBlocks::for_each_grad(const torch::Tensor& local, bool want_grad, const VisitGrad& visit) const {
  if (!comm_) {
    auto g = visit(rank_, 0, local);
    return want_grad ? g : torch::Tensor();
  }
  if (!want_grad) {
    ring_for_each_block(comm_, counts_, local,
                        [&](int64_t owner, const torch::Tensor& block) { visit(owner, starts_[owner], block); });
    return {};
  }
  return ring_for_each_block_grad(comm_, counts_, local, [&](int64_t owner, const torch::Tensor& block) {
    return visit(owner, starts_[owner], block);
  });
}

}  // namespace contrax::detail
