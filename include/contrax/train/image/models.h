// Models for `contrax train`: a small CNN encoder for 28x28 grey images, the
// SimCLR projection head, the MoCo v3 predictor, and the two recipes' modules.
//
// Normalisation is GroupNorm (or none), never BatchNorm: BatchNorm's statistics
// are of the rows a rank holds, so 128 rows on a rank and 256 in one process
// give different activations (SimCLR and MoCo need SyncBN, more communication).
// GroupNorm normalises each example on its own, so with the exact losses the
// whole step is independent of the world size. The encoder is sized to train at
// a few thousand images per second on 2 CPU cores.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "contrax/train/image/group_norm_relu.h"

namespace contrax::train {

/// Options for `Encoder`. Defaults: channels 32-64-128 with strides 2-2-1
/// (28x28 -> 14x14 -> 7x7 -> 7x7), one conv per stage, GroupNorm with 8 groups,
/// no dropout, 1 input channel. Measured by CPU time on this machine: ~1600
/// images/s forward+backward on 2 threads, versus ~800 with strides 1-2-2.
struct EncoderOptions {
  /// Output channels of the conv stages (the representation: channels.back()).
  TORCH_ARG(std::vector<int64_t>, channels) = std::vector<int64_t>({32, 64, 128});
  /// Stride of each stage's first conv (same length as `channels`).
  TORCH_ARG(std::vector<int64_t>, strides) = std::vector<int64_t>({2, 2, 1});
  /// "group" (GroupNorm) or "none"; never BatchNorm (see the file comment).
  TORCH_ARG(std::string, norm) = "group";
  /// Groups of each GroupNorm; must divide every stage's channel count.
  TORCH_ARG(int64_t, groups) = 8;
  /// Dropout before the pooled representation; 0 disables it (exactness tests).
  TORCH_ARG(double, dropout) = 0.0;
  /// Channels of the input images (1 for grey).
  TORCH_ARG(int64_t, in_channels) = 1;
  /// Convolutions per stage; the extra ones keep stride 1 and the width.
  TORCH_ARG(int64_t, convs_per_stage) = 1;
  /// Side of the output's pooling grid: 1 is global average pooling; g > 1
  /// averages g x g cells of the last map and flattens them (channels.back()
  /// * g * g dimensions), keeping where in the image a feature was.
  TORCH_ARG(int64_t, pool_grid) = 1;
  /// On the CPU (float or double, norm "group"): channels-last convolutions and
  /// each GroupNorm + ReLU fused (group_norm_relu()), the same function in less
  /// time (docs/benchmarks.md). Elsewhere, if false, or with the environment
  /// variable CONTRAX_FUSED_ENCODER=0: torch's modules in their default layout.
  TORCH_ARG(bool, fused_cpu) = true;
};

/// CNN encoder: per stage conv3x3 -> norm -> ReLU (`convs_per_stage` times,
/// the first with the stage's stride), then average pooling over the whole
/// map or a `pool_grid` x `pool_grid` grid of cells (and dropout when enabled).
///
///   contrax::train::Encoder enc(contrax::train::EncoderOptions{});
///   auto h = enc(x);   // x: [b, 1, 28, 28] -> h: [b, 128]
class EncoderImpl : public torch::nn::Module {
 public:
  /// Checks the options and builds the layers.
  explicit EncoderImpl(EncoderOptions options = {});
  /// x: [b, C, H, W] -> [b, output_dim()]
  torch::Tensor forward(const torch::Tensor& x);
  /// Width of the representation: channels.back() * pool_grid * pool_grid.
  int64_t output_dim() const { return options.channels().back() * options.pool_grid() * options.pool_grid(); }
  /// Whether a CPU float or double input takes the fused path (fused_cpu()
  /// and norm "group", unless CONTRAX_FUSED_ENCODER=0 was set at construction).
  bool fused_on_cpu() const { return fused_; }
  EncoderOptions options;  ///< the options the encoder was built with

 private:
  torch::Tensor fused_features(const torch::Tensor& x);
  torch::nn::Sequential features_{nullptr};
  std::vector<torch::nn::Conv2d> convs_;        // the convs and norms inside features_,
  std::vector<torch::nn::GroupNorm> norms_;     // for the fused path
  bool fused_ = false;
  torch::nn::Dropout dropout_{nullptr};
};
TORCH_MODULE(Encoder);

/// Options for `MLPHead`. Defaults: 2 layers, hidden 256, output 128, no norm.
struct MLPHeadOptions {
  /// Options of a head whose input has `in_dim` features.
  MLPHeadOptions(int64_t in_dim = 128) : in_dim_(in_dim) {}
  /// Width of the head's input.
  TORCH_ARG(int64_t, in_dim);
  /// Width of each hidden layer.
  TORCH_ARG(int64_t, hidden_dim) = 256;
  /// Width of the output.
  TORCH_ARG(int64_t, out_dim) = 128;
  /// Number of Linear layers (>= 1); ReLU between them, none after the last.
  TORCH_ARG(int64_t, num_layers) = 2;
  /// LayerNorm after each hidden Linear (a per-example norm; see file comment).
  TORCH_ARG(bool, layer_norm) = false;
};

/// MLP used as the SimCLR/MoCo projection head and as MoCo v3's predictor.
///
///   contrax::train::MLPHead proj(contrax::train::MLPHeadOptions(128).out_dim(64));
///   auto z = proj(h);   // [b, 128] -> [b, 64]
class MLPHeadImpl : public torch::nn::Module {
 public:
  /// Checks the options (at least one layer, positive widths) and builds the layers.
  explicit MLPHeadImpl(MLPHeadOptions options = {});
  /// x: [b, in_dim] -> [b, out_dim]
  torch::Tensor forward(const torch::Tensor& x);
  MLPHeadOptions options;  ///< the options the head was built with

