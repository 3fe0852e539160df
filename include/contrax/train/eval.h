// Evaluating representations: what did contrastive training buy?
//
// The encoder is frozen and embeds the train and test splits; two standard
// read-outs then measure the representation:
//  * a linear probe: multinomial logistic regression on standardised features,
//    trained full-batch with L-BFGS (strong-Wolfe line search), which converges
//    in a second or two on 60000 x 128 features on CPU and needs no learning
//    rate; reports test accuracy;
//  * k-nearest-neighbour accuracy as in the InstDisc / DINO kNN monitor: cosine
//    similarity to the train features, the top k vote with weights
//    exp(sim / T), computed in blocks of test rows to bound memory.
// Baselines make the numbers readable: the same read-outs on raw pixels and on
// a randomly initialised encoder of the same architecture.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>

#include "contrax/train/idx.h"
#include "contrax/train/models.h"

namespace contrax {
namespace train {

/// Embeds normalised images with a frozen model, without gradient, in batches,
/// in eval mode (restored afterwards). `images`: [N, 1, H, W] uint8; `fn` maps
/// a float batch [n, 1, H, W] to [n, d]. Returns float [N, d] (or the dtype
/// `fn` returns). Default batch 1024.
///
///   auto f = contrax::train::embed([&](const torch::Tensor& x) { return enc(x); }, data.images);
torch::Tensor embed(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& images,
                    int64_t batch_size = 1024, torch::Dtype dtype = torch::kFloat);

/// `embed` with an encoder: switches it to eval mode for the pass and back.
///
///   auto f = contrax::train::embed(model->encoder, train.images);   // [N, 128]
torch::Tensor embed(Encoder encoder, const torch::Tensor& images, int64_t batch_size = 1024);

/// Options for `linear_probe`. Defaults: standardise, L2 penalty 1e-4 on the
/// weights (added to the mean cross-entropy), 100 L-BFGS iterations.
struct LinearProbeOptions {
  /// Standardise features with the train split's mean and std first.
  TORCH_ARG(bool, standardize) = true;
  /// lambda in CE + lambda/2 * ||W||^2 (bias not penalised).
  TORCH_ARG(double, l2) = 1e-4;
  /// L-BFGS iterations (full batch).
  TORCH_ARG(int64_t, max_iter) = 100;
  /// Classes; -1 infers max(label) + 1 over both splits.
  TORCH_ARG(int64_t, num_classes) = -1;
};

/// Result of `linear_probe`.
struct LinearProbeResult {
  double train_acc = 0;
  double test_acc = 0;
  double final_loss = 0;
  double seconds = 0;
};

/// Multinomial logistic regression read-out.
///
/// train_x: [N, d], train_y: [N] int64, test_x: [M, d], test_y: [M] int64.
///
///   auto r = contrax::train::linear_probe(ftrain, train.labels, ftest, test.labels);
///   std::cout << r.test_acc;
LinearProbeResult linear_probe(const torch::Tensor& train_x, const torch::Tensor& train_y,
                               const torch::Tensor& test_x, const torch::Tensor& test_y,
                               const LinearProbeOptions& options = {});

/// Options for `knn_accuracy`. Defaults: k = 20, temperature 0.07, 256 test
/// rows per block (memory 256 x N floats).
struct KnnOptions {
  TORCH_ARG(int64_t, k) = 20;
  TORCH_ARG(double, temperature) = 0.07;
  TORCH_ARG(int64_t, block_size) = 256;
  /// -1 infers max(label) + 1 over both splits.
  TORCH_ARG(int64_t, num_classes) = -1;
};

/// Weighted kNN classification accuracy of the test features against the train
/// features as the memory bank (cosine similarity; features are L2-normalised
/// here). train_x: [N, d], train_y: [N], test_x: [M, d], test_y: [M].
///
///   double acc = contrax::train::knn_accuracy(ftrain, train.labels, ftest, test.labels,
///                                             contrax::train::KnnOptions().k(200));
double knn_accuracy(const torch::Tensor& train_x, const torch::Tensor& train_y, const torch::Tensor& test_x,
                    const torch::Tensor& test_y, const KnnOptions& options = {});

/// Both read-outs of one representation.
struct EvalResult {
  double linear_probe_acc = 0;
  double knn_acc = 0;
  double seconds = 0;  // embedding + both read-outs
};

/// Options for the `evaluate_*` helpers.
struct EvalOptions {
  TORCH_ARG(LinearProbeOptions, probe) = {};
  TORCH_ARG(KnnOptions, knn) = {};
  TORCH_ARG(int64_t, batch_size) = 1024;
};

/// Embeds both splits with `encoder` (frozen) and runs both read-outs.
///
///   auto r = contrax::train::evaluate_encoder(model->encoder, train, test);
EvalResult evaluate_encoder(Encoder encoder, const Dataset& train, const Dataset& test,
                            const EvalOptions& options = {});

/// Both read-outs on raw normalised pixels ([N, H*W] features).
EvalResult evaluate_raw_pixels(const Dataset& train, const Dataset& test, const EvalOptions& options = {});

/// Both read-outs on a freshly initialised encoder with `encoder_options`,
/// seeded with `seed` (the global torch RNG state is saved and restored).
EvalResult evaluate_random_init(const EncoderOptions& encoder_options, uint64_t seed, const Dataset& train,
                                const Dataset& test, const EvalOptions& options = {});

}  // namespace train
}  // namespace contrax
