// The image recipes of `contrax train`: SimCLR or MoCo v3 on an image data
// set, data-parallel over the ranks of a communicator, in the loop every
// recipe shares (common/loop.h: schedule, checkpoints and resume, metrics,
// the agreed stop, the non-finite guard).
//
// Each rank builds the same model from the seed, wraps its trainable
// parameters in `DataParallel`, and at every step takes its slice of the global
// batch, augments two views keyed by the examples' GLOBAL indices, and minimises
// the distributed loss (`nt_xent_loss` or `moco_v3_loss`). Every piece is exact,
// so the parameters after a step do not depend on the world size (up to the
// summation order: fp64 agrees to ~1e-12). `chunk_size > 0` runs each step
// through the gradient cache.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "contrax/comm/communicator.h"
#include "contrax/train/common/loop.h"
#include "contrax/train/image/augment.h"
#include "contrax/train/image/idx.h"
#include "contrax/train/image/models.h"

namespace contrax::train {

/// Options of `train_contrastive`. The defaults are the recipe of the default
/// `contrax train` run (its flags take their defaults from here): SimCLR, 10
/// epochs, global batch 256, AdamW lr 2e-3 and weight decay 1e-4 with 20
/// warm-up steps then cosine to 0, temperature 0.1, crops of 50-100% of the
/// image, the encoder `default_recipe_encoder()`, a checkpoint every 200 steps
/// when there is a run directory. The temperature, the crop scale and the
/// encoder were chosen by measurement (docs/benchmarks.md, "Fashion-MNIST
/// recipe"); `peer_recipe()` is the recipe before them.
struct TrainOptions {
  /// "simclr" or "moco-v3".
  TORCH_ARG(std::string, recipe) = "simclr";
  /// The run: schedule, batch, optimizer, seed, run directory, logging
  /// (common/loop.h). 10 epochs: kNN 0.8743 against raw pixels' 0.8569 (seed
  /// 0; the spread over seeds in docs/benchmarks.md), about 4.5 minutes on 2
  /// idle AMD EPYC (AVX2) cores.
  TORCH_ARG(RunOptions, run) = RunOptions().epochs(10).batch_size(256).lr(2e-3).weight_decay(1e-4);
  /// > 0: gradient cache with chunks of this many rows per view.
  TORCH_ARG(int64_t, chunk_size) = 0;
  /// Temperature of NT-Xent / MoCo v3.
  TORCH_ARG(double, temperature) = 0.1;
  /// MoCo v3 base momentum (cosine-scheduled to 1).
  TORCH_ARG(double, moco_momentum) = 0.99;
  /// Model architecture.
  TORCH_ARG(ContrastiveModelOptions, model) = {};
  /// Augmentations of the two views (their dtype is taken from `run().dtype()`):
  /// `AugmentOptions`' defaults except crops of 50-100% of the image (measured
  /// a little better than 20-100% with a grid-pooled encoder on 28x28 images).
  TORCH_ARG(AugmentOptions, augment) = AugmentOptions().scale_min(0.5);
};

/// The recipe before the current default, which the torch peer
/// (simclr_torch_ddp.py, docs/benchmarks.md) and the tool's peer variant use,
/// every field written out so that it stays fixed. Encoder 32-64-128 with strides 2-2-1 (a
/// 15-pixel receptive field), crop scale (0.2, 1), temperature 0.2, AdamW lr
/// 2e-3, weight decay 1e-4, 20 warm-up steps, 8 epochs at global batch 256.
///
///   auto o = contrax::train::peer_recipe();
///   o.run().run_dir("runs/p");
///   auto r = contrax::train::train_contrastive(comm, data, o);
TrainOptions peer_recipe();

/// What a run returns: the loop's result and the trained model.
struct TrainResult : RunResult {
  Encoder encoder{nullptr};               ///< the trained (online) encoder, in eval mode, on the CPU
  std::vector<torch::Tensor> parameters;  ///< all parameters of the trained model (for tests' comparisons)
};

/// Runs the training loop collectively on every rank of `comm` (null: world 1),
/// on the communicator's device (`Communicator::device()`: a GPU bound to the
/// rank, or the CPU); the augmentation runs on the CPU. The returned encoder
/// and parameters are on the CPU.
///
///   auto data = contrax::train::load_dataset(dir, "train", 20000);
///   contrax::train::TrainOptions o;
///   o.run().epochs(2).run_dir("runs/a");
///   auto r = contrax::train::train_contrastive(comm, data, o);
TrainResult train_contrastive(const CommunicatorPtr& comm, const Dataset& data, const TrainOptions& options);

/// Steps per run: `total_steps(options.run(), dataset_size)` (common/loop.h).
int64_t total_steps(const TrainOptions& options, int64_t dataset_size);

}  // namespace contrax::train
