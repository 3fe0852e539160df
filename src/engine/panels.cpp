// The walk of a logits block sized for its device (see engine/panels.h), and
// the panel budget's setting (contrax/engine/workspace.h).
#include "engine/panels.h"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "contrax/engine/workspace.h"
#include "contrax/util/memory.h"
#include "engine/lse_kernels.h"
#include "engine/precision.h"
#include "util/env.h"

namespace contrax {

namespace detail {

namespace {

std::atomic<int64_t>& panel_bytes_setting() {
  static std::atomic<int64_t> bytes{[] {
    const int64_t v = env_int("CONTRAX_PANEL_BYTES", 0, "a non-negative number of bytes (0: automatic)",
                              "contrax (the loss engine's panel budget)");
    TORCH_CHECK(v >= 0, "contrax (the loss engine's panel budget): environment variable 'CONTRAX_PANEL_BYTES' must be "
                        "a non-negative number of bytes (0: automatic), but got ", v);
    return v;
  }()};
  return bytes;
}

std::atomic<bool>& panels_everywhere_flag() {
  static std::atomic<bool> on{false};
  return on;
}

int64_t round_down(int64_t x, int64_t m) { return x / m * m; }

// Whether reduced operands multiply without being widened: the mixed-dtype
// GEMMs are CUDA kernels (the CPU, and CUDA on an older LibTorch, widen).
bool mixed_on(c10::DeviceType device) { return device == c10::kCUDA && mixed_gemm_available(); }

std::atomic<int64_t>& steps_counter() {
  static std::atomic<int64_t> n{0};
  return n;
}

}  // namespace

int64_t default_panel_bytes(int64_t device_memory) {
  const int64_t gib = int64_t{1} << 30;
  return device_memory >= int64_t{40} * 1000 * 1000 * 1000 ? gib + gib / 2 : gib;
}

int64_t panel_budget(const c10::Device& device) {
  const int64_t set = loss_panel_bytes();
  if (set > 0) return set;
  // The device's total memory plus one, read once per CUDA device (0: not
  // yet read).
  static std::atomic<int64_t> total[64];
  if (!device.is_cuda()) return default_panel_bytes(0);
  auto& slot = total[std::clamp<int>(device.has_index() ? device.index() : 0, 0, 63)];
  int64_t m = slot.load();
  if (m == 0) slot.store(m = device_memory_bytes(device) + 1);
  return default_panel_bytes(m - 1);
}

bool panels_on(c10::DeviceType device) { return device == c10::kCUDA || panels_everywhere(); }
bool panels_everywhere() { return panels_everywhere_flag().load(std::memory_order_relaxed); }
void set_panels_everywhere(bool on) { panels_everywhere_flag().store(on); }

bool fused_passes(c10::DeviceType device) {
  if (!fused_kernels_enabled()) return false;
  // The CPU standing in for CUDA (emulated panel kernels) is fused where
  // CUDA would be.
  if (device == c10::kCPU) return !emulated_panel_kernels_installed() || cuda_fused_kernels_enabled();
  return device == c10::kCUDA && cuda_fused_kernels_enabled() && cuda_fused_kernels_built();
}

int64_t panel_entry_bytes(c10::DeviceType device, c10::ScalarType dtype) {
  const auto compute = compute_dtype(dtype), operand = operand_dtype(dtype, c10::Device(device));
  const int64_t e = static_cast<int64_t>(c10::elementSize(compute));
  const int64_t temporary = fused_passes(device) ? 0 : e;
  int64_t cast = 0;
  if (operand != compute) cast = static_cast<int64_t>(c10::elementSize(operand)) + (mixed_on(device) ? 0 : e);
  return e + std::max(temporary, cast);
}

int64_t panel_workspace_bytes(c10::DeviceType device, c10::ScalarType dtype, const StepShape& shape, int64_t width) {
  const auto compute = compute_dtype(dtype), operand = operand_dtype(dtype, c10::Device(device));
  int64_t bytes = shape.rows * shape.cols * panel_entry_bytes(device, dtype);
  if (operand != compute && !mixed_on(device)) {
    bytes += (shape.rows + shape.cols) * width * static_cast<int64_t>(c10::elementSize(compute));
  }
  return bytes;
}

StepShape panel_shape(c10::DeviceType device, c10::ScalarType dtype, int64_t rows, int64_t cols, int64_t width,
                      int64_t budget) {
  StepShape s{kMaxPanelRows, std::max<int64_t>(cols, 1)};
  // The largest multiple of 256 rows whose workspace fits: the workspace is
  // affine in the rows (panel_workspace_bytes), so from its cost per row and
  // the part that does not depend on them.
  const int64_t fixed = panel_workspace_bytes(device, dtype, {0, s.cols}, width);
  const int64_t per_row = panel_workspace_bytes(device, dtype, {1, s.cols}, width) - fixed;
  const int64_t fit = budget > fixed ? (budget - fixed) / std::max<int64_t>(per_row, 1) : 0;
  s.rows = std::clamp<int64_t>(round_down(fit, kMinPanelRows), kMinPanelRows, kMaxPanelRows);
  s.rows = std::max<int64_t>(1, std::min(s.rows, rows));
  s.cols = cols;
  return s;
}

int64_t buffer_panel_rows(c10::DeviceType device, c10::ScalarType dtype, int64_t rows, int64_t cols, int64_t width,
                          int64_t budget) {
  if (panels_on(device)) return panel_shape(device, dtype, rows, cols, width, budget).rows;
  const int64_t e = static_cast<int64_t>(c10::elementSize(compute_dtype(dtype)));
  const int64_t fit = (int64_t{8} << 20) / std::max<int64_t>(1, cols * e);
  return std::min(std::max<int64_t>(fit, 256), std::max<int64_t>(rows, 1));
}

StepShape pair_step(int64_t rows, int64_t cols, int64_t pair_bytes, int64_t budget, int64_t cap) {
  const int64_t per_pair = std::max<int64_t>(pair_bytes, 1), most = std::max<int64_t>(cap, 1);
  const int64_t r = std::clamp<int64_t>(budget / per_pair, 1, std::min(most, std::max<int64_t>(rows, 1)));
  const int64_t c = std::clamp<int64_t>(budget / (per_pair * r), 1, std::min(most, std::max<int64_t>(cols, 1)));
  return {r, c};
}

int64_t tile_side(int64_t tile_size, int64_t tile_bytes, int64_t element_size) {
  if (tile_size > 0) return tile_size;
  const double side = std::sqrt(static_cast<double>(tile_bytes) / static_cast<double>(element_size));
  return std::max<int64_t>(64, static_cast<int64_t>(side));
}

StepShape TileWalk::step(int64_t rows, int64_t cols) const {
  if (pair_bytes > 0) return pair_step(rows, cols, pair_bytes, budget, tile);
  if (panels) return panel_shape(device, dtype, rows, cols, width, budget);
  return {tile, tile};
}

TileWalk make_walk(c10::DeviceType device, c10::ScalarType dtype, int64_t width, int64_t tile_size, int64_t tile_bytes,
                   int64_t budget) {
  TileWalk w;
  w.device = device;
  w.dtype = dtype;
  w.width = width;
  w.tile = tile_side(tile_size, tile_bytes, static_cast<int64_t>(c10::elementSize(compute_dtype(dtype))));
  w.panels = tile_size <= 0 && panels_on(device);
  if (w.panels) w.budget = budget;
  return w;
}

TileWalk make_walk(const torch::Tensor& features, int64_t tile_size, int64_t tile_bytes) {
  const auto device = features.device();
  const bool panels = tile_size <= 0 && panels_on(device.type());
  return make_walk(device.type(), features.scalar_type(), features.dim() == 2 ? features.size(1) : 0, tile_size,
                   tile_bytes, panels ? panel_budget(device) : 0);
}

int64_t steps_walked() { return steps_counter().load(); }
void count_steps(int64_t n) { steps_counter().fetch_add(n, std::memory_order_relaxed); }

}  // namespace detail

void set_loss_panel_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "set_loss_panel_bytes(): argument 'bytes' must be >= 0 (0: automatic), but got ", bytes);
  detail::panel_bytes_setting().store(bytes);
}

int64_t loss_panel_bytes() { return detail::panel_bytes_setting().load(std::memory_order_relaxed); }

}  // namespace contrax
