// DataParallel's gradient reducer on c10d's Reducer (see comm/reducer.h).
#include "comm/reducer.h"

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/version.h>

#include <algorithm>
#include <tuple>

#include "comm/communicator_impl.h"

namespace contrax::detail {

namespace {

// The reducer's communication: all-reduce the bucket in place, divide by W
// (with a hook registered the Reducer leaves the averaging to the hook, as
// c10d's built-in ALLREDUCE hook does), and count the traffic. A ring
// all-reduce of n bytes sends 2 (W-1)/W n per rank, the communicator's
// convention for "all_reduce".
class CountingAllReduceHook : public c10d::CommHookInterface {
 public:
  CountingAllReduceHook(c10::intrusive_ptr<c10d::ProcessGroup> group, Communicator* comm)
      : group_(std::move(group)), comm_(comm) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    std::vector<at::Tensor> tensors{bucket.getBufferRef()};
    const int64_t world = group_->getSize();
    const int64_t bytes = tensors[0].numel() * static_cast<int64_t>(tensors[0].element_size());
    comm_->record("reducer_all_reduce", 2 * (world - 1) * bytes / world, 1);
    auto work = group_->allreduce(tensors);
    auto fut = work->getFuture();
    return fut->then(
        [world](c10::ivalue::Future& done) {
          at::Tensor t = done.value().toTensorVector()[0];
          t.div_(world);
          return c10::IValue(t);
        },
        c10::TensorType::get());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isTensor()) return result.toTensor();
    return result.toTensorVector().at(0);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  Communicator* comm_;  // outlives the reducer (GradientReducer's contract)
};

// c10d's Reducer with DDP's buckets: [first cap, cap] bytes, in reverse
// (gradients become ready roughly in reverse registration order).
std::unique_ptr<c10d::Reducer> make_reducer(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                            const std::vector<at::Tensor>& params,
                                            std::unordered_map<size_t, std::string> names, const ReducerOptions& o) {
  std::vector<bool> expect_sparse(params.size(), false);
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> limits;
  std::tie(buckets, limits) = c10d::compute_bucket_assignment_by_size(
      params, {static_cast<size_t>(o.first_bucket_bytes), static_cast<size_t>(o.bucket_bytes)}, expect_sparse);
  std::reverse(buckets.begin(), buckets.end());
  std::reverse(limits.begin(), limits.end());
  // The constructor's arguments, by release: 2.6 takes the per-bucket size
  // limits third; 2.7 dropped them; 2.8 added skip_all_reduce_unused_params
  // and use_python_reducer; 2.11 added bucket_bytes_cap_list (empty: the
  // Reducer's own limits when it rebuilds its buckets).
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 7
  return std::make_unique<c10d::Reducer>(params, std::move(buckets), limits, group, expect_sparse, o.bucket_bytes,
                                         o.find_unused_parameters, o.gradient_as_bucket_view, std::move(names),
                                         o.first_bucket_bytes);
#else
  const auto reducer = [&](auto... newer) {
    return std::make_unique<c10d::Reducer>(params, std::move(buckets), group, expect_sparse, o.bucket_bytes,
                                           o.find_unused_parameters, o.gradient_as_bucket_view, std::move(names),
                                           o.first_bucket_bytes, newer...);
  };
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 8
  return reducer();
#elif TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 11
  return reducer(/*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false);
#else
  return reducer(/*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
                 /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
#endif
#endif
}

}  // namespace

struct GradientReducer::Impl {
  std::unique_ptr<c10d::Reducer> reducer;
};

GradientReducer::GradientReducer(Communicator& comm, const std::vector<torch::Tensor>& params,
                                 std::unordered_map<size_t, std::string> names, const ReducerOptions& options)
    : impl_(std::make_unique<Impl>()) {
  auto group = comm.impl().group;
  TORCH_INTERNAL_ASSERT(group, "GradientReducer: world size ", comm.world_size(), " but no process group");
  impl_->reducer = make_reducer(group, params, std::move(names), options);
  impl_->reducer->register_comm_hook(std::make_unique<CountingAllReduceHook>(group, &comm));
}

GradientReducer::~GradientReducer() = default;

bool GradientReducer::rebuild_buckets() { return impl_->reducer->rebuild_buckets(); }

void GradientReducer::prepare_for_backward(const std::vector<torch::Tensor>& outputs) {
  impl_->reducer->prepare_for_backward(outputs);
}

int64_t GradientReducer::num_buckets() const {
  return static_cast<int64_t>(impl_->reducer->get_grad_buckets(/*return_zero_tensors=*/true).size());
}

}  // namespace contrax::detail
