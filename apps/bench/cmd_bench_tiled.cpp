// `contrax bench-tiled`: the memory and time of the tiled InfoNCE against the
// materialised one, and (under `contrax launch`) of the ring against gather +
// reduce-scatter. Prints markdown tables for docs/benchmarks.md.
//
// Single process (default): for each batch B, one-direction InfoNCE (clip_loss
// with symmetric=false; `--symmetric`: symmetric CLIP) on [B, width] fp32
// features: peak bytes allocated during forward + backward (counting allocator)
// and wall time, both as ratios to the materialised path, and time as a
// multiple of the GEMM floor (the old algorithm's [B x B] products timed alone:
// three, six with --symmetric; extrapolated from the measured GFLOP/s where a
// [B x B] buffer does not fit).
//
// `--device cuda` runs on the GPU (under contrax launch, rank r on GPU
// LOCAL_RANK mod #GPUs, NCCL between them): times are taken after a device
// synchronisation; the peak columns say n/a (the counting allocator sees host
// memory only; python/bench/bench_clip.py reports the GPU's peak).
//
//   contrax bench-tiled --threads 2 --batches 4096,16384,32768,131072
//   contrax launch --nproc 2 -- contrax bench-tiled --ring --batches 8192
//   contrax bench-tiled --device cuda --batches 16384,65536 --width 768
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "bench/bench_timing.h"
#include "cli/build_info.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/machine.h"
#include "contrax/comm/communicator.h"
#include "contrax/engine/workspace.h"
#include "contrax/losses/losses.h"
#include "contrax/util/memory.h"

