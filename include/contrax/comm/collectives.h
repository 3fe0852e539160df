// Collectives with autograd: the gathers every distributed loss is built on.
//
// `gather_with_grad` is the differentiable all-gather. Its backward is a
// reduce-scatter with SUM: every rank's loss depends on every gathered row, so
// the gradient of rank s's rows is the sum over ranks of the incoming gradient
// slice s. That moves (W-1)/W of the gathered gradient per rank, half of the
// all-reduce-then-slice found in common implementations. Row counts may differ
// between ranks (a short last batch, even an empty rank): sizes, widths and
// dtypes are exchanged first and checked on every rank, so a mismatch is an
// error everywhere instead of a hang or garbage.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "contrax/comm/communicator.h"

namespace contrax {

/// Result of a gather: the rows of all ranks in rank order, plus where each
/// rank's rows sit.
struct Gathered {
  torch::Tensor all;            ///< the rows of every rank concatenated in rank order: `[B, ...]`
  std::vector<int64_t> counts;  ///< `counts[s]` = b_s, the number of rows rank s contributed
  int64_t offset = 0;           ///< off_r: the global index of this rank's first row
  int64_t total() const;        ///< the global row count B (the sum of `counts`)
};

/// Differentiable all-gather of rows. `local`: [b_r, ...] on every rank, same
/// trailing shape and dtype everywhere (checked). Backward: reduce-scatter-sum.
/// A null or world-1 `comm` returns `local` itself. Errors start with
/// `caller`() and name the tensor `arg` (a binding passes its own names).
///
///   auto g = contrax::gather_with_grad(features, comm);   // g.all: [B, d]
Gathered gather_with_grad(const torch::Tensor& local, const CommunicatorPtr& comm,
                          const char* caller = "gather_with_grad", const char* arg = "local");

/// All-gather of rows without gradient (for momentum keys and evaluation):
/// the result is detached. Same checks and uneven-size support.
Gathered gather_no_grad(const torch::Tensor& local, const CommunicatorPtr& comm,
                        const char* caller = "gather_no_grad", const char* arg = "local");

namespace detail {
/// Exchanges row count, trailing shape and dtype of `local`; throws on every
/// rank (same message) if trailing shape, dtype or device type differ between
/// ranks. Returns per-rank row counts. Under `comm->static_shapes()` nothing
/// is exchanged: every rank's count is this rank's, and an error is raised on
/// this rank only.
std::vector<int64_t> exchange_row_counts(const torch::Tensor& local, const CommunicatorPtr& comm,
                                         const char* caller, const char* arg);
/// Same, but `local_error` (non-empty when this rank's arguments failed a local
/// check) is shared with all ranks first: the failing rank throws it, the
/// others throw an error naming that rank. Nobody waits on a dead collective.
std::vector<int64_t> exchange_row_counts(const torch::Tensor& local, const CommunicatorPtr& comm,
                                         const char* caller, const char* arg, const std::string& local_error);
/// Same, with one integer per rank riding along in the same round trip:
/// `(*extras)[s]` is rank s's `extra` on return.
std::vector<int64_t> exchange_row_counts(const torch::Tensor& local, const CommunicatorPtr& comm,
                                         const char* caller, const char* arg, const std::string& local_error,
                                         int64_t extra, std::vector<int64_t>* extras);

/// The differentiable gather itself, for callers that already exchanged (and
/// agreed on) the row counts: no metadata round trip.
torch::Tensor gather_rows_with_grad(const torch::Tensor& local, const CommunicatorPtr& comm,
                                    const std::vector<int64_t>& counts);

// ---- the ring: key blocks (and their gradients) between neighbours

/// Calls `visit(owner, block)` once for every rank's block of rows, starting
/// with this rank's own `local` ([counts[rank], ...]) and then the blocks of
/// rank-1, rank-2, ...: while `visit` runs on a block, that block is already on
/// its way to rank+1 and the next one arriving from rank-1. At most the block
/// in hand and the arriving one are held. Null or world-1 `comm`: one call.
void ring_for_each_block(const CommunicatorPtr& comm, const std::vector<int64_t>& counts,
                         const torch::Tensor& local,
                         const std::function<void(int64_t owner, const torch::Tensor& block)>& visit,
                         const std::string& stat_name = "ring");

/// Like `ring_for_each_block`, but `visit` returns a gradient contribution for
/// the block it was given (same shape and dtype as the block). Contributions
/// travel with the ring, summed on the way, and reach the block's owner one
/// step after the last visit; the function returns the total for `local`.
/// Each step sends one message: the block in hand plus the partial sum of the
/// previous block, so transfers overlap the next visit.
torch::Tensor ring_for_each_block_grad(
    const CommunicatorPtr& comm, const std::vector<int64_t>& counts, const torch::Tensor& local,
    const std::function<torch::Tensor(int64_t owner, const torch::Tensor& block)>& visit,
    const std::string& stat_name = "ring");

}  // namespace detail

}  // namespace contrax
