// The InfoNCE-family front ends behind both entry points of each loss
// (clip_loss and tiled_clip_loss, nt_xent_loss and tiled_nt_xent_loss,
// moco_v3_loss and tiled_moco_v3_loss): each validates its arguments locally,
// runs the engine's shared prologue (engine/prologue.h: one row-count exchange
// that also tells every rank about a bad argument, the layout, the memory
// path), gathers what it needs in one collective and hands over to the engine
// (engine/engine.h), which returns L_r = (W/B) * sum_{i in r} l_i so that
// data-parallel gradient averaging gives the exact global-batch gradient.
// fp16/bf16 features are computed in fp32 (the loss comes back fp32).
// Internal, not installed.
#pragma once

#include <torch/torch.h>

#include "contrax/losses/losses.h"

namespace contrax::detail {

// `caller` is the public function called (every error message names it);
// the options' memory path decides the path (the deprecated tiled entry
// points pass theirs with path kTiled).

torch::Tensor clip_front(const char* caller, const torch::Tensor& a, const torch::Tensor& b,
                         const torch::Tensor& logit_scale, const c10::optional<torch::Tensor>& logit_bias,
                         const ClipLossOptions& options);

torch::Tensor nt_xent_front(const char* caller, const torch::Tensor& z1, const torch::Tensor& z2,
                            const NTXentLossOptions& options);

torch::Tensor moco_v3_front(const char* caller, const torch::Tensor& q1, const torch::Tensor& q2,
                            const torch::Tensor& k1, const torch::Tensor& k2, const MocoV3LossOptions& options);

}  // namespace contrax::detail
