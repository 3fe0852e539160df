// `contrax bench-grad-cache`: peak memory and time per training step of
//   (a) an ordinary full-batch step (both towers forward over the whole batch,
//       loss, one backward) and
//   (b) the gradient-cache step with chunk C (default 128),
// for a two-tower MLP encoder pair (784-pixel "image" tower, 64-wide "text"
// tower, hidden 1024, dropout, 128-d output) and the CLIP loss in fp32. Prints a
// markdown table for docs/benchmarks.md.
//
// Both paths use the same loss, tiled by default (`--loss tiled`), so that
// the loss's own [B x B] logits do not mask what the gradient cache changes:
// the encoders' activations. Peak memory is counted by contrax's CPU allocator
// tracker as bytes above the level before the step (parameters, their
// gradients and the input batch are already allocated), over the timed steps,
// which follow one warm-up step per path. The paths alternate step by step and
// each reports its median time. The ratio uses process CPU time: with
// `--threads 1` that is the step's own cost; with more threads it also counts
// OpenMP workers spinning at barriers, of which the chunked path has more.
//
//   contrax bench-grad-cache --threads 1 --batches 512,2048,8192 --gc-batches 16384
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "bench/bench_timing.h"
#include "cli/build_info.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/machine.h"
#include "contrax/losses/losses.h"
#include "contrax/parallel/grad_cache.h"
#include "contrax/util/memory.h"

namespace {

struct TowerImpl : torch::nn::Module {
  TowerImpl(int64_t in, int64_t hidden, int64_t out, double p) : p(p) {
    fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, out));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // [n, in] -> [n, out]
    auto h = torch::dropout(torch::relu(fc1(x)), p, is_training());
    h = torch::dropout(torch::relu(fc2(h)), p, is_training());
    return fc3(h);
  }
  double p;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Tower);

int run_bench_grad_cache(const std::vector<std::string>& args) {
  namespace cli = contrax::cli;
  CLI::App app{"benchmark the gradient cache against the plain step", "bench-grad-cache"};
  cli::setup_app(app);
  std::string batches_s = "512,2048,8192", gc_batches_s = "32768", loss_kind = "tiled";
  int64_t chunk = 128, hidden = 1024, steps = 3, threads = 0;
  app.add_option("--batches", batches_s, "global batches for both (a) and (b)");
  app.add_option("--gc-batches", gc_batches_s, "further batches for (b) only");
  cli::add_int(app, "--chunk", chunk, "gradient-cache chunk size", 1, int64_t{1} << 30);
  cli::add_int(app, "--hidden", hidden, "hidden width of both towers", 1, int64_t{1} << 20);
  cli::add_int(app, "--steps", steps, "timed steps per point and path, alternated; the median is reported", 1, 100000);
  cli::add_int(app, "--threads", threads, "intra-op threads (0: keep LibTorch's default)", 0, cli::max_procs());
  cli::add_choice(app, "--loss", loss_kind, "loss path", {"tiled", "materialised"});
  if (int st = cli::parse(app, args); st >= 0) return st;
  const auto batches = cli::parse_int_list("--batches", batches_s, 1, int64_t{1} << 30);
  const auto gc_batches = cli::parse_int_list("--gc-batches", gc_batches_s, 1, int64_t{1} << 30);
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  contrax::MemoryTracker::install();

  torch::manual_seed(0);
  Tower image(784, hidden, 128, 0.1), text(64, hidden, 128, 0.1);
  auto logit_scale = torch::tensor(std::log(1 / 0.07f)).requires_grad_(true);
  std::vector<torch::Tensor> params = image->parameters();
  for (auto& p : text->parameters()) params.push_back(p);
  params.push_back(logit_scale);
  auto loss_fn = [&](const torch::Tensor& fa, const torch::Tensor& fb) {
    const auto path = loss_kind == "tiled" ? contrax::MemoryPath::kTiled : contrax::MemoryPath::kMaterialised;
    return contrax::clip_loss(fa, fb, logit_scale, {}, contrax::ClipLossOptions().path(path));
  };
  contrax::GradCache gc({contrax::GradCacheEncoder(image, chunk), contrax::GradCacheEncoder(text, chunk)},
                        [&](const std::vector<torch::Tensor>& r) { return loss_fn(r[0], r[1]); });

  std::printf("bench-grad-cache: two-tower MLP (784|64 -> %lld -> %lld -> 128, dropout 0.1), fp32, %s CLIP loss, "
              "chunk %lld, threads %d, BLAS %s\n\n",
              static_cast<long long>(hidden), static_cast<long long>(hidden), loss_kind.c_str(),
              static_cast<long long>(chunk), at::get_num_threads(), contrax::cli::blas_library().c_str());
  std::printf("times: wall / process CPU per step, median of %lld (the paths alternated)\n\n",
              static_cast<long long>(steps));
  std::printf("| B | (a) full-batch time | (a) peak | (b) grad-cache time | (b) peak | CPU time (b)/(a) | "
              "memory (a)/(b) |\n|---|---|---|---|---|---|---|\n");
  std::vector<std::pair<int64_t, bool>> points;
  for (auto B : batches) points.emplace_back(B, true);
  for (auto B : gc_batches) points.emplace_back(B, false);
  for (auto [B, with_full] : points) {
    torch::manual_seed(1);
    auto x = torch::randn({B, 784});  // [B, 784]
    auto y = torch::randn({B, 64});   // [B, 64]
    std::vector<std::function<void()>> contenders{[&] { gc.step({x, y}); }};
    if (with_full) contenders.push_back([&] { loss_fn(image->forward(x), text->forward(y)).backward(); });
    for (const auto& step : contenders) {  // warm-up: allocates the gradients, warms BLAS
      for (auto p : params) p.mutable_grad() = torch::Tensor();
      step();
    }
    auto measured = cli::alternate(contenders.size(), steps, [&](size_t i) {
      for (auto p : params) p.grad().zero_();
      return cli::timed(contenders[i]);
    });
    cli::Timed cached = measured[0], full = with_full ? measured[1] : cli::Timed{};
    char buf[512];
    if (with_full) {
      std::snprintf(buf, sizeof buf, "| %lld | %.2f / %.2f s | %s | %.2f / %.2f s | %s | %.2fx | %.1fx |\n",
                    static_cast<long long>(B), full.seconds, full.cpu, contrax::cli::mib(full.peak).c_str(), cached.seconds,
                    cached.cpu, contrax::cli::mib(cached.peak).c_str(), cached.cpu / full.cpu,
                    static_cast<double>(full.peak) / static_cast<double>(std::max<int64_t>(cached.peak, 1)));
    } else {
      std::snprintf(buf, sizeof buf, "| %lld | — | — | %.2f / %.2f s | %s | — | — |\n", static_cast<long long>(B),
                    cached.seconds, cached.cpu, contrax::cli::mib(cached.peak).c_str());
    }
    std::cout << buf << std::flush;
  }
  return 0;
}

contrax::cli::Command bench_grad_cache_cmd("bench-grad-cache",
                                           "benchmark the gradient-cache step against the full-batch step",
                                           run_bench_grad_cache);

}  // namespace