 private:
  torch::nn::Sequential layers_{nullptr};
};
TORCH_MODULE(MLPHead);

/// The encoder of the default `contrax train` recipe: three stages 32-64-64
/// with stride 2 each (28 -> 14 -> 7 -> 4; receptive field 15 px),
/// GroupNorm(8), and the 4x4 last map flattened (pool_grid 4: 1024 dimensions
/// that keep which of 16 cells a feature is in), chosen by measurement
/// (docs/benchmarks.md, "Fashion-MNIST recipe", "A shorter default run"): the
/// kept layout lifts kNN accuracy above raw pixels. Against 32-64-128-256 with a
/// 2x2 grid it reads higher on probe and kNN in fewer epochs at about 1.7x the
/// examples/s: 1.55 M multiply-adds per image (14*14*32*9 + 7*7*64*32*9 +
/// 4*4*64*64*9) against 3.32 M.
inline EncoderOptions default_recipe_encoder() {
  return EncoderOptions().channels({32, 64, 64}).strides({2, 2, 2}).pool_grid(4);
}

/// Options for the recipe modules. Defaults: `default_recipe_encoder()`,
/// projector 1024 -> 256 -> 128, MoCo v3 predictor 128 -> 256 -> 128.
struct ContrastiveModelOptions {
  /// Options of the encoder.
  TORCH_ARG(EncoderOptions, encoder) = default_recipe_encoder();
  /// Hidden width of the projection head.
  TORCH_ARG(int64_t, proj_hidden_dim) = 256;
  /// Output width of the projection head (and of MoCo v3's predictor).
  TORCH_ARG(int64_t, proj_dim) = 128;
  /// Linear layers of the projection head.
  TORCH_ARG(int64_t, proj_layers) = 2;
  /// Hidden width of MoCo v3's predictor.
  TORCH_ARG(int64_t, pred_hidden_dim) = 256;
  /// LayerNorm in the heads' hidden layers.
  TORCH_ARG(bool, head_layer_norm) = false;
};

/// SimCLR: encoder + projection head. The encoder alone is what evaluation uses.
///
///   contrax::train::SimCLRModel model(contrax::train::ContrastiveModelOptions{});
///   auto z1 = model(v1), z2 = model(v2);                  // [b, 128] each
///   auto loss = contrax::nt_xent_loss(z1, z2, opts);
class SimCLRModelImpl : public torch::nn::Module {
 public:
  /// Builds the encoder and a projection head on its output.
  explicit SimCLRModelImpl(ContrastiveModelOptions options = {});
  /// x: [b, 1, H, W] -> projections [b, proj_dim]
  torch::Tensor forward(const torch::Tensor& x);
  ContrastiveModelOptions options;  ///< the options the model was built with
  Encoder encoder{nullptr};         ///< registered as "encoder"
  MLPHead projector{nullptr};       ///< registered as "projector"
};
TORCH_MODULE(SimCLRModel);

/// MoCo v3: online encoder + projector + predictor (trained) and a momentum
/// copy of encoder + projector (updated by EMA only, never by gradient).
///
/// The momentum branch is a registered submodule ("momentum"), so `to()`,
/// `parameters()` and checkpoints see it, but its parameters have
/// requires_grad = false: give the optimizer and the data-parallel wrapper
/// `trainable_parameters()`, not `parameters()`.
///
///   contrax::train::MocoV3Model model(contrax::train::ContrastiveModelOptions{});
///   auto q1 = model->query(v1), q2 = model->query(v2);    // with gradient
///   auto k1 = model->key(v1), k2 = model->key(v2);        // no gradient
///   auto loss = contrax::moco_v3_loss(q1, q2, k1, k2, opts);
///   loss.backward(); optimizer.step();
///   model->update_momentum(contrax::momentum_schedule(0.99, step, total));
class MocoV3ModelImpl : public torch::nn::Module {
 public:
  /// Builds the online branch and the predictor, and the momentum branch as an
  /// exact copy of the online branch with requires_grad = false.
  explicit MocoV3ModelImpl(ContrastiveModelOptions options = {});
  /// Queries: predictor(projector(encoder(x))). x: [b, 1, H, W] -> [b, proj_dim]
  torch::Tensor query(const torch::Tensor& x);
  /// Keys from the momentum branch, without gradient. x: [b, 1, H, W] -> [b, proj_dim]
  torch::Tensor key(const torch::Tensor& x);
  /// Same as query().
  torch::Tensor forward(const torch::Tensor& x) { return query(x); }
  /// momentum <- m * momentum + (1 - m) * online (encoder and projector).
  void update_momentum(double m);
  /// Parameters of the online branch and the predictor (what the optimizer owns).
  std::vector<torch::Tensor> trainable_parameters() const;

  ContrastiveModelOptions options;  ///< the options the model was built with
  SimCLRModel online{nullptr};      ///< the online encoder + projector, registered as "online"
  MLPHead predictor{nullptr};       ///< on the online projections, registered as "predictor"
  SimCLRModel momentum{nullptr};    ///< the momentum copy of online, registered as "momentum"
  /// The online encoder (what evaluation uses).
  Encoder encoder() const { return online->encoder; }
};
TORCH_MODULE(MocoV3Model);

/// Number of elements over `parameters`.
int64_t count_parameters(const std::vector<torch::Tensor>& parameters);

}  // namespace contrax::train
