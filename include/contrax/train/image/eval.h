// Evaluating representations: what did contrastive training buy? The frozen
// encoder embeds the train and test splits; two standard read-outs follow:
//  * a linear probe: multinomial logistic regression on standardised features,
//    full-batch L-BFGS (strong-Wolfe, no learning rate to tune) to a tolerance,
//    the L2 strength chosen on a held-out part of the train split, then refitted
//    on all of it (Kornblith et al. 2019, CLIP). A fixed penalty favours one
//    representation: on 10000 Fashion-MNIST images raw pixels validate best at
//    lambda 1e-2, the trained 128-dim encoder at 1e-4, and a fixed 1e-4 cost
//    raw pixels 2.8 points of test accuracy (0.807 instead of 0.835);
//  * weighted kNN accuracy as in the InstDisc / DINO monitor: cosine similarity
//    to the train features (the whole train split by default, as there; 10000
//    images lower raw pixels' from 0.857 to 0.818), the top k voting with
//    weights exp(sim / T), in blocks of test rows to bound memory.
// Baselines make the numbers readable: the same read-outs on raw pixels and on
// a randomly initialised encoder of the same architecture.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>

#include "contrax/train/image/idx.h"
#include "contrax/train/image/models.h"

namespace contrax::train {

/// Embeds normalised images with a frozen model, without gradient, in batches,
/// in eval mode (restored afterwards). `images`: [N, 1, H, W] uint8; `fn` maps
/// a float batch [n, 1, H, W] to [n, d]. Returns float [N, d] (or the dtype
/// `fn` returns). Default batch 1024. `after_batch`, when set, is called
/// after each batch (a progress display).
///
///   auto f = contrax::train::embed([&](const torch::Tensor& x) { return enc(x); }, data.images);
torch::Tensor embed(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& images,
                    int64_t batch_size = 1024, torch::Dtype dtype = torch::kFloat,
                    const std::function<void()>& after_batch = nullptr);

/// `embed` with an encoder: switches it to eval mode for the pass and back.
///
///   auto f = contrax::train::embed(model->encoder, train.images);   // [N, 128]
torch::Tensor embed(Encoder encoder, const torch::Tensor& images, int64_t batch_size = 1024,
                    const std::function<void()>& after_batch = nullptr);

/// Options for `linear_probe`. Defaults: standardise; L2 strength chosen from
/// 1e-1, 1e-2, ..., 1e-5 on a seeded 10% validation part of the train rows;
/// L-BFGS up to 1000 iterations per fit, stopping when the largest gradient
/// entry is below 1e-5 or the loss changes by less than 1e-9.
struct LinearProbeOptions {
  /// Standardise features with the (fitting) train rows' mean and std first.
  TORCH_ARG(bool, standardize) = true;
  /// Candidate lambdas in CE + lambda/2 * ||W||^2 (bias not penalised). One
  /// value: used as is on all train rows, no validation split. Several: they
  /// are fitted on the non-validation rows from the largest down, each fit
  /// warm-started from the previous one, until one is less accurate on the
  /// validation rows than the best so far; the best (the larger on a tie) is
  /// refitted on all train rows.
  TORCH_ARG(std::vector<double>, l2_grid) = std::vector<double>({1e-1, 1e-2, 1e-3, 1e-4, 1e-5});
  /// Fraction of the train rows held out to choose lambda, in (0, 1).
  TORCH_ARG(double, val_fraction) = 0.1;
  /// Seed of the validation split.
  TORCH_ARG(uint64_t, seed) = 0;
  /// L-BFGS iterations per fit (full batch).
  TORCH_ARG(int64_t, max_iter) = 1000;
  /// L-BFGS stops when max |gradient| falls below this.
  TORCH_ARG(double, tolerance_grad) = 1e-5;
  /// Classes; -1 infers max(label) + 1 over both splits.
  TORCH_ARG(int64_t, num_classes) = -1;
};

/// Result of `linear_probe`.
struct LinearProbeResult {
  double train_acc = 0;    ///< accuracy on the train split
  double test_acc = 0;     ///< accuracy on the test split
  double final_loss = 0;   ///< the final fit's training objective where L-BFGS stopped
  double l2 = 0;           ///< the L2 strength of the final fit
  double val_acc = -1;     ///< validation accuracy of `l2` (-1 when `l2_grid` has one value: nothing held out)
  int64_t iterations = 0;  ///< L-BFGS iterations of the final fit
  double grad_max = 0;     ///< largest absolute gradient entry where the final fit stopped
  bool converged = false;  ///< a tolerance stopped the final fit before `max_iter`
  double seconds = 0;      ///< wall time of the probe
};

/// Multinomial logistic regression read-out.
///
/// train_x: [N, d], train_y: [N] int64, test_x: [M, d], test_y: [M] int64.
///
///   auto r = contrax::train::linear_probe(ftrain, train.labels, ftest, test.labels);
///   std::cout << r.test_acc << " with lambda " << r.l2;
LinearProbeResult linear_probe(const torch::Tensor& train_x, const torch::Tensor& train_y,
                               const torch::Tensor& test_x, const torch::Tensor& test_y,
                               const LinearProbeOptions& options = {});

/// The linear probe's objective, mean cross-entropy + l2/2 ||W||^2 (the bias
/// not penalised), and its gradient, in the class-major layout `linear_probe`
/// fits in: `x` [n, d] and `xt` = x^T made contiguous [d, n] (both, so that
/// neither GEMM reads a transposed operand), `y` [n] int64, `wt` = W^T [C, d],
/// `b` [C]. Returns the loss; writes dL/dwt and dL/db into `grad_wt` and
/// `grad_b`. No autograd is involved.
double linear_probe_objective(const torch::Tensor& x, const torch::Tensor& xt, const torch::Tensor& y,
                              const torch::Tensor& wt, const torch::Tensor& b, double l2, torch::Tensor& grad_wt,
                              torch::Tensor& grad_b);

/// Options for `knn_accuracy`. Defaults: k = 20, temperature 0.07, 256 test
/// rows per block (memory 256 x N floats).
struct KnnOptions {
  /// Neighbours that vote.
  TORCH_ARG(int64_t, k) = 20;
  /// Each neighbour's vote is exp(similarity / temperature).
  TORCH_ARG(double, temperature) = 0.07;
  /// Test rows per block of similarities.
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
  double linear_probe_acc = 0;  ///< test accuracy of the linear probe
  double knn_acc = 0;           ///< accuracy of the weighted kNN classifier
  LinearProbeResult probe;      ///< details of the linear probe (lambda, convergence)
  double seconds = 0;           ///< wall time of the embedding and both read-outs
};

/// Options for the `evaluate_*` helpers. Defaults: the probe and the kNN
/// memory bank use the whole train split.
struct EvalOptions {
  /// Options of the linear probe.
  TORCH_ARG(LinearProbeOptions, probe) = {};
  /// Options of the kNN read-out.
  TORCH_ARG(KnnOptions, knn) = {};
  /// > 0: the linear probe is fitted on the first this many train examples only
  /// (its cost grows with rows x dimension x iterations; raw pixels have 784
  /// dimensions); the kNN memory bank is always the whole train split. -1: all.
  TORCH_ARG(int64_t, probe_train_limit) = -1;
  /// Images per forward pass when embedding.
  TORCH_ARG(int64_t, batch_size) = 1024;
  /// Set: told of each stage as it goes ("embedding", done, total batches;
  /// "linear probe", 0, 1 then 1, 1; "kNN", 0, 1 then 1, 1), for a display.
  TORCH_ARG(std::function<void(const std::string& stage, int64_t done, int64_t total)>, progress) = nullptr;
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

}  // namespace contrax::train
