// How the engine walks a block of logits on each device (docs/engine.md,
// "Panels on a GPU"): the CPU in square tiles that stay in its caches
// (`tile_bytes`); CUDA, on every memory path, in row panels of all the columns
// of a block, as many rows as a workspace budget allows (few, large launches:
// 32 MiB tiles meant ~16,000 launches for CLIP at B = 65,536). The sizing is a
// pure function of the device type, the dtype and the shapes, so the CPU tests
// check what a GPU would do, and `plan_loss` reports the same panels. Internal
// (src/engine/).
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace contrax::detail {

/// Rows and columns of each step of a walk (the last ones may be shorter).
struct StepShape {
  int64_t rows = 0, cols = 0;
};

/// Fewest and most rows of a panel: fewer rows cost the GEMMs efficiency, more
/// than 8,192 buy nothing (a panel's GEMM is already ~1 GFLOP per 64 columns
/// of width) and lengthen the last panel's tail.
inline constexpr int64_t kMinPanelRows = 256, kMaxPanelRows = 8192;

/// The automatic panel budget for a device of `device_memory` bytes (0:
/// unknown): 1 GiB, and 1.5 GiB from 40 GB.
int64_t default_panel_bytes(int64_t device_memory);

/// The panel budget on `device`: loss_panel_bytes() when set, otherwise the
/// automatic one for its memory (looked up once per device).
int64_t panel_budget(const c10::Device& device);

/// Whether walks on `device` take panels: CUDA, or any device while
/// set_panels_everywhere is on (what the CPU tests use to run the GPU's walk).
bool panels_on(c10::DeviceType device);
bool panels_everywhere();
void set_panels_everywhere(bool on);

/// Whether the element-wise passes over a panel hold no panel-sized
/// temporary on `device`: the CPU's fused kernels (engine/lse_kernels.h) where
/// enabled, CUDA's panel kernels where built and switched on (and the CPU's
/// walk while emulated ones stand in for them); the ATen forms hold one.
bool fused_passes(c10::DeviceType device);

/// Bytes a panel holds per logit on `device` for features of `dtype`: the
/// logits in the compute dtype e, plus the larger of what comes and goes
/// beside them: the ATen passes' temporary (e; none when fused), or in the
/// backward the gradient panel cast to the operand dtype f (reduced operands
/// only; plus its widened copy e where there is no mixed-dtype GEMM: off
/// CUDA, or on a LibTorch without it).
/// CUDA, bf16 features, ATen passes: 4 + max(4, 2) = 8; the fused CUDA
/// kernels: 4 + 2 = 6.
int64_t panel_entry_bytes(c10::DeviceType device, c10::ScalarType dtype);

/// The panel over a block of `rows` x `cols` logits for features of `dtype`
/// and `width`: every column, and the rows whose workspace
/// (panel_workspace_bytes) fits `budget`, in multiples of 256 within
/// [kMinPanelRows, kMaxPanelRows] and at most `rows` (at least 1).
StepShape panel_shape(c10::DeviceType device, c10::ScalarType dtype, int64_t rows, int64_t cols, int64_t width,
                      int64_t budget);

/// Bytes a walk in steps of `shape` holds at once: shape.rows x shape.cols x
/// panel_entry_bytes, plus, for reduced operands without a mixed-dtype GEMM,
/// the widened [C, d] and [R, d] operands of each accumulation.
int64_t panel_workspace_bytes(c10::DeviceType device, c10::ScalarType dtype, const StepShape& shape, int64_t width);

/// Rows per panel of the materialised path's [rows x cols] logits buffer: its
/// GEMM, its statistics and (in backward) its gradient and the GEMMs that
/// consume it run panel by panel. On the CPU about 8 MiB and at least 256
/// rows, so the element-wise passes read the panel from cache (fewer rows cost
/// the GEMMs efficiency: measured 1.3x slower at 64 rows, equal from 256).
/// Where panels are on (CUDA): panel_shape's rows under `budget`, so the ATen
/// passes' temporaries and the gradient panel in the operand dtype stay within
/// the budget instead of a second whole buffer, in few large launches.
int64_t buffer_panel_rows(c10::DeviceType device, c10::ScalarType dtype, int64_t rows, int64_t cols, int64_t width,
                          int64_t budget);

/// A step over `rows` x `cols` pairs whose work takes `pair_bytes` each (a
/// scorer's beyond one dot product: MaxSim's token scores, engine/maxsim.h),
/// within `budget` bytes: as many rows as one column's work for them fits, then
/// as many columns as fit beside them, each at least 1 and at most `cap`.
StepShape pair_step(int64_t rows, int64_t cols, int64_t pair_bytes, int64_t budget, int64_t cap);

/// Side of a square logits tile: `tile_size` if positive, otherwise the largest
/// side whose tile fits `tile_bytes` at `element_size`, at least 64.
int64_t tile_side(int64_t tile_size, int64_t tile_bytes, int64_t element_size);

/// How a loss walks its logits blocks: an explicit tile side, the CPU's
/// cache-sized tiles, or the device's panels. Made once per call by the
/// prologue (make_walk), asked per block (a ring's blocks differ in rows).
struct TileWalk {
  c10::DeviceType device = c10::kCPU;
  c10::ScalarType dtype = c10::kFloat;  // the features' dtype
  int64_t width = 0;
  int64_t tile = 64;    // side of a square tile (explicit or from tile_bytes)
  bool panels = false;  // panels instead of tiles
  int64_t budget = 0;   // panels: the workspace budget; pair_bytes: the budget of a step's pairs
  /// A scorer's bytes of work per (row, column) pair (MaxSim's token scores);
  /// positive: steps of pair_step within `budget`, at most `tile` a side.
  int64_t pair_bytes = 0;

  /// Each step's shape over a [rows x cols] block.
  StepShape step(int64_t rows, int64_t cols) const;
};

/// The walk for features like `features` (device, dtype, width): square tiles
/// of `tile_size` when positive, panels where panels_on(device), otherwise
/// tiles of about `tile_bytes` (tile_side in engine/prologue.h).
TileWalk make_walk(const torch::Tensor& features, int64_t tile_size, int64_t tile_bytes);

/// The same from the features' description and the panel budget (what
/// plan_loss walks without tensors).
TileWalk make_walk(c10::DeviceType device, c10::ScalarType dtype, int64_t width, int64_t tile_size, int64_t tile_bytes,
                   int64_t budget);

/// Steps (tiles or panels) walked in this process, by for_each_tile
/// (engine/tiles.h) and the materialised path's panel loops, each counting
/// its own with count_steps: what the tests compare with the plan's panels.
int64_t steps_walked();
void count_steps(int64_t n);

}  // namespace contrax::detail
