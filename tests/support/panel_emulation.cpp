// The CUDA panel kernels' grids as loops (see panel_emulation.h): each
// function mirrors its kernel's launch (cuda_*_panel.cu) and each block's
// combination of its threads' partials (cuda_strip_reduce.cuh).
#include "support/panel_emulation.h"

#include <array>
#include <vector>

namespace contrax::detail::panels {

namespace {

// A warp's butterfly over its lanes' values (offsets 16, 8, 4, 2, 1; lane l
// combines its value with lane l ^ off's, as __shfl_xor_sync gives it): the
// result of lane 0, which the kernels store.
template <typename T, typename Combine>
MaxSum<T> butterfly(std::array<MaxSum<T>, kWarp> lanes, Combine combine) {
  for (int off = kWarp / 2; off > 0; off /= 2) {
    std::array<MaxSum<T>, kWarp> next;
    for (int l = 0; l < kWarp; ++l) next[l] = combine(lanes[l], lanes[l ^ off]);
    lanes = next;
  }
  return lanes[0];
}

// One thread's partials of the strip rows (its registers on the GPU).
template <typename T>
struct RowAcc {
  MaxSum<T> v[kStripRows];
};

// reduce_strip_rows (cuda_strip_reduce.cuh) over one block's threads' partials.
template <typename T, typename Combine, typename Store>
void reduce_block_rows(const std::vector<RowAcc<T>>& acc, Combine combine, Store store) {
  MaxSum<T> shared[kWarps][kStripRows];
  for (int w = 0; w < kWarps; ++w) {
    for (int k = 0; k < kStripRows; ++k) {
      std::array<MaxSum<T>, kWarp> lanes;
      for (int l = 0; l < kWarp; ++l) lanes[l] = acc[w * kWarp + l].v[k];
      shared[w][k] = butterfly(lanes, combine);
    }
  }
  for (int lane = 0; lane < kWarp; ++lane) {
    MaxSum<T> p = shared[0][lane];
    for (int w = 1; w < kWarps; ++w) p = combine(p, shared[w][lane]);
    store(lane, p);
  }
}

}  // namespace

template <typename T>
void emulate_lse_panel(const LseArgs<T>& a, int sm_count) {
  if (a.rows <= 0 && a.cols <= 0) return;
  const StripGrid g = strip_grid(a.rows, a.cols, sm_count);
  const auto merge = [](MaxSum<T> x, MaxSum<T> y) { return math::merge(x, y); };
  if (g.strips > 0 && g.splits > 0 && (a.row_lse || a.col_m)) {
    std::vector<RowAcc<T>> acc(kThreads);
    for (int64_t strip = 0; strip < g.strips; ++strip) {
      for (int64_t split = 0; split < g.splits; ++split) {
        for (int t = 0; t < kThreads; ++t) lse_thread(a, g, strip, split, t, acc[t].v);
        if (!a.row_lse) continue;
        reduce_block_rows<T>(acc, merge, [&](int k, MaxSum<T> p) { lse_store_row(a, g, strip, split, k, p); });
      }
    }
  }
  const int64_t n = a.rows > a.cols ? a.rows : a.cols;
  if (a.row_lse || (a.col_m && g.strips > 0)) {
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    for (int64_t t = 0; t < blocks * kThreads; ++t) lse_finish_thread(a, g, t);
  }
}

template <typename T, typename Out>
void emulate_grad_panel(const GradArgs<T, Out>& a) {
  const TileGrid g = tile_grid(a.rows, a.cols);
  for (int64_t y = 0; y < g.grid_y; ++y) {
    for (int64_t x = 0; x < g.col_tiles; ++x) {
      for (int64_t row_tile = y; row_tile < g.row_tiles; row_tile += g.grid_y) {
        for (int t = 0; t < kThreads; ++t) grad_thread(a, x, row_tile, t);
      }
    }
  }
}

template <typename T, typename Out>
void emulate_siglip_panel(const SiglipArgs<T, Out>& a, int sm_count) {
  if (a.rows <= 0) return;
  const StripGrid g = strip_grid(a.rows, a.cols, sm_count);
  const auto add = [](MaxSum<T> x, MaxSum<T> y) { return add_sums(x, y); };
  for (int64_t strip = 0; strip < g.strips; ++strip) {
    for (int64_t split = 0; split < g.splits; ++split) {
      for (int warp = 0; warp < kWarps; ++warp) {
        for (int k = warp; k < kStripRows && strip * kStripRows + k < a.rows; k += kWarps) {
          std::array<MaxSum<T>, kWarp> lanes;
          for (int l = 0; l < kWarp; ++l) lanes[l] = siglip_lane(a, g, strip, split, k, l);
          siglip_store_row(a, g, strip, split, k, butterfly(lanes, add));
        }
      }
    }
  }
  const int64_t blocks = (a.rows + kThreads - 1) / kThreads;
  for (int64_t t = 0; t < blocks * kThreads; ++t) siglip_finish_thread(a, g, t);
}

template void emulate_lse_panel<float>(const LseArgs<float>&, int);
template void emulate_lse_panel<double>(const LseArgs<double>&, int);
template void emulate_grad_panel<float, float>(const GradArgs<float, float>&);
template void emulate_grad_panel<double, double>(const GradArgs<double, double>&);
template void emulate_grad_panel<double, float>(const GradArgs<double, float>&);
template void emulate_siglip_panel<float, float>(const SiglipArgs<float, float>&, int);
template void emulate_siglip_panel<double, double>(const SiglipArgs<double, double>&, int);

}  // namespace contrax::detail::panels
