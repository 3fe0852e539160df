// Gradient cache (GradCache, Gao et al. 2021): a contrastive training step over a
// global batch far larger than the activations memory allows, with exactly
// the gradients of the one-shot big-batch step.
//
// A contrastive loss couples every row to every other, so the batch cannot
// simply be split into accumulated micro-batches. The loss, however, only
// needs the representations, which are small. So:
//   pass 1  run each encoder over chunks of its input without building a graph,
//           saving the random-number state before each chunk;
//   loss    compute the loss (local or distributed, e.g. `clip_loss` with a
//           communicator) on the detached representations and backpropagate
//           once: this caches dL/d(rep) for every row, and gives the loss-side
//           parameters (the CLIP logit scale) their gradient, exactly once;
//   pass 2  re-run each chunk with its saved random state (the same dropout
//           masks) and backpropagate the cached gradient into the encoder.
// Since L = loss(f(x_1), ..., f(x_n)), dL/dθ = sum_c J_c^T dL/d(rep_c), where
// J_c is the Jacobian of chunk c's representation: pass 2 computes exactly
// these vector-Jacobian products, one chunk at a time. Peak activation memory
// is set by the chunk size, not the batch size.
//
// With a `DataParallel` per encoder, all chunks but the last run under
// no-sync and the reducer averages the accumulated gradients once per step.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "contrax/parallel/data_parallel.h"

namespace contrax {

/// An encoder's input: one tensor, a list of tensors, or named tensors
/// (keyword inputs such as `{"input_ids", ...}, {"attention_mask", ...}`),
/// all with the batch along dim 0; or any other value (an `IValue`) together
/// with a user split function.
///
///   contrax::BatchInput a = images;                                   // [n, ...]
///   contrax::BatchInput b = std::vector<torch::Tensor>{ids, mask};
///   contrax::BatchInput c = std::map<std::string, torch::Tensor>{{"ids", ids}, {"mask", mask}};
class BatchInput {
 public:
  /// Which form the input takes: one tensor, a list, named tensors, or another value (BatchInput::other()).
  enum class Kind { kTensor, kList, kNamed, kOther };

  BatchInput() : kind_(Kind::kList) {}
  /// One tensor with the batch along dim 0 (kTensor).
  BatchInput(torch::Tensor tensor);                            // NOLINT: implicit on purpose
  /// A list of tensors with the batch along dim 0 (kList).
  BatchInput(std::vector<torch::Tensor> tensors);              // NOLINT
  /// Named tensors with the batch along dim 0 (kNamed).
  BatchInput(std::map<std::string, torch::Tensor> named);      // NOLINT
  /// Anything else; chunks of it are made by the encoder's `split` function.
  static BatchInput other(c10::IValue value);

  /// Which form this input takes.
  Kind kind() const { return kind_; }
  /// The tensor of a kTensor input (error otherwise).
  const torch::Tensor& tensor() const;
  /// The tensors of a kList input (error otherwise).
  const std::vector<torch::Tensor>& list() const;
  /// The named tensors of a kNamed input (error otherwise).
  const std::map<std::string, torch::Tensor>& named() const;
  /// The value of a kOther input (error otherwise).
  const c10::IValue& value() const;
  /// Element `i` of a list, or the tensor itself for i = 0 of a kTensor input.
  const torch::Tensor& operator[](size_t i) const;
  /// Named tensor `name` of a kNamed input (error naming the missing key).
  const torch::Tensor& operator[](const std::string& name) const;

  /// Rows along dim 0, checked equal across all tensors; -1 for kOther.
  int64_t rows() const;
  /// Rows [start, start + length) of every tensor (views).
  BatchInput narrow(int64_t start, int64_t length) const;
  /// Every tensor in the input (to find the devices whose RNG to save).
  std::vector<torch::Tensor> tensors() const;

