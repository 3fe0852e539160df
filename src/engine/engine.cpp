// The engine's seam (see engine/engine.h): each block on the path its
// prologue chose.
#include "engine/engine.h"

#include "engine/materialised_blocks.h"
#include "engine/tiled_blocks.h"

namespace contrax::detail {

torch::Tensor clip_block_loss(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                              const torch::Tensor& bias, const Prologue& p, const BlockSpec& spec) {
  TORCH_INTERNAL_ASSERT(spec.group >= 1 && (!spec.symmetric || spec.group == 1));
  if (p.tiled) return tiled_clip_block(q, k, scale, bias, p.layout, spec, p.walk, p.ring);
  return materialised_clip_block(q, k, scale, bias, p.layout, spec);
}

torch::Tensor nt_xent_block_loss(const torch::Tensor& z, const torch::Tensor& z_all, double inv_temperature,
                                 const Prologue& p, Reduction reduction, bool unit_rows) {
  if (p.tiled) return tiled_nt_xent_block(z, z_all, inv_temperature, p.layout, p.walk, reduction, p.ring);
  return materialised_nt_xent_block(z, z_all, inv_temperature, p.layout, reduction, unit_rows);
}

}  // namespace contrax::detail
