// The launch counts of loss calls walking as CUDA does (see
// support/launch_counts.h).
#include "support/launch_counts.h"

#include <torch/torch.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "contrax/engine/workspace.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/siglip.h"
#include "contrax/losses/tiled.h"
#include "contrax/util/memory.h"
#include "engine/lse_kernels.h"
#include "engine/panels.h"
#include "support/op_counter.h"
#include "support/ranks.h"

namespace contrax::testing {

CudaWalk::CudaWalk(int64_t budget, bool aten_passes) {
  detail::set_panels_everywhere(true);
  set_loss_panel_bytes(budget);
  if (aten_passes) detail::set_fused_kernels_enabled(false);
}

CudaWalk::~CudaWalk() {
  detail::set_panels_everywhere(false);
  set_loss_panel_bytes(0);
  detail::set_fused_kernels_enabled(true);
}

WalkingAsCuda::WalkingAsCuda(const std::string& loss, int64_t cols_of, int64_t d, int64_t panel_rows, bool fused) {
  const int64_t cols = loss == "nt_xent" || loss == "grouped" ? 2 * cols_of : cols_of;
  const int64_t budget = detail::panel_workspace_bytes(c10::kCPU, torch::kFloat, {panel_rows, cols}, d);
  if (fused) {
    emulated_ = std::make_unique<EmulatedCudaWalk>(4);
    set_loss_panel_bytes(budget);
  } else {
    detail::set_fused_kernels_enabled(false);
    aten_ = std::make_unique<CudaWalk>(budget, true);
  }
  if (loss != "nt_xent") detail::set_bounded_shift_enabled(false);
}

WalkingAsCuda::~WalkingAsCuda() {
  detail::set_bounded_shift_enabled(true);
  if (emulated_) set_loss_panel_bytes(0);
}

std::pair<PathCost, bool> plan_call(const std::string& loss, MemoryPath path, int64_t B, int64_t d, int64_t world) {
  const auto plan = plan_loss(PlanOptions()
                                  .loss(loss)
                                  .group(loss == "grouped" ? 2 : 1)
                                  .batch(B)
                                  .width(d)
                                  .world(world)
                                  .panel_bytes(loss_panel_bytes())
                                  .path(path));
  return {plan.paths[world > 1 ? 2 : path == MemoryPath::kTiled ? 1 : 0], plan.fused};
}

namespace {

// The inputs of one rank's call: b rows (this rank's, on the ring), drawn
// before the counting starts.
struct Inputs {
  torch::Tensor x, y, ls, k1, k2, cands;
  Inputs(int64_t b, int64_t d)
      : x(torch::randn({b, d}).requires_grad_(true)),
        y(torch::randn({b, d}).requires_grad_(true)),
        ls(torch::tensor(std::log(10.0f)).requires_grad_(true)),
        k1(torch::randn({b, d})),
        k2(torch::randn({b, d})),
        cands(torch::randn({b * 2, d}).requires_grad_(true)) {}
};

// One forward + backward of `loss` (with `comm`: on the ring).
void call_loss(const std::string& loss, MemoryPath path, const Inputs& in, const CommunicatorPtr& comm) {
  const bool ring = comm != nullptr;
  auto on = [&](auto options) { return options.path(path).comm(comm).ring(ring); };
  torch::Tensor l;
  if (loss == "clip" || loss == "infonce") {
    l = clip_loss(in.x, in.y, in.ls, {}, on(ClipLossOptions().symmetric(loss == "clip")));
  } else if (loss == "grouped") {
    l = grouped_loss(in.x, in.cands, in.ls, {}, on(GroupedLossOptions()));
  } else if (loss == "nt_xent") {
    l = nt_xent_loss(in.x, in.y, on(NTXentLossOptions()));
  } else if (loss == "siglip") {
    l = siglip_loss(in.x, in.y, in.ls, {}, on(SigLipLossOptions()));
  } else {
    l = moco_v3_loss(in.x, in.y, in.k1, in.k2, on(MocoV3LossOptions()));
  }
  l.backward();
}

}  // namespace

Counted count_call(const std::string& loss, MemoryPath path, int64_t B, int64_t d, int64_t panel_rows, bool fused,
                   int64_t world) {
  torch::manual_seed(6);
  const int64_t b = B / world;
  if (world > 1) path = MemoryPath::kTiled;
  WalkingAsCuda walking(loss, b, d, panel_rows, fused);
  std::vector<Inputs> in;
  for (int64_t r = 0; r < world; ++r) in.emplace_back(b, d);
  Counted c;
  const int64_t steps = detail::steps_walked();
  {
    const int64_t kernels = emulated_launches();
    OpCounter ops;
    if (world == 1) {
      call_loss(loss, path, in[0], nullptr);
    } else {
      run_ranks(world, [&](const CommunicatorPtr& comm) { call_loss(loss, path, in[comm->rank()], comm); });
    }
    const int64_t launched = emulated_launches() - kernels;
    c.launches = (ops.launches() + launched) / world;
    c.summary = ops.summary() + (fused ? ", panel kernels " + std::to_string(launched) : std::string());
  }
  c.steps = (detail::steps_walked() - steps) / world;
  // The plan of the same call under the same walk (the CPU walking as CUDA).
  std::tie(c.planned, c.plan_fused) = plan_call(loss, path, B, d, world);
  return c;
}

}  // namespace contrax::testing
