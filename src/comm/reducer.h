// The gradient reducer of DataParallel (contrax/parallel/data_parallel.h): c10d's
// Reducer over a communicator's process group, with DDP's bucket assignment and
// a hook that averages each bucket and counts its bytes ("reducer_all_reduce").
// A narrow interface, so that only src/comm/ sees c10d (and the Reducer's
// constructor, which changes between releases). Internal, not installed.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "contrax/comm/communicator.h"

namespace contrax::detail {

/// What the Reducer is built with (DataParallelOptions' fields).
struct ReducerOptions {
  int64_t first_bucket_bytes = 0;
  int64_t bucket_bytes = 0;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
};

class GradientReducer {
 public:
  /// c10d's Reducer over `comm`'s process group (W > 1) for `params` (the
  /// parameters that require grad; `names[i]` is params[i]'s name), with
  /// buckets of [first_bucket_bytes, bucket_bytes] in reverse registration
  /// order as DDP assigns them. `comm` must outlive the reducer.
  GradientReducer(Communicator& comm, const std::vector<torch::Tensor>& params,
                  std::unordered_map<size_t, std::string> names, const ReducerOptions& options);
  ~GradientReducer();
  C10_DISABLE_COPY_AND_ASSIGN(GradientReducer);

  /// Re-buckets once, after the first synchronised backward recorded the
  /// order in which gradients became ready; true when it did.
  bool rebuild_buckets();
  /// Arms the reducer's autograd hooks for the next backward through `outputs`.
  void prepare_for_backward(const std::vector<torch::Tensor>& outputs);
  /// Number of gradient buckets.
  int64_t num_buckets() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace contrax::detail
