// Exactness verification: every distributed loss against the single-device
// reference on the concatenated batch.
//
// Each rank draws the same global fp64 inputs from a seed, keeps its (uneven)
// share of rows, computes its loss and backward, and gathers every gradient.
// The global loss is the mean of the per-rank losses; the global feature
// gradient is the concatenation of per-rank gradients divided by W (each rank's
// local gradient is the sum over ranks of dL_s/dx_r = W dL/dx_r); a scalar
// parameter's gradient is the mean over ranks (what data-parallel averaging
// computes). All of this is compared with reference:: on one device.
//
// A case may also train a model (the gradient-cache cases: encoders with
// dropout, DataParallel, GradCache). Its parameters are drawn once from the
// seed, given to both sides, and their gradients are compared on every rank
// as they stand after the distributed step: averaging them over ranks is the
// case's job (DataParallel), as in training, so a rank whose gradients differ
// from the others' fails even if the mean over ranks were right.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "contrax/comm/communicator.h"

namespace contrax {

/// Options for `verify`. Defaults: width 16, seed 0, tolerance 1e-10, the
/// default uneven row pattern (see `default_row_counts`), every case, on the
/// CPU.
///
///   auto results = contrax::verify(comm, contrax::VerifyOptions().device(torch::Device(torch::kCUDA, 0)));
struct VerifyOptions {
  /// Feature width d of the drawn inputs.
  TORCH_ARG(int64_t, width) = 16;
  /// Seed of the generator that draws every input and parameter.
  TORCH_ARG(uint64_t, seed) = 0;
  /// A case passes when its largest relative error is at most this.
  TORCH_ARG(double, tolerance) = 1e-10;
  /// Rows per rank; empty means default_row_counts(W).
  TORCH_ARG(std::vector<int64_t>, rows) = {};
  /// Case names to run; empty means all registered cases.
  TORCH_ARG(std::vector<std::string>, cases) = {};
  /// Where each rank's inputs, parameters and distributed computation live.
  /// The inputs are drawn on the CPU (the same numbers on every device) and
  /// the reference always runs on the CPU. For CUDA over W > 1 ranks, use a
  /// Gloo communicator (it carries CUDA tensors through host memory and lets
  /// ranks share a GPU; what `contrax verify --device cuda` does).
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// The dtype of the distributed run's features and model parameters. The
  /// inputs are drawn in fp64 and rounded to it; the fp64 reference gets the
  /// same rounded values, so what is left is the loss's own precision (kFloat,
  /// kBFloat16 and kHalf check the engine's precision policy; pair them with
  /// `tolerance(default_tolerance(dtype))`).
  TORCH_ARG(c10::ScalarType, dtype) = torch::kDouble;
};

/// The relative error a verify run in `dtype` passes at: 1e-10 for fp64; for
/// the others a bound well above what their rounding gives and far below what
/// a wrong gradient gives (O(1)); measured in docs/platforms.md.
double default_tolerance(c10::ScalarType dtype);

/// The outcome of one case on this world.
struct VerifyResult {
  /// Name of the case.
  std::string loss;
  /// World size W it ran on.
  int64_t world_size = 1;
  /// Rows per rank.
  std::vector<int64_t> rows;
  /// Relative error of the loss value, |mean_r L_r - L_ref| / |L_ref|.
  double loss_rel_err = 0;
  /// Largest relative error over the loss value and every gradient.
  double max_rel_err = 0;
  /// Which quantity had `max_rel_err`.
  std::string worst;
  /// Where the distributed loss was computed ("cpu", "cuda:0").
  std::string device;
  /// Whether `max_rel_err` is within the tolerance.
  bool passed = false;
};

/// A verification case: a distributed loss (or training step) and its
/// reference.
struct VerifyCase {
  /// Name of the case (what VerifyOptions' `cases` selects).
  std::string name;
  int64_t num_features = 2;        ///< number of [B, d] feature inputs drawn for the case
  std::vector<bool> feature_grad;  ///< which features require grad (default all)
  /// Width of each feature in multiples of the width option (default all 1):
  /// grouped cases draw g candidates per row side by side and reshape them.
  std::vector<int64_t> feature_widths;
  std::vector<double> scalars;  ///< initial values of the 0-dim parameters
  /// Model parameters of any shape, drawn from the feature width and verify's
  /// seeded generator; they follow the scalars in the functions' `s`. Their
  /// gradients are compared rank by rank, not averaged by verify: the case
  /// averages them itself (DataParallel). Unset: none.
  std::function<torch::OrderedDict<std::string, torch::Tensor>(int64_t width, at::Generator gen)> parameters;
  /// Distributed: local features, scalars then parameters, communicator ->
  /// L_r. Verify backpropagates L_r, unless it comes back without a graph: a
  /// training step (the gradient cache) has run its own backward.
  std::function<torch::Tensor(const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&,
                              const CommunicatorPtr&)>
      distributed;
  /// Reference on the full batch -> L.
  std::function<torch::Tensor(const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&)> reference;
};

/// The built-in cases (clip, clip_bias, clip_clamped, infonce, nt_xent, moco_v3,
/// their tiled and ring forms, siglip, grouped candidates and labels
/// (grouped_hard_negatives[_ring], grouped_mask_duplicates,
/// grouped_multi_positive_tiled, clip_multi_positive, clip_mask_duplicates_ring,
/// infonce_multi_positive_tiled), and the gradient-cache steps
/// grad_cache_clip and grad_cache_tiled_ring).
std::vector<VerifyCase>& verify_cases();

/// Default per-rank rows: uneven, with an empty rank from W = 3 on.
std::vector<int64_t> default_row_counts(int64_t world_size);

/// About the most host memory the single-device fp64 reference of any case
/// needs for `total_rows` rows of `width` features: NT-Xent's [2B x 2B]
/// logits, their softmax and gradients (six such buffers), plus the features.
int64_t verify_reference_bytes(int64_t total_rows, int64_t width);

/// Empty if `verify_reference_bytes` fits `available_memory_bytes()` (or the
/// latter is unknown); else why not, naming `rows_name` and `width_name`
/// (e.g. "option 'rows'" or "flag '--rows'") and what to change.
std::string verify_memory_problem(int64_t total_rows, int64_t width, const std::string& rows_name,
                                  const std::string& width_name);

/// Runs on every rank (collectively); results are identical on every rank.
std::vector<VerifyResult> verify(const CommunicatorPtr& comm, const VerifyOptions& options = {});

/// Runs one case (used by verify and by tests that bring their own case).
VerifyResult verify_case(const VerifyCase& c, const CommunicatorPtr& comm, const VerifyOptions& options);

/// One JSON object for a result: {"loss":..., "world_size":..., "rows":[...], "max_rel_err":..., ...}.
std::string to_json(const VerifyResult& r);

}  // namespace contrax
