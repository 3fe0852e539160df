// Test harness: N ranks as threads in one process, each with a Gloo
// communicator rendezvousing over a fresh FileStore with a short timeout
// (c10d's own test style), plus numeric comparison helpers.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "contrax/comm/communicator.h"

namespace contrax::testing {

/// Runs `fn(comm)` on `world_size` threads (rank = comm->rank()). World size 1
/// gets a single() communicator (no process group). Joins all threads, then
/// rethrows the first failure prefixed with its rank. gtest assertions inside
/// `fn` are fine (they are thread-safe on POSIX).
/// `configure(rank, options)`, when given, adjusts each rank's options (a
/// backend, a device) before its communicator is built.
using ConfigureRank = std::function<void(int64_t rank, CommunicatorOptions& options)>;
void run_ranks(int64_t world_size, const std::function<void(const CommunicatorPtr&)>& fn,
               std::chrono::milliseconds timeout = std::chrono::seconds(30), const ConfigureRank& configure = {});

/// Like run_ranks but every rank's exception is collected instead of rethrown:
/// result[r] is rank r's error message ("" when it returned normally).
std::vector<std::string> run_ranks_collect_errors(
    int64_t world_size, const std::function<void(const CommunicatorPtr&)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(30), const ConfigureRank& configure = {});

/// max |a - b| / max(max |b|, tiny): the relative error used across the suite.
double rel_err(const torch::Tensor& a, const torch::Tensor& b);

/// Row offsets for per-rank counts: offsets[r] = sum_{s<r} counts[s].
std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts);

/// Rows [off_r, off_r + counts[r]) of `global` (a view).
torch::Tensor shard(const torch::Tensor& global, const std::vector<int64_t>& counts, int64_t rank);

/// Central finite-difference check of d(sum(f(x) * w))/dx against autograd for
/// every input that requires grad; fp64 inputs. Returns the largest error
/// max|analytic - numeric| / max(1, max|numeric|).
double finite_difference_error(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
                               const std::vector<torch::Tensor>& inputs, double eps = 1e-6);

}  // namespace contrax::testing
