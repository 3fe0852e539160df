// The training loop of `contrax train`: SimCLR or MoCo v3 on an image data
// set, data-parallel over the ranks of a communicator.
//
// Each rank builds the same model from the seed, wraps its trainable
// parameters in `DataParallel` (gradients averaged over ranks by c10d's
// Reducer), and at every step takes its contiguous slice of the global batch
// from the `ShardedSampler`, augments two views keyed by the examples' GLOBAL
// indices, and minimises the distributed loss (`nt_xent_loss` or
// `moco_v3_loss` with the communicator). Since every piece is exact, the
// parameters after a step do not depend on the world size (up to floating
// point summation order; bit-identical sums are not promised, fp64 agrees to
// ~1e-12). `chunk_size > 0` runs each step through the gradient cache.
//
// The short last global batch of an epoch is kept, even when it has fewer
// rows than there are ranks: a rank with an empty slice still takes part in
// every collective of the step and contributes a zero loss and zero
// gradients, which is exactly its share of the global-batch loss.
//
// Rank 0 writes run_dir/metrics.jsonl (one JSON object per step, see
// metrics.h) and run_dir/checkpoint.pt (every `checkpoint_every` steps, at the
// end and when stopped). `resume` reloads the checkpoint on every rank and
// continues at the saved step on the same loss curve.
//
// A step whose global loss or any gradient is not finite is never applied:
// training stops with an error naming the step (the last checkpoint is left
// as it was), unless `skip_nonfinite` allows skipping that many such steps.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "contrax/communicator.h"
#include "contrax/train/augment.h"
#include "contrax/train/idx.h"
#include "contrax/train/models.h"

