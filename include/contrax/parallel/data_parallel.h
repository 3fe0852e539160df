// Data-parallel training of LibTorch C++ modules on c10d's own Reducer.
//
// `DataParallel` is to a `torch::nn::Module` what PyTorch's
// DistributedDataParallel is to an `nn.Module`, driven by the same engine:
// c10d's `Reducer` (gradient buckets in reverse registration order, an
// asynchronous all-reduce launched from autograd hooks as soon as a bucket's
// gradients are ready, so communication overlaps the rest of the backward, and
// averaging over ranks). At construction the ranks first exchange and compare
// every parameter's and buffer's shape and dtype (a mismatch is the same clear
// error on every rank, never a hang), then take rank 0's values. A no-sync
// scope lets gradients accumulate locally over several backward passes (the
// gradient cache's chunks) and be averaged once. A world of size 1 builds no
// reducer and communicates nothing.
//
// The reducer's all-reduces go through a communication hook of ours (plain
// all-reduce of the bucket, then divide by W), which also records their calls
// and bytes in the communicator's statistics as "reducer_all_reduce".
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "contrax/comm/communicator.h"

namespace contrax {

/// Options for `DataParallel`. Defaults are PyTorch DDP's: 25 MiB buckets with
/// a 1 MiB first bucket, all parameters expected to receive a gradient in each
/// synchronised backward, buffers broadcast from rank 0.
///
///   auto dp = std::make_shared<contrax::DataParallel>(model, comm,
///       contrax::DataParallelOptions().bucket_bytes(4 << 20));
struct DataParallelOptions {
  /// Bucket capacity in bytes (DDP's bucket_cap_mb * 2^20).
  TORCH_ARG(int64_t, bucket_bytes) = 25 * 1024 * 1024;
  /// Capacity of the first bucket to be reduced (the last parameters), kept
  /// small so that communication starts early in the backward.
  TORCH_ARG(int64_t, first_bucket_bytes) = 1024 * 1024;
  /// Traverse the outputs' graph to mark parameters that the forward did not
  /// use as ready (DDP's find_unused_parameters). Needs the forward's outputs.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Make each parameter's `.grad` a view into its bucket (saves one copy and
  /// the memory of the gradients).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Broadcast buffers (e.g. BatchNorm statistics) from rank 0 at the start of
  /// each synchronised forward run through `forward()` or `sync_buffers()`.
  TORCH_ARG(bool, broadcast_buffers) = true;
};

namespace detail {
// Tensors in a forward's result, for the reducer's unused-parameter search.
inline void collect_tensors(const torch::Tensor& t, std::vector<torch::Tensor>& out) {
  if (t.defined()) out.push_back(t);
}
inline void collect_tensors(const std::vector<torch::Tensor>& ts, std::vector<torch::Tensor>& out) {
  for (const auto& t : ts) collect_tensors(t, out);
}
void collect_tensors(const c10::IValue& v, std::vector<torch::Tensor>& out);
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<torch::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, t);
}
template <typename T>
void collect_tensors(const T&, std::vector<torch::Tensor>&) {}  // opaque result: none
}  // namespace detail

/// Data-parallel wrapper of a module: gradients averaged over ranks by
/// c10d's Reducer.
///
/// C++ modules have no common `forward` signature, so the caller runs the
/// forward inside `forward(fn)` (or calls `prepare_for_backward()` itself after
/// its forward); the wrapper arms the reducer for the following backward when
/// grad mode is on and no `no_sync()` scope is active, exactly where DDP would.
///
///   auto model = std::make_shared<Net>();
///   contrax::DataParallel dp(model, comm);
///   auto out = dp.forward([&] { return model->forward(x); });
///   loss_fn(out).backward();          // grads now averaged over ranks
///   {
///     auto guard = dp.no_sync();      // accumulate locally...
///     loss_fn(dp.forward([&] { return model->forward(x1); })).backward();
///   }
///   loss_fn(dp.forward([&] { return model->forward(x2); })).backward();  // ...sync once
///
/// Not copyable or movable (the reducer's autograd hooks point at it); hold it
/// in a `std::shared_ptr` to share it with a `GradCache`.
class DataParallel {
 public:
  /// Checks that every rank's module has the same parameters and buffers
  /// (count, shape, dtype; errors name the first mismatch and both ranks),
  /// broadcasts rank 0's values and builds the reducer. Collective: every rank
  /// constructs its DataParallel at the same point. A null `comm` is world 1.
  DataParallel(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm,
               DataParallelOptions options = {});
  /// Wraps a module held by LibTorch's ModuleHolder (`MyNet`, not `MyNetImpl`);
  /// otherwise the same as the constructor above.
  template <typename ModuleType>
  DataParallel(const torch::nn::ModuleHolder<ModuleType>& module, CommunicatorPtr comm,
               DataParallelOptions options = {})
      : DataParallel(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(comm),
                     std::move(options)) {}
  ~DataParallel();
  C10_DISABLE_COPY_AND_ASSIGN(DataParallel);

