// The host memory of an image recipe's training step, from the options (see
// memory_estimate.h). Counted as the step allocates it (trainer.cpp, models.cpp):
//
//   model        P trainable values x 5 (weights, gradients, DataParallel's
//                gradient buckets, AdamW's exp_avg and exp_avg_sq), and MoCo
//                v3's momentum copy once;
//   images       this rank's b rows: uint8 [b, C, H, W], two views, their
//                concatenation [2b, ...] and its channels-last copy, in the
//                run's dtype, plus one view's worth of augmentation scratch:
//                (1 + (2 + 2 + 2 + 1) x dtype size) bytes per pixel of a row;
//   activations  r rows with gradient at once (2b: both views in one forward;
//                with a gradient cache, one chunk of min(chunk, b) rows):
//                each convolution's output and its normalised, rectified
//                output (2 x L_i values per row for layer i; fused or not,
//                both are saved for the backward) and the heads' widths (the
//                pooled features, each hidden layer's width twice (counted,
//                not derived), the projection; MoCo v3's predictor alike; the
//                backward frees them as it goes: its own gradients add no
//                measurable peak);
//   loss         plan_loss()'s logits-sized buffers and gathered features on
//                the path the loss picks for B = global_rows over W ranks.
#include "contrax/train/image/memory_estimate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "contrax/check/plan.h"

namespace contrax::train {

namespace {

// Values of an MLP head's parameters.
double head_parameters(int64_t in, int64_t hidden, int64_t out, int64_t layers, bool layer_norm) {
  double n = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const bool last = l + 1 == layers;
    const int64_t o = last ? out : hidden;
    n += static_cast<double>(in) * o + o + (!last && layer_norm ? 2.0 * o : 0.0);
    in = o;
  }
  return n;
}

int64_t clamp_bytes(double bytes) {
  return bytes >= 9.0e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(std::ceil(bytes));
}

}  // namespace

StepMemory estimate_step_memory(const TrainOptions& o, int64_t channels, int64_t height, int64_t width,
                                int64_t global_rows, int64_t world) {
  TORCH_CHECK(channels >= 1 && height >= 1 && width >= 1, "estimate_step_memory(): the image size must be positive, ",
              "but got ", channels, " x ", height, " x ", width);
  TORCH_CHECK(global_rows >= 1 && world >= 1, "estimate_step_memory(): arguments 'global_rows' and 'world' must be ",
              ">= 1, but got ", global_rows, " and ", world);
  const auto& mo = o.model();
  const auto& enc = mo.encoder();
  const double dsize = o.run().dtype() == torch::kDouble ? 8.0 : 4.0;
  const bool moco = o.recipe() == "moco-v3";

  // The encoder's layers: parameters and output values per row.
  double enc_params = 0, layer_sum = 0;
  int64_t in = channels, h = height, w = width;
  for (size_t s = 0; s < enc.channels().size(); ++s) {
    const int64_t ch = enc.channels()[s];
    for (int64_t c = 0; c < enc.convs_per_stage(); ++c) {
      const int64_t stride = c == 0 ? enc.strides()[s] : 1;
      h = (h - 1) / stride + 1;  // 3x3, padding 1
      w = (w - 1) / stride + 1;
      enc_params += static_cast<double>(in) * ch * 9 + (enc.norm() == "group" ? 2.0 * ch : ch);
      layer_sum += static_cast<double>(ch) * h * w;
      in = ch;
    }
  }
  const int64_t g = enc.pool_grid();
  const int64_t enc_out = enc.channels().back() * g * g;
  const double proj = head_parameters(enc_out, mo.proj_hidden_dim(), mo.proj_dim(), mo.proj_layers(),
                                      mo.head_layer_norm());
  const double online = enc_params + proj;
  const double trainable =
      online + (moco ? head_parameters(mo.proj_dim(), mo.pred_hidden_dim(), mo.proj_dim(), 2, mo.head_layer_norm())
                     : 0.0);

  const double b = static_cast<double>((global_rows + world - 1) / world);
  const double image = static_cast<double>(channels) * height * width;
  const double grad_rows = o.chunk_size() > 0 ? std::min(static_cast<double>(o.chunk_size()), b) : 2.0 * b;
  const double head_values = enc_out + 2.0 * mo.proj_hidden_dim() + mo.proj_dim() +
                             (moco ? 2.0 * mo.pred_hidden_dim() + mo.proj_dim() : 0.0);

  StepMemory m;
  m.model = clamp_bytes(dsize * (5.0 * trainable + (moco ? online : 0.0)));
  m.batch = clamp_bytes(b * image * (1.0 + 7.0 * dsize));
  m.activations = clamp_bytes(grad_rows * dsize * (2.0 * layer_sum + head_values));
  const auto plan = plan_loss(PlanOptions()
                                  .loss(moco ? "moco_v3" : "nt_xent")
                                  .batch(global_rows)
                                  .width(mo.proj_dim())
                                  .world(world)
                                  .dtype(o.run().dtype()));
  for (const auto& p : plan.paths) {
    if (p.path == plan.chosen) m.loss = clamp_bytes(static_cast<double>(p.logits_bytes) + p.feature_bytes);
  }
  return m;
}

}  // namespace contrax::train