namespace contrax {
namespace train {

/// Options of `train_contrastive`. The defaults are the recipe of the default
/// `contrax train` run (its flags take their defaults from here): SimCLR, 8
/// epochs, global batch 256, AdamW lr 2e-3 and weight decay 1e-4 with 20
/// warm-up steps then cosine to 0, temperature 0.1, crops of 50-100% of the
/// image, the encoder `default_recipe_encoder()`, a checkpoint every 200 steps
/// when there is a run directory. The temperature, the crop scale and the
/// encoder were chosen by measurement (docs/benchmarks.md, "Fashion-MNIST
/// recipe"); `peer_recipe()` is the recipe before them.
struct TrainOptions {
  /// "simclr" or "moco-v3".
  TORCH_ARG(std::string, recipe) = "simclr";
  /// Epochs over the training set (used when max_steps <= 0). 16: kNN 0.8708
  /// against raw pixels' 0.8569, where 8 gave 0.8646 (docs/benchmarks.md);
  /// about 7 minutes on 2 idle cores.
  TORCH_ARG(int64_t, epochs) = 16;
  /// > 0: the run is this many steps (the schedule's length).
  TORCH_ARG(int64_t, max_steps) = -1;
  /// >= 0: stop (as if interrupted, with a checkpoint) once this global step
  /// is reached, without changing the schedule. For resume tests.
  TORCH_ARG(int64_t, stop_at_step) = -1;
  /// Global batch size G (all ranks together).
  TORCH_ARG(int64_t, batch_size) = 256;
  /// > 0: gradient cache with chunks of this many rows per view.
  TORCH_ARG(int64_t, chunk_size) = 0;
  /// Peak learning rate of AdamW.
  TORCH_ARG(double, lr) = 2e-3;
  TORCH_ARG(double, weight_decay) = 1e-4;
  TORCH_ARG(int64_t, warmup_steps) = 20;
  /// Temperature of NT-Xent / MoCo v3.
  TORCH_ARG(double, temperature) = 0.1;
  /// MoCo v3 base momentum (cosine-scheduled to 1).
  TORCH_ARG(double, moco_momentum) = 0.99;
  TORCH_ARG(uint64_t, seed) = 0;
  /// kFloat or kDouble (exactness tests).
  TORCH_ARG(torch::Dtype, dtype) = torch::kFloat;
  /// Empty: no metrics or checkpoints written.
  TORCH_ARG(std::string, run_dir) = "";
  /// Checkpoint every K steps (0: only at the end / when stopped).
  TORCH_ARG(int64_t, checkpoint_every) = 200;
  /// Load run_dir/checkpoint.pt first and continue from it.
  TORCH_ARG(bool, resume) = false;
  /// Progress line on rank 0 every this many steps (0: never).
  TORCH_ARG(int64_t, log_every) = 10;
  /// Progress lines go to stderr instead of stdout (keeps --json clean).
  TORCH_ARG(bool, progress_to_stderr) = false;
  /// Set: rank 0's progress lines go here instead (the tool copies them to
  /// the console and RUN_DIR/train.log).
  TORCH_ARG(std::function<void(const std::string&)>, log) = nullptr;
  /// Steps with a non-finite loss or gradient that may be skipped (not
  /// applied) before training stops with an error. 0: the first one stops it.
  TORCH_ARG(int64_t, skip_nonfinite) = 0;
  /// Polled at every step boundary on every rank; when any rank sees true,
  /// all ranks stop together after a checkpoint.
  TORCH_ARG(std::function<bool()>, stop_requested) = nullptr;
  /// Model architecture.
  TORCH_ARG(ContrastiveModelOptions, model) = {};
  /// Augmentations of the two views (their dtype is taken from `dtype`):
  /// `AugmentOptions`' defaults except crops of 50-100% of the image (measured
  /// a little better than 20-100% with the 2x2-grid encoder on 28x28 images).
  TORCH_ARG(AugmentOptions, augment) = AugmentOptions().scale_min(0.5);
};

/// The recipe of `contrax train` before its current default, which the torch
/// peer (simclr_torch_ddp.py, see docs/benchmarks.md) implements and
/// `--recipe-variant peer` selects: every field written out so that it stays
/// fixed when the defaults change. Encoder 32-64-128 with strides 2-2-1 (a
/// 15-pixel receptive field), crop scale (0.2, 1), temperature 0.2, AdamW lr
/// 2e-3, weight decay 1e-4, 20 warm-up steps, 8 epochs at global batch 256.
///
///   auto r = contrax::train::train_contrastive(comm, data, contrax::train::peer_recipe().run_dir("runs/p"));
TrainOptions peer_recipe();

/// What a run returns (identical on every rank except where noted).
struct TrainResult {
  int64_t start_step = 0;   // step the run (re)started at
  int64_t steps = 0;        // global step reached (= total when finished)
  int64_t total_steps = 0;  // the schedule's length
  int64_t epochs_done = 0;  // epoch of the last step + 1
  bool interrupted = false; // stopped early (signal or stop_at_step)
  double train_s = 0;       // wall time of the loop
  double examples_per_s = 0;
  std::vector<double> losses;  // global mean loss of each step run here
  int64_t skipped_steps = 0;   // steps not applied for a non-finite loss or gradient
  int64_t bytes_sent = 0;      // bytes this rank sent in the steps run here (rank 0's on rank 0)
  /// The trained encoder (the online encoder for MoCo v3), in eval mode.
  Encoder encoder{nullptr};
  /// All parameters of the trained model (for comparisons in tests).
  std::vector<torch::Tensor> parameters;
};

/// Runs the training loop collectively on every rank of `comm` (null: world 1).
///
///   auto data = contrax::train::load_dataset(dir, "train", 20000);
///   auto r = contrax::train::train_contrastive(comm, data,
///       contrax::train::TrainOptions().epochs(2).run_dir("runs/a"));
TrainResult train_contrastive(const CommunicatorPtr& comm, const Dataset& data, const TrainOptions& options);

/// Path of the checkpoint in a run directory.
std::string checkpoint_path(const std::string& run_dir);

/// Path of the metrics file in a run directory.
std::string metrics_path(const std::string& run_dir);

/// Steps per run for `options` on `dataset_size` examples: max_steps when > 0,
/// else epochs x steps per epoch. Throws (naming the flag) when that product
/// overflows or exceeds 2^40 steps.
int64_t total_steps(const TrainOptions& options, int64_t dataset_size);

}  // namespace train
}  // namespace contrax