  /// Runs `fn()` (the wrapped module's forward) as DDP's forward: when
  /// `will_sync()`, buffers are broadcast from rank 0 first and the reducer is
  /// armed for the next backward with the tensors of the result. Returns what `fn` returns.
  template <typename Fn>
  auto forward(Fn&& fn) -> decltype(std::forward<Fn>(fn)()) {
    const bool sync = will_sync();
    if (sync) sync_buffers();
    auto out = std::forward<Fn>(fn)();
    if (sync) {
      std::vector<torch::Tensor> tensors;
      detail::collect_tensors(out, tensors);
      prepare_for_backward(tensors);
    }
    return out;
  }

  /// Arms the reducer: the next backward pass that reaches the module's
  /// parameters averages their gradients over ranks (bucket by bucket, while
  /// the backward runs). `outputs` are searched for unused parameters when
  /// `find_unused_parameters` is set. No-op for W = 1. Call it on every rank,
  /// then run exactly one backward through the module's parameters.
  void prepare_for_backward(const std::vector<torch::Tensor>& outputs = {});

  /// Broadcasts the module's buffers from rank 0 (when `broadcast_buffers`
  /// and there are any). Collective.
  void sync_buffers();

  /// True when a backward run now would be synchronised: W > 1, grad mode on
  /// and no `no_sync()` scope active.
  bool will_sync() const;

  /// RAII scope in which `forward()` does not arm the reducer, so backward
  /// passes accumulate gradients locally (DDP's `no_sync`). Nests.
  class NoSyncGuard {
   public:
    /// Opens a no-sync scope on `dp` (the scopes nest); the destructor closes it.
    explicit NoSyncGuard(DataParallel& dp);
    ~NoSyncGuard();
    /// Takes over `other`'s scope; `other` then closes nothing.
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    C10_DISABLE_COPY_AND_ASSIGN(NoSyncGuard);
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    DataParallel* dp_;
  };
  /// Opens a no-sync scope that lasts as long as the returned guard.
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }
  /// True while at least one no-sync scope is open.
  bool in_no_sync() const;

  /// The wrapped module.
  torch::nn::Module& module() const { return *module_; }
  /// The wrapped module, shared.
  const std::shared_ptr<torch::nn::Module>& module_ptr() const { return module_; }
  /// The communicator the gradients are averaged over.
  const CommunicatorPtr& comm() const { return comm_; }
  /// The options this wrapper was built with.
  const DataParallelOptions& options() const { return options_; }
  /// True when a c10d Reducer is in use (W > 1 and some parameter needs grad).
  bool has_reducer() const;
  /// Number of gradient buckets (0 without a reducer). May change once after
  /// the first synchronised backward, when the reducer re-buckets parameters
  /// in the order their gradients became ready (as DDP does).
  int64_t num_buckets() const;
  /// How many times the reducer has been armed (synchronised backwards).
  int64_t sync_count() const;

 private:
  struct Impl;
  std::shared_ptr<torch::nn::Module> module_;
  CommunicatorPtr comm_;
  DataParallelOptions options_;
  std::unique_ptr<Impl> impl_;
};

using DataParallelPtr = std::shared_ptr<DataParallel>;

}  // namespace contrax