 private:
  Kind kind_;
  torch::Tensor tensor_;
  std::vector<torch::Tensor> list_;
  std::map<std::string, torch::Tensor> named_;
  c10::IValue other_;
};

/// Runs an encoder on one chunk; returns its output (a tensor, or any
/// structure an `IValue` holds: tuple, list, dict).
using EncoderFn = std::function<c10::IValue(const BatchInput&)>;
/// Picks the representation tensor `[n, d]` out of an encoder's output.
using RepresentationFn = std::function<torch::Tensor(const c10::IValue&)>;
/// Splits an input into chunks of at most `chunk_size` rows, in order.
using SplitFn = std::function<std::vector<BatchInput>(const BatchInput&, int64_t chunk_size)>;
/// The loss over the representations: reps[e] is encoder e's `[b_r, d_e]`
/// rows of this rank, in input order. Returns a 0-dim tensor.
using RepresentationLossFn = std::function<torch::Tensor(const std::vector<torch::Tensor>& reps)>;
/// Loss-scale hook: maps the loss to what is backpropagated (e.g. `loss * S`
/// for fp16 loss scaling; the caller unscales the gradients).
using LossScaleFn = std::function<torch::Tensor(const torch::Tensor& loss)>;

namespace detail {
template <typename M, typename A, typename = void>
struct has_forward : std::false_type {};
template <typename M, typename A>
struct has_forward<M, A, std::void_t<decltype(std::declval<M&>().forward(std::declval<A>()))>> : std::true_type {};

[[noreturn]] void no_module_forward(const char* kind);

/// The CUDA devices among `seen` and `current_cuda`, once each, in order: the
/// generators GradCache saves and replays besides the CPU's.
std::vector<c10::Device> rng_cuda_devices(const std::vector<c10::Device>& seen,
                                          c10::optional<c10::Device> current_cuda);

// Module holders and module pointers take the module constructors; checked
// before std::function's own callable test, which a ModuleHolder's
// operator() would fail with a hard error.
template <typename T>
struct is_module_like : std::is_base_of<torch::detail::ModuleHolderIndicator, T> {};
template <typename M>
struct is_module_like<std::shared_ptr<M>> : std::is_base_of<torch::nn::Module, M> {};

// Calls module->forward on a chunk, choosing the overload by the input kind:
// forward(Tensor), forward(std::vector<Tensor>) or
// forward(std::map<std::string, Tensor>).
template <typename M>
EncoderFn module_forward(std::shared_ptr<M> module) {
  return [module](const BatchInput& x) -> c10::IValue {
    switch (x.kind()) {
      case BatchInput::Kind::kTensor:
        if constexpr (has_forward<M, const torch::Tensor&>::value) {
          return c10::IValue(module->forward(x.tensor()));
        }
        no_module_forward("a tensor input needs forward(torch::Tensor)");
      case BatchInput::Kind::kList:
        if constexpr (has_forward<M, const std::vector<torch::Tensor>&>::value) {
          return c10::IValue(module->forward(x.list()));
        }
        no_module_forward("a list input needs forward(std::vector<torch::Tensor>)");
      case BatchInput::Kind::kNamed:
        if constexpr (has_forward<M, const std::map<std::string, torch::Tensor>&>::value) {
          return c10::IValue(module->forward(x.named()));
        }
        no_module_forward("a named input needs forward(std::map<std::string, torch::Tensor>)");
      default:
        no_module_forward("an IValue input needs an encoder callable");
    }
  };
}
}  // namespace detail

/// One encoder of a gradient-cache step: how to run it, on chunks of which
/// size, and optionally how to split its input, how to find the
/// representation in its output, and the `DataParallel` that averages its
/// gradients. Several encoders may share one module (tied towers) and one
/// `DataParallel`.
///
///   contrax::GradCacheEncoder image(image_model, /*chunk_size=*/64);
///   contrax::GradCacheEncoder text([&](const contrax::BatchInput& x) -> c10::IValue {
///         return text_model->forward(x["ids"], x["mask"]);
///       }, 32);
///   text.get_rep([](const c10::IValue& out) { return out.toTupleRef().elements()[0].toTensor(); })
///       .data_parallel(text_dp);
class GradCacheEncoder {
 public:
  /// A callable encoder: anything an `EncoderFn` can hold.
  template <typename Fn,
            typename = std::enable_if_t<std::conjunction<std::negation<detail::is_module_like<std::decay_t<Fn>>>,
                                                         std::is_constructible<EncoderFn, Fn>>::value>>
  GradCacheEncoder(Fn&& forward, int64_t chunk_size)
      : GradCacheEncoder(EncoderFn(std::forward<Fn>(forward)), chunk_size, nullptr) {}
  /// A module encoder: `module->forward` is called with the chunk's tensor,
  /// list or map (whichever overload exists).
  template <typename ModuleType>
  GradCacheEncoder(const torch::nn::ModuleHolder<ModuleType>& module, int64_t chunk_size)
      : GradCacheEncoder(detail::module_forward(module.ptr()), chunk_size, nullptr) {
    module_ = module.ptr();
  }
  /// A module encoder held by a `std::shared_ptr`; otherwise the same as the
  /// ModuleHolder constructor.
  template <typename ModuleType,
            typename = std::enable_if_t<std::is_base_of<torch::nn::Module, ModuleType>::value>>
  GradCacheEncoder(std::shared_ptr<ModuleType> module, int64_t chunk_size)
      : GradCacheEncoder(detail::module_forward(module), chunk_size, nullptr) {
    module_ = module;
  }

  /// Rows per chunk (> 0). The last chunk of a batch may be shorter.
  TORCH_ARG(int64_t, chunk_size);
  /// Representation getter; default: the output must be a tensor.
  TORCH_ARG(RepresentationFn, get_rep) = nullptr;
  /// Input splitter; default: `narrow` along dim 0 (required for kOther).
  TORCH_ARG(SplitFn, split) = nullptr;
  /// Averages this encoder's gradients over ranks, once per step.
  TORCH_ARG(DataParallelPtr, data_parallel) = nullptr;
  /// Name for `GradCache::cache(name, ...)` and error messages.
  TORCH_ARG(std::string, name) = "";

 public:
  /// The function that runs the encoder on one chunk.
  const EncoderFn& forward() const { return forward_; }
  /// The module, when built from one (null for callables).
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

