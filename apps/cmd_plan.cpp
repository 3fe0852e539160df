// `contrax plan`: what a loss call will cost before it runs — per path
// (materialised, tiled, ring) the logits and feature bytes a rank holds, the
// GEMM work, the bytes each rank sends forward and backward, and which path
// the losses' automatic routing picks. No process group is started.
//
//   contrax plan --loss clip --batch 32768 --width 512 --world 4
//   contrax plan --loss nt_xent --batch 4096 --world 2 --dtype half --json
#include <iostream>

#include "cli.h"
#include "contrax/plan.h"

namespace {

c10::ScalarType dtype_of(const std::string& s) {
  if (s == "float" || s == "fp32" || s == "float32") return c10::kFloat;
  if (s == "double" || s == "fp64" || s == "float64") return c10::kDouble;
  if (s == "half" || s == "fp16" || s == "float16") return c10::kHalf;
  if (s == "bf16" || s == "bfloat16") return c10::kBFloat16;
  TORCH_CHECK(false, "flag '--dtype' takes float, double, half or bf16, but got '", s, "'");
}

int run_plan(const std::vector<std::string>& args) {
  contrax::cli::Args a("plan", args);
  const std::string loss = a.get("loss", "clip", "clip (symmetric), infonce, nt_xent or moco_v3");
  const int64_t batch = a.get_int("batch", 8192, "global batch B (rows per view)");
  const int64_t width = a.get_int("width", 256, "feature width d");
  const int64_t world = a.get_int("world", 1, "number of ranks W");
  const std::string dtype = a.get("dtype", "float", "feature dtype: float, double, half, bf16");
  const int64_t tile = a.get_int("tile-size", 0, "the losses' tile_size: 0 automatic, -1 materialised, > 0 tiled");
  const bool ring = a.flag("ring", "tiled path with key blocks around the ring");
  const int64_t max_logits = a.get_int("max-logits-bytes", int64_t{256} << 20, "automatic routing threshold");
  const bool json = a.flag("json", "print one JSON object instead of the table");
  if (a.finish()) return 0;
  auto plan = contrax::plan_loss(contrax::PlanOptions()
                                     .loss(loss)
                                     .batch(batch)
                                     .width(width)
                                     .world(world)
                                     .dtype(dtype_of(dtype))
                                     .tile_size(tile)
                                     .ring(ring)
                                     .max_logits_bytes(max_logits));
  std::cout << (json ? contrax::to_json(plan) + "\n" : contrax::to_string(plan)) << std::flush;
  return 0;
}

contrax::cli::Command plan_cmd("plan", "cost of each loss path (memory, GEMMs, bytes) and the automatic choice",
                               run_plan);

}  // namespace
