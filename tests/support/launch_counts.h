// The launches a loss call makes on the CPU walking as CUDA does, and
// plan_loss's model of the same call (src/check/plan.cpp: the launch model):
// what panels_test checks the model against. The ATen operators that launch
// work are counted by support/op_counter.h, the fused CUDA panel kernels by
// the SIMT emulator (support/emulated_panels.h). Test support.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "contrax/check/plan.h"
#include "contrax/util/vocabulary.h"
#include "support/emulated_panels.h"

namespace contrax::testing {

/// The CUDA walk on the CPU for the scope: panels everywhere, under `budget`,
/// optionally with the element-wise passes in their ATen forms (what CUDA runs).
class CudaWalk {
 public:
  explicit CudaWalk(int64_t budget, bool aten_passes = false);
  ~CudaWalk();
  CudaWalk(const CudaWalk&) = delete;
  CudaWalk& operator=(const CudaWalk&) = delete;
};

/// The CPU walking as CUDA does for one call of `loss` whose blocks have
/// `cols_of` key rows per query block (B: its batch; the ring: one rank's
/// rows), of width d: panels of `panel_rows` rows, the ATen forms of the
/// element-wise passes or the fused kernels under the SIMT emulator (4
/// multiprocessors), and except for NT-Xent no bounded shift (the CLIP
/// block's is CPU-only: it reads the bound on the host, which CUDA never does).
class WalkingAsCuda {
 public:
  WalkingAsCuda(const std::string& loss, int64_t cols_of, int64_t d, int64_t panel_rows, bool fused);
  ~WalkingAsCuda();
  WalkingAsCuda(const WalkingAsCuda&) = delete;
  WalkingAsCuda& operator=(const WalkingAsCuda&) = delete;

 private:
  std::unique_ptr<CudaWalk> aten_;
  std::unique_ptr<EmulatedCudaWalk> emulated_;
};

/// plan_loss's cost of a call of `loss` on `path` (kTiled, kMaterialised, or
/// with `world` > 1 the ring: `path` ignored) at batch B and width d under the
/// walk in force, and whether it planned the fused kernels.
std::pair<PathCost, bool> plan_call(const std::string& loss, MemoryPath path, int64_t B, int64_t d,
                                    int64_t world = 1);

/// One forward + backward, counted.
struct Counted {
  int64_t launches = 0, steps = 0;  // per rank (ranks of equal rows: the totals over W)
  std::string summary;
  PathCost planned;  // plan_loss's cost of the same path and walk
  bool plan_fused = false;
};

/// A forward + backward of `loss` ("clip", "infonce", "grouped" (g = 2),
/// "nt_xent", "moco_v3", "siglip") on B rows of width d, fp32, the losses'
/// defaults, walking as CUDA does with panels of `panel_rows` rows; with
/// `world` > 1, on the ring over `world` thread ranks of B / world rows each
/// (`path` ignored).
Counted count_call(const std::string& loss, MemoryPath path, int64_t B, int64_t d, int64_t panel_rows,
                   bool fused = false, int64_t world = 1);

}  // namespace contrax::testing