 private:
  GradCacheEncoder(EncoderFn forward, int64_t chunk_size, std::nullptr_t);
  EncoderFn forward_;
  std::shared_ptr<torch::nn::Module> module_;
};

/// Options for `GradCache`. Defaults: no loss scaling, no autocast, random
/// state replayed, gradients synchronised once per step.
///
///   auto opts = contrax::GradCacheOptions().loss_data_parallel(loss_dp).bf16_autocast(true);
struct GradCacheOptions {
  /// Loss-scale hook applied before the loss backward (fp16 on GPU).
  TORCH_ARG(LossScaleFn, scale_loss) = nullptr;
  /// Run the encoders under autocast to bfloat16 on their device (the
  /// encoder's parameters', else its inputs': CUDA for a model on the GPU fed
  /// CPU tensors). The loss function runs outside autocast; representations
  /// arrive in bf16.
  TORCH_ARG(bool, bf16_autocast) = false;
  /// Save the default CPU generator, and the CUDA generators of the chunk's
  /// inputs, of the encoder's parameters and of the current CUDA device,
  /// before each chunk and restore them for the chunk's second pass. Turning
  /// it off is wrong for any encoder that draws random numbers (dropout).
  TORCH_ARG(bool, replay_rng) = true;
  /// DataParallel over the module owning the loss-side parameters (e.g. a
  /// `ClipLoss` with its logit scale): its reducer is armed for the one loss
  /// backward, so those gradients are averaged over ranks too. Without it,
  /// loss-side gradients stay local (rank r's d L_r / d s).
  TORCH_ARG(DataParallelPtr, loss_data_parallel) = nullptr;
};

/// The gradient-cache training step.
///
///   contrax::ClipLoss clip(contrax::ClipLossOptions().comm(comm));
///   contrax::GradCache gc({contrax::GradCacheEncoder(image_model, 128).data_parallel(image_dp),
///                          contrax::GradCacheEncoder(text_model, 128).data_parallel(text_dp)},
///                         [&](const std::vector<torch::Tensor>& r) { return clip(r[0], r[1]); },
///                         contrax::GradCacheOptions().loss_data_parallel(clip_dp));
///   optimizer.zero_grad();
///   torch::Tensor loss = gc.step({images, texts});   // grads as for one big batch
///   optimizer.step();
///
/// Functional form, for a data loader that yields small batches:
///
///   for (auto& [x, y] : loader) {
///     gc.cache(0, x);          // pass 1 now; input and RNG state kept
///     gc.cache("text", y);     // encoders by index or name; named inputs fine
///     if (++n % 16 == 0) { gc.finish(); optimizer.step(); optimizer.zero_grad(); }
///   }
///
/// Gradients are accumulated into `.grad` (zero them between steps, as usual).
class GradCache {
 public:
  /// Checks the encoders (at least one, positive chunk sizes, distinct names)
  /// and keeps `loss`, the loss over their representations.
  GradCache(std::vector<GradCacheEncoder> encoders, RepresentationLossFn loss, GradCacheOptions options = {});

  /// One whole step: inputs[e] goes to encoder e. Returns the loss (detached,
  /// unscaled).
  torch::Tensor step(const std::vector<BatchInput>& inputs);

  /// Pass 1 on a (sub-)batch of encoder `encoder`: splits it into chunks,
  /// runs them without a graph and caches the representations, the inputs and
  /// the random state. Returns the detached representation rows, in order.
  /// An input of 0 rows is one 0-row chunk: a rank without rows still runs
  /// the step's collectives (loss, gradient averaging) with the others.
  torch::Tensor cache(size_t encoder, const BatchInput& input);
  /// As cache(size_t, const BatchInput&), for the encoder whose `name` is
  /// `encoder_name` (error listing the named encoders when none matches).
  torch::Tensor cache(const std::string& encoder_name, const BatchInput& input);

  /// Completes the step over everything cached since the last finish: loss
  /// and its backward, pass 2 and the gradient synchronisation. Every encoder
  /// must have been given an input (0 rows are fine). Clears the cache;
  /// returns the loss (detached, unscaled).
  torch::Tensor finish();
  /// As finish(), with `loss` in place of the constructor's loss for this step
  /// (e.g. to pass step-dependent arguments).
  torch::Tensor finish(const RepresentationLossFn& loss);

  /// Drops everything cached (e.g. after an exception).
  void clear();
  /// Rows cached for encoder `encoder` since the last finish.
  int64_t cached_rows(size_t encoder) const;
  /// The encoders, in the order of the constructor.
  const std::vector<GradCacheEncoder>& encoders() const { return encoders_; }
  /// The options this step was built with.
  const GradCacheOptions& options() const { return options_; }

 private:
  struct Chunk;
  struct Impl;
  // Pass 1 of `cache()`; returns how many chunks it added.
  size_t run_pass1(size_t encoder, const BatchInput& input);
  std::vector<GradCacheEncoder> encoders_;
  RepresentationLossFn loss_;
  GradCacheOptions options_;
  std::shared_ptr<Impl> impl_;
};

}  // namespace contrax
