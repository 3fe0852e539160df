// SimCLR augmentations for small grey images, batched on CPU.
//
// One call turns a batch of uint8 images into augmented, normalised float
// views: a random resized crop and horizontal flip folded into one affine
// sampling grid (one batched grid_sample, bilinear), brightness and contrast
// jitter, and optional Gaussian blur and noise.
//
// Reproducibility across world sizes: every random number an example uses comes
// from its own torch::Generator seeded from (seed, epoch, step, view, global
// example index), never from a shared stream, so an example's view does not
// depend on which rank augments it; with the sampler's rank-ordered slices an
// N-process run reproduces the 1-process run exactly. All batched ops are
// per example (the sampling grid is built by broadcasting, not a batched matrix
// product), so results do not depend on the batch split even bit for bit.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace contrax::train {

/// Fashion-MNIST's pixel mean and standard deviation (of x / 255, train split).
constexpr double kFashionMnistMean = 0.2860;
constexpr double kFashionMnistStd = 0.3530;

/// Options for `augment`. Defaults follow SimCLR's recipe adapted to 28x28
/// grey images: crop scale (0.2, 1), aspect ratio (3/4, 4/3), flip 0.5,
/// brightness/contrast jitter 0.4 applied with probability 0.8, blur and noise
/// off, Fashion-MNIST normalisation, float32 output.
struct AugmentOptions {
  /// Range of the crop's area as a fraction of the image.
  TORCH_ARG(double, scale_min) = 0.2;
  /// Upper end of the crop's area fraction.
  TORCH_ARG(double, scale_max) = 1.0;
  /// Range of the crop's width/height ratio (sampled log-uniformly).
  TORCH_ARG(double, ratio_min) = 3.0 / 4.0;
  /// Upper end of the crop's width/height ratio.
  TORCH_ARG(double, ratio_max) = 4.0 / 3.0;
  /// Probability of a horizontal flip.
  TORCH_ARG(double, flip_prob) = 0.5;
  /// Probability of applying colour jitter (brightness and contrast).
  TORCH_ARG(double, jitter_prob) = 0.8;
  /// Brightness jitter: the factor is uniform in [1 - brightness, 1 + brightness].
  TORCH_ARG(double, brightness) = 0.4;
  /// Contrast jitter: the factor is uniform in [1 - contrast, 1 + contrast].
  TORCH_ARG(double, contrast) = 0.4;
  /// Probability of a Gaussian blur (5x5, sigma uniform in [0.1, blur_sigma_max]).
  TORCH_ARG(double, blur_prob) = 0.0;
  /// Upper end of the blur's sigma.
  TORCH_ARG(double, blur_sigma_max) = 1.0;
  /// Probability of additive Gaussian noise (before normalisation).
  TORCH_ARG(double, noise_prob) = 0.0;
  /// Standard deviation of the noise, in [0, 1] pixel units.
  TORCH_ARG(double, noise_std) = 0.05;
  /// Output = (x / 255 - mean) / std.
  TORCH_ARG(double, mean) = kFashionMnistMean;
  /// The normalisation's standard deviation.
  TORCH_ARG(double, std) = kFashionMnistStd;
  /// kFloat or kDouble (fp64 exactness tests).
  TORCH_ARG(torch::Dtype, dtype) = torch::kFloat;
};

/// What makes a view's randomness: the run's seed, the training position and
/// which of the two views. The example's global index is the fourth part.
struct AugmentKey {
  uint64_t seed = 0;   ///< the run's seed
  int64_t epoch = 0;   ///< epoch of the training position
  int64_t step = 0;    ///< step of the training position within the epoch
  int64_t view = 0;    ///< which of the two views (0 or 1)
};

/// The 64-bit seed of example `index`'s generator under `key`.
uint64_t augment_seed(const AugmentKey& key, int64_t index);

/// Augments a batch.
///
/// images: [b, 1, H, W] uint8 (or [b, H, W]); indices: [b] int64, the examples'
/// global data-set indices (they seed the per-example generators).
/// Returns [b, 1, H, W] of `options.dtype()`, normalised. b may be 0.
///
///   auto v1 = contrax::train::augment(x, idx, {seed, epoch, step, /*view=*/0});
///   auto v2 = contrax::train::augment(x, idx, {seed, epoch, step, /*view=*/1});
torch::Tensor augment(const torch::Tensor& images, const torch::Tensor& indices, const AugmentKey& key,
                      const AugmentOptions& options = {});

/// The evaluation transform: uint8 [b, 1, H, W] -> normalised [b, 1, H, W]
/// (no randomness). Default: Fashion-MNIST statistics, float32.
///
///   auto x = contrax::train::normalize_images(test.images);
torch::Tensor normalize_images(const torch::Tensor& images, double mean = kFashionMnistMean,
                               double std = kFashionMnistStd, torch::Dtype dtype = torch::kFloat);

}  // namespace contrax::train
