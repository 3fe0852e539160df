// Thread-rank harness and numeric helpers for the test suite.
#include "support/ranks.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <exception>
#include <filesystem>
#include <thread>

#include "support/strict_warnings.h"

namespace contrax::testing {

namespace {
std::string fresh_store_path() {
  static std::atomic<int> counter{0};
  auto dir = std::filesystem::temp_directory_path();
  auto p = dir / ("contrax_store_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  std::filesystem::remove(p);
  return p.string();
}
}  // namespace

std::vector<std::string> run_ranks_collect_errors(int64_t world_size,
                                                  const std::function<void(const CommunicatorPtr&)>& fn,
                                                  std::chrono::milliseconds timeout, const ConfigureRank& configure) {
  std::vector<std::string> errors(world_size);
  if (world_size == 1) {
    try {
      fn(Communicator::single());
    } catch (const c10::Error& e) {
      errors[0] = e.what_without_backtrace();
    } catch (const std::exception& e) {
      errors[0] = e.what();
    }
    return errors;
  }
  const std::string path = fresh_store_path();
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      install_strict_warnings();
      try {
        auto options = CommunicatorOptions().rank(r).world_size(world_size).file_store(path).timeout(timeout);
        if (configure) configure(r, options);
        auto comm = Communicator::create(options);
        // No rank starts `fn` before every rank's group is connected: a rank
        // whose `fn` fails (or returns) at once would otherwise tear its group
        // down while a slower peer is still connecting, and that peer would
        // fail in create() ("connection closed by peer") instead of seeing
        // what the test is about (seen on a loaded 2-core machine).
        comm->barrier();
        fn(comm);
      } catch (const c10::Error& e) {
        errors[r] = e.what_without_backtrace();
        if (errors[r].empty()) errors[r] = "(empty error)";
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(empty error)";
      }
    });
  }
  for (auto& t : threads) t.join();
  std::filesystem::remove(path);
  return errors;
}

void run_ranks(int64_t world_size, const std::function<void(const CommunicatorPtr&)>& fn,
               std::chrono::milliseconds timeout, const ConfigureRank& configure) {
  auto errors = run_ranks_collect_errors(world_size, fn, timeout, configure);
  for (int64_t r = 0; r < world_size; ++r) {
    TORCH_CHECK(errors[r].empty(), "rank ", r, " of ", world_size, " failed: ", errors[r]);
  }
}

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(a.sizes() == b.sizes(), "rel_err: shapes differ: ", a.sizes(), " vs ", b.sizes());
  if (a.numel() == 0) return 0.0;
  auto ad = a.detach().to(torch::kDouble), bd = b.detach().to(torch::kDouble);
  const double scale = std::max(bd.abs().max().item<double>(), 1e-300);
  return (ad - bd).abs().max().item<double>() / scale;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
  return off;
}

torch::Tensor shard(const torch::Tensor& global, const std::vector<int64_t>& counts, int64_t rank) {
  return global.narrow(0, offsets_of(counts)[rank], counts[rank]);
}

double finite_difference_error(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
                               const std::vector<torch::Tensor>& inputs, double eps) {
  // Project the output on a fixed random direction so one backward gives a
  // full directional check of every input element.
  std::vector<torch::Tensor> xs;
  for (const auto& x : inputs) xs.push_back(x.detach().clone().requires_grad_(x.requires_grad()));
  auto out = f(xs);
  auto gen = at::detail::createCPUGenerator(1234);
  auto w = torch::randn(out.sizes(), gen, out.options().requires_grad(false));
  (out * w).sum().backward();
  double worst = 0.0;
  for (size_t k = 0; k < xs.size(); ++k) {
    if (!xs[k].requires_grad()) continue;
    auto analytic = xs[k].grad().defined() ? xs[k].grad() : torch::zeros_like(xs[k]);
    auto numeric = torch::zeros_like(xs[k]);
    auto flat = numeric.view(-1);
    for (int64_t i = 0; i < xs[k].numel(); ++i) {
      std::vector<torch::Tensor> plus, minus;
      for (size_t j = 0; j < xs.size(); ++j) {
        plus.push_back(xs[j].detach().clone());
        minus.push_back(xs[j].detach().clone());
      }
      plus[k].view(-1)[i] += eps;
      minus[k].view(-1)[i] -= eps;
      torch::NoGradGuard g;
      auto fp = (f(plus) * w).sum().item<double>();
      auto fm = (f(minus) * w).sum().item<double>();
      flat[i] = (fp - fm) / (2 * eps);
    }
    // Finite differences carry ~1e-10 absolute noise, so the error is relative
    // to the gradient's size but never to less than 1 (a gradient that is zero
    // by structure, like a bias under a softmax, is then compared absolutely).
    const double denom = std::max(1.0, numeric.abs().max().item<double>());
    worst = std::max(worst, (analytic - numeric).abs().max().item<double>() / denom);
  }
  return worst;
}

}  // namespace contrax::testing