namespace {

using contrax::cli::Timed;

// Where the benchmark computes (the tensors' device); a GPU's work is timed
// to its end.
torch::Device g_device = torch::kCPU;

// A peak column: the counting allocator's figure on the CPU; n/a on a GPU.
std::string peak_cell(int64_t bytes) { return g_device.is_cuda() ? std::string("n/a") : contrax::cli::mib(bytes); }

Timed measure(const std::function<torch::Tensor()>& loss) {
  return contrax::cli::timed([&] { loss().backward(); }, g_device);
}

// Warm-up: thread pools, BLAS buffers and the allocator's first pages.
void warm_up(int64_t width, int64_t tile) {
  auto x = torch::randn({512, width}, g_device).requires_grad_(true);
  auto y = torch::randn({512, width}, g_device).requires_grad_(true);
  auto ls = torch::tensor(0.0f, g_device).requires_grad_(true);
  contrax::clip_loss(x, y, ls).backward();
  contrax::clip_loss(x, y, ls, {},
                     contrax::ClipLossOptions().path(contrax::MemoryPath::kTiled).tile_size(tile > 0 ? tile : 128))
      .backward();
}

// The old algorithm's GEMMs alone (three per direction), timed.
Timed old_gemm_floor(const torch::Tensor& a, const torch::Tensor& b, int64_t directions) {
  torch::NoGradGuard no_grad;
  return contrax::cli::timed([&] {
    for (int64_t dir = 0; dir < directions; ++dir) {
      auto logits = torch::mm(dir == 0 ? a : b, (dir == 0 ? b : a).t());  // [B, B]
      auto ga = torch::mm(logits, b);                                     // [B, d]
      auto gb = torch::mm(logits.t(), a);                                 // [B, d]
    }
  }, g_device);
}

// The materialised loss keeps its logits buffer between calls
// (contrax/util/memory.h): released before each batch, the first run allocates
// it and the peak counts it, while the median time is that of the runs that
// reuse it, as training does.
int run_single(int64_t width, const std::vector<int64_t>& batches, int64_t tile, int64_t max_materialised,
               int64_t iters, bool symmetric) {
  std::printf("| B | materialised time | materialised peak | tiled time | tiled peak | time ratio | memory ratio | "
              "old GEMM floor | materialised / floor | tiled / floor |\n|---|---|---|---|---|---|---|---|---|---|\n");
  double gflops = 0;  // measured rate of the three GEMMs, for extrapolation
  warm_up(width, tile);
  for (int64_t B : batches) {
    contrax::release_loss_workspace();
    torch::manual_seed(0);
    const double unit = std::sqrt(static_cast<double>(width));
    auto a = (torch::randn({B, width}, g_device) / unit).requires_grad_(true);  // [B, d]
    auto b = (torch::randn({B, width}, g_device) / unit).requires_grad_(true);  // [B, d]
    auto ls = torch::tensor(std::log(10.0f), g_device).requires_grad_(true);
    auto opts = contrax::ClipLossOptions().symmetric(symmetric);
    // The floor is the old algorithm's: three GEMMs per direction (six for
    // symmetric CLIP, which used to compute both directions' products).
    const int64_t directions = symmetric ? 2 : 1;
    const double flops =
        directions * 3.0 * 2.0 * static_cast<double>(B) * static_cast<double>(B) * static_cast<double>(width);

    // The materialised loss peaks at three [B x B] fp32 buffers (logits,
    // log-probabilities, their gradient: 3088 MiB measured at B = 16384); 10% slack.
    const int64_t need = 33 * B * B * 4 / 10;
    const int64_t memory = g_device.is_cuda() ? contrax::available_device_memory_bytes(g_device)
                                              : contrax::available_memory_bytes();
    const bool fits = B <= max_materialised && need < memory * 7 / 10;
    Timed mat;
    double floor_s = 0;
    bool floor_measured = false;
    // The floor: the old algorithm's GEMMs alone, alternated with the contenders.
    auto floor_run = [&] { return old_gemm_floor(a, b, directions); };
    auto run_of = [&](std::function<torch::Tensor()> loss) {
      return [&a, &b, loss] {
        Timed r = measure(loss);
        a.mutable_grad() = torch::Tensor();
        b.mutable_grad() = torch::Tensor();
        return r;
      };
    };
    std::vector<std::function<Timed()>> contenders = {run_of([&] {
      return contrax::clip_loss(a, b, ls, {},
                                contrax::ClipLossOptions(opts).path(contrax::MemoryPath::kTiled).tile_size(tile));
    })};
    // kMaterialised: clip_loss would otherwise route itself to the tiled path
    // above max_logits_bytes, and the baseline would measure the contender.
    auto materialised = contrax::ClipLossOptions(opts).path(contrax::MemoryPath::kMaterialised);
    if (fits) contenders.push_back(run_of([&] { return contrax::clip_loss(a, b, ls, {}, materialised); }));
    if (fits) contenders.push_back(floor_run);
    auto runs = contrax::cli::alternate(contenders.size(), iters, [&](size_t i) { return contenders[i](); });
    Timed tiled = runs[0];
    if (fits) {
      mat = runs[1];
      floor_s = runs[2].seconds;
      floor_measured = true;
      gflops = flops / floor_s / 1e9;
    } else if (gflops > 0) {
      floor_s = flops / (gflops * 1e9);
    }

    auto cell = [](bool ok, const std::string& s) { return ok ? s : std::string("—"); };
    char buf[512];
    std::snprintf(buf, sizeof buf, "| %lld | %s | %s | %.2f s | %s | %s | %s | %s | %s | %s |\n", static_cast<long long>(B),
                  cell(fits, c10::str(std::round(mat.seconds * 100) / 100, " s")).c_str(),
                  cell(fits, peak_cell(mat.peak)).c_str(), tiled.seconds, peak_cell(tiled.peak).c_str(),
                  cell(fits, c10::str(std::round(tiled.seconds / mat.seconds * 100) / 100, "x")).c_str(),
                  cell(fits && !g_device.is_cuda(),
                       c10::str("1/", std::round(static_cast<double>(mat.peak) / tiled.peak)))
                      .c_str(),
                  cell(floor_s > 0, c10::str(std::round(floor_s * 100) / 100, " s", floor_measured ? "" : " (extrap.)"))
                      .c_str(),
                  cell(fits && floor_s > 0, c10::str(std::round(mat.seconds / floor_s * 100) / 100, "x")).c_str(),
                  cell(floor_s > 0, c10::str(std::round(tiled.seconds / floor_s * 100) / 100, "x")).c_str());
    std::cout << buf << std::flush;
  }
  if (gflops > 0) std::printf("\nthree-GEMM rate: %.1f GFLOP/s\n", gflops);
  return 0;
}

int run_ring(int64_t width, const std::vector<int64_t>& batches, int64_t tile) {
  auto comm = contrax::Communicator::from_env(contrax::CommunicatorOptions().device(g_device.type()));
  g_device = comm->device();  // this rank's GPU (LOCAL_RANK mod #GPUs) on CUDA
  const int64_t W = comm->world_size(), r = comm->rank();
  if (r == 0) {
    std::printf("| W | B | path | time | bytes sent / rank | peak / rank |\n|---|---|---|---|---|---|\n");
  }
  for (int64_t B : batches) {
    const int64_t b = B / W + (r < B % W ? 1 : 0);
    torch::manual_seed(r);
    const double unit = std::sqrt(static_cast<double>(width));
    auto a = (torch::randn({b, width}, g_device) / unit).requires_grad_(true);  // [b, d]
    auto k = (torch::randn({b, width}, g_device) / unit).requires_grad_(true);  // [b, d]
    auto ls = torch::tensor(std::log(10.0f), g_device).requires_grad_(true);
    for (bool ring : {false, true}) {
      comm->barrier();
      comm->reset_stats();
      Timed run = measure([&] {
        return contrax::clip_loss(
            a, k, ls, {},
            contrax::ClipLossOptions().comm(comm).path(contrax::MemoryPath::kTiled).tile_size(tile).ring(ring));
      });
      // Bytes of the data path only (the size exchange is a few integers).
      const auto stats = comm->stats();
      const int64_t bytes = stats.total_bytes_sent() - stats.op("metadata").bytes_sent;
      std::vector<int64_t> mine = {static_cast<int64_t>(run.seconds * 1e6), bytes, run.peak};
      auto all = comm->all_gather_ints(mine);
      if (r == 0) {
        int64_t t = 0, by = 0, pk = 0;
        for (auto& v : all) {
          t = std::max(t, v[0]);
          by = std::max(by, v[1]);
          pk = std::max(pk, v[2]);
        }
        std::printf("| %lld | %lld | %s | %.2f s | %s | %s |\n", static_cast<long long>(W), static_cast<long long>(B),
                    ring ? "ring (tiled)" : "gather + reduce-scatter (tiled)", t / 1e6, contrax::cli::mib(by).c_str(),
                    peak_cell(pk).c_str());
        std::fflush(stdout);
      }
      a.mutable_grad() = torch::Tensor();
      k.mutable_grad() = torch::Tensor();
    }
  }
  return 0;
}

int run_bench_tiled(const std::vector<std::string>& args) {
  namespace cli = contrax::cli;
  CLI::App app{"benchmark the tiled and ring losses against the materialised path", "bench-tiled"};
  cli::setup_app(app);
  std::string list_s = "4096,16384,32768,65536,131072";
  int64_t width = 256, tile = 0, threads = 0, max_mat = 32768, iters = 1;
  bool ring = false, symmetric = false;
  std::string device = "cpu";
  cli::add_int(app, "--width", width, "feature width d", 1, int64_t{1} << 20);
  app.add_option("--batches", list_s, "comma-separated global batch sizes");
  cli::add_int(app, "--tile", tile, "tile side (0: automatic, ~16 MiB of logits)", 0, int64_t{1} << 30);
  cli::add_int(app, "--threads", threads, "intra-op threads (0: keep LibTorch's default)", 0, cli::max_procs());
  cli::add_int(app, "--max-materialised", max_mat, "largest B to run the materialised loss at", 0, int64_t{1} << 30);
  cli::add_int(app, "--iters", iters, "timed runs per path and batch, alternated; the median is reported", 1, 100000);
  app.add_flag("--ring", ring, "distributed: ring against gather + reduce-scatter (run under contrax launch)");
  app.add_flag("--symmetric", symmetric, "single process: symmetric CLIP (floor: the old six GEMMs)");
  cli::add_device(app, device,
                  "where it computes: cpu, or cuda (GPU 0; with --ring under contrax launch, rank r on GPU LOCAL_RANK "
                  "mod #GPUs, NCCL between them)");
  if (int st = cli::parse(app, args); st >= 0) return st;
  cli::check_cuda_device(device, 1);
  if (device == "cuda") g_device = torch::Device(torch::kCUDA, 0);
  const auto list = cli::parse_int_list("--batches", list_s, 1, int64_t{1} << 30);
  cli::usage_check(!list.empty(), "flag '--batches' needs at least one batch size");
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  contrax::MemoryTracker::install();
  std::printf("bench-tiled: width %lld, fp32 on %s, tile %s, threads %d, BLAS %s, median of %lld\n\n",
              static_cast<long long>(width), device.c_str(), tile > 0 ? std::to_string(tile).c_str() : "auto",
              at::get_num_threads(), contrax::cli::blas_library().c_str(), static_cast<long long>(iters));
  return ring ? run_ring(width, list, tile) : run_single(width, list, tile, max_mat, iters, symmetric);
}

contrax::cli::Command bench_tiled_cmd("bench-tiled",
                                      "benchmark the tiled and ring losses against the materialised path",
                                      run_bench_tiled);

}  // namespace
