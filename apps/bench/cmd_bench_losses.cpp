// `contrax bench-losses`: one CLIP loss forward+backward over W local
// processes, three ways side by side in one run:
//   (a) "global": gather without gradient, local slot replaced by the local
//       tensor, [B x B] logits, loss scaled by W (seed 003, GradCache helper);
//   (b) "allreduce": [local x global] logits, gather whose backward all-reduces
//       the full [B x d] gradient and slices (seed 000);
//   (c) "contrax": contrax::clip_loss (the engine: one row block per rank).
//   (f) "floor": only the GEMMs of the old algorithm with the same shapes (six
//       [b x B x d] for symmetric CLIP: two forward, four backward; twelve for
//       NT-Xent with both views gathered with gradient), the time any
//       implementation of it needs at least. Its logits are fresh tensors, as
//       the old code's were: each call faults their pages in again.
//   (f') "floor_kept": the same GEMMs into one logits buffer allocated before
//       the clock starts, the floor of an old algorithm that kept its buffer
//       as contrax keeps its workspace (contrax/util/memory.h). Its peak does not
//       count that buffer.
//   (m) "matryoshka": contrax::clip_loss over the Matryoshka prefixes of
//       `--matryoshka` (and the full width; engine/scorer.h);
//   (m') "matryoshka_loop": the loop a user writes without it (as
//       sentence-transformers' MatryoshkaLoss does): one contrax::clip_loss per
//       prefix on its normalised cut, summed.
// With `--loss nt_xent` the modes are contrax (nt_xent_loss), floor and floor_kept.
// Reports median time, bytes this rank sent in backward, and peak tensor memory
// per rank, as ratios to the first mode, plus the agreement of the feature
// gradients. `--device cuda` runs each rank on its bound GPU (NCCL between
// them): times are taken after a device synchronisation, and the peak column
// is the CPU allocator's, so it reads "n/a" there (python/bench/bench_clip.py
// measures the GPU's peak memory).
//
//   contrax bench-losses --nproc 2,4 --batch 1024,4096 --width 256 --modes floor,allreduce,contrax
//   contrax bench-losses --nproc 1 --batch 4096 --width 768 --modes contrax,matryoshka,matryoshka_loop \
//       --matryoshka 64,128,256
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <unistd.h>

#include "bench/bench_timing.h"
#include "cli/build_info.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/machine.h"
#include "contrax/comm/collectives.h"
#include "contrax/comm/communicator.h"
#include "contrax/launch/launcher.h"
#include "contrax/losses/losses.h"
#include "contrax/util/memory.h"

namespace {

namespace F = torch::nn::functional;
using contrax::CommunicatorPtr;

// Seed 000's gather: all-gather forward; backward all-reduces the whole
// gathered gradient and keeps this rank's rows (2(W-1)/W of it sent per rank).
struct AllReduceGather : torch::autograd::Function<AllReduceGather> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, CommunicatorPtr comm) {
    ctx->saved_data["rank"] = comm->rank();
    ctx->saved_data["rows"] = x.size(0);
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm.get());
    std::vector<int64_t> counts(comm->world_size(), x.size(0));
    return comm->all_gather_rows(x.detach(), counts, "all_gather");
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto* comm = reinterpret_cast<contrax::Communicator*>(ctx->saved_data["comm"].toInt());
    auto grad = g[0].contiguous();
    comm->all_reduce_sum(grad, "all_reduce");
    const int64_t b = ctx->saved_data["rows"].toInt();
    return {grad.narrow(0, ctx->saved_data["rank"].toInt() * b, b), torch::Tensor()};
  }
};

torch::Tensor ce_sum(const torch::Tensor& logits, int64_t offset) {
  auto labels = torch::arange(offset, offset + logits.size(0), logits.options().dtype(torch::kLong));
  return F::cross_entropy(logits, labels, F::CrossEntropyFuncOptions().reduction(torch::kSum));
}

torch::Tensor loss_global(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& ls,
                          const CommunicatorPtr& comm) {
  const int64_t W = comm->world_size(), r = comm->rank(), n = a.size(0);
  auto ga = contrax::gather_no_grad(a, comm).all, gb = contrax::gather_no_grad(b, comm).all;
  // Put the local (differentiable) rows back into their slot.
  std::vector<torch::Tensor> pa, pb;
  for (int64_t s = 0; s < W; ++s) {
    pa.push_back(s == r ? a : ga.narrow(0, s * n, n));
    pb.push_back(s == r ? b : gb.narrow(0, s * n, n));
  }
  auto A = torch::cat(pa), Bm = torch::cat(pb);
  auto logits = torch::mm(A * ls.exp().clamp_max(100.0), Bm.t());  // [B, B]
  auto labels = torch::arange(W * n, logits.options().dtype(torch::kLong));
  return (F::cross_entropy(logits, labels) + F::cross_entropy(logits.t(), labels)) * 0.5 * static_cast<double>(W);
}

torch::Tensor loss_allreduce(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& ls,
                             const CommunicatorPtr& comm) {
  const int64_t W = comm->world_size(), n = a.size(0), off = comm->rank() * n;
  auto all = AllReduceGather::apply(torch::cat({a, b}, 1), comm);
  const int64_t d = a.size(1);
  auto a_all = all.narrow(1, 0, d), b_all = all.narrow(1, d, d);
  auto s = ls.exp().clamp_max(100.0);
  auto total = (ce_sum(torch::mm(a * s, b_all.t()), off) + ce_sum(torch::mm(b * s, a_all.t()), off)) * 0.5;
  return total * (static_cast<double>(W) / static_cast<double>(W * n));
}


// The old algorithm's GEMMs and nothing else: symmetric CLIP computed
// a b_all^T and b a_all^T ([b x B], forward) and two GEMMs per product in
// backward; NT-Xent four [b x B] products (two per view) and eight backward.
// `kept`: the logits go into one buffer allocated before the clock starts (as
// contrax's kept workspace does), so no page of it is faulted in while timed.
torch::Tensor loss_floor(const torch::Tensor& a, const torch::Tensor& b, const CommunicatorPtr& comm,
                         int64_t products, torch::Tensor kept = {}) {
  torch::NoGradGuard no_grad;
  const int64_t W = comm->world_size();
  auto all = comm->all_gather_rows(b, std::vector<int64_t>(W, b.size(0)), "all_gather");  // [B, d]
  torch::Tensor acc = torch::zeros({}, a.options());
  for (int64_t p = 0; p < products; ++p) {
    auto logits = kept.defined() ? torch::mm_out(kept, a, all.t()) : torch::mm(a, all.t());  // forward [b, B]
    auto dq = torch::mm(logits, all);            // backward: dq
    auto dk = torch::mm(logits.t(), a);          // backward: dk
    acc += dq[0][0] + dk[0][0];
  }
  return acc;
}

struct Measure {
  std::vector<double> ms;
  int64_t bwd_bytes = 0, fwd_bytes = 0, peak = 0;
  torch::Tensor grad_a;
  double scale_grad = 0;
};

// The modes of --modes, checked.
std::vector<std::string> parse_modes(const std::string& modes_s, bool nt) {
  std::vector<std::string> modes;
  std::stringstream ss(modes_s);
  std::string m;
  while (std::getline(ss, m, ',')) {
    TORCH_CHECK(m == "floor" || m == "floor_kept" || m == "contrax" ||
                    (!nt && (m == "global" || m == "allreduce" || m == "matryoshka" || m == "matryoshka_loop")),
                "flag '--modes' takes ",
                nt ? "floor, floor_kept, contrax"
                   : "global, allreduce, contrax, floor, floor_kept, matryoshka, matryoshka_loop",
                "; got '", m, "'");
    modes.push_back(m);
  }
  return modes;
}

// Rank 0's table rows, appended to `out_path`: the slowest rank's median time
// (`tmax`), rank 0's bytes and memory (ranks are symmetric), the feature
// gradient's deviation and the rank-averaged scale gradient (`sgt`) per mode.
void append_rows(const std::string& out_path, const std::string& loss_name, int64_t W, int64_t batch,
                 const std::vector<std::string>& modes, std::map<std::string, Measure>& res, const torch::Tensor& tmax,
                 const torch::Tensor& sgt, std::map<std::string, double>& grad_err, bool on_gpu) {
  std::ofstream out(out_path, std::ios::app);
  const double base_ms = tmax[0].item<double>(), last_sg = sgt[modes.size() - 1].item<double>();
  const int64_t ar_bwd = res.count("allreduce") ? res["allreduce"].bwd_bytes : 0;
  auto cell = [](const char* format, double v) {
    char text[32];
    std::snprintf(text, sizeof text, format, v);
    return std::string(text);
  };
  for (size_t i = 0; i < modes.size(); ++i) {
    const auto& r = res[modes[i]];
    const std::string label = modes[i] == "global" ? "(a) global" : modes[i] == "allreduce" ? "(b) allreduce"
                            : modes[i] == "floor"      ? "(f) old GEMM floor"
                            : modes[i] == "floor_kept" ? "(f') old GEMM floor, buffer kept"
                            : modes[i] == "matryoshka" ? "(m) contrax, Matryoshka prefixes"
                            : modes[i] == "matryoshka_loop" ? "(m') a loop of contrax losses over the prefixes"
                                                       : "(c) contrax";
    char row[1024];
    std::snprintf(row, sizeof row, "| %s | %lld | %lld | %s | %.1f | %.2f | %.1f | %.1f | %s | %s | %s | %.1e | %.3f |\n",
                  loss_name.c_str(), static_cast<long long>(W), static_cast<long long>(batch), label.c_str(),
                  tmax[i].item<double>(), tmax[i].item<double>() / base_ms, r.fwd_bytes / 1048576.0,
                  r.bwd_bytes / 1048576.0,
                  ar_bwd > 0 ? cell("%.2f", static_cast<double>(r.bwd_bytes) / ar_bwd).c_str() : "-",
                  on_gpu ? "n/a" : cell("%.1f", r.peak / 1048576.0).c_str(),
                  on_gpu ? "n/a" : cell("%.3f", static_cast<double>(r.peak) / res[modes.front()].peak).c_str(),
                  grad_err[modes[i]], last_sg != 0 ? sgt[i].item<double>() / last_sg : 0.0);
    out << row;
  }
}

// (m'): one materialised clip_loss per prefix (and the full width) on its
// L2-normalised cut, summed: what a loss without prefixes needs a loop for.
torch::Tensor loss_prefix_loop(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& ls,
                               const CommunicatorPtr& comm, std::vector<int64_t> dims) {
  dims.push_back(a.size(1));
  torch::Tensor total;
  const auto o = contrax::ClipLossOptions().comm(comm).normalize(true).path(contrax::MemoryPath::kMaterialised);
  for (int64_t m : dims) {
    auto l = contrax::clip_loss(a.narrow(1, 0, m), b.narrow(1, 0, m), ls, c10::nullopt, o);
    total = total.defined() ? total + l : l;
  }
  return total;
}

int worker(const CommunicatorPtr& comm, int64_t batch, int64_t width, int64_t iters, const std::string& modes_s,
           const std::string& out_path, const std::string& loss_name, const std::vector<int64_t>& dims) {
  const bool nt = loss_name == "nt_xent";
  TORCH_CHECK(nt || loss_name == "clip", "flag '--loss' takes clip or nt_xent; got '", loss_name, "'");
  contrax::MemoryTracker::install();
  const int64_t W = comm->world_size();
  const auto modes = parse_modes(modes_s, nt);
  auto gen = at::detail::createCPUGenerator(1000 + comm->rank());
  const torch::Device device = comm->device();
  auto a0 = F::normalize(torch::randn({batch, width}, gen), F::NormalizeFuncOptions().dim(1)).to(device);
  auto b0 = F::normalize(torch::randn({batch, width}, gen), F::NormalizeFuncOptions().dim(1)).to(device);
  std::map<std::string, Measure> res;
  torch::Tensor kept;  // floor_kept's logits buffer, allocated and faulted in once
  if (std::find(modes.begin(), modes.end(), "floor_kept") != modes.end()) {
    kept = torch::zeros({batch, batch * W}, a0.options());
  }
  for (int64_t it = -1; it < iters; ++it) {  // it = -1 warms up
    for (const auto& m : modes) {
      auto a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      auto ls = torch::tensor(std::log(1 / 0.07), torch::kFloat).to(device).requires_grad_(true);
      comm->barrier();
      comm->reset_stats();
      int64_t fwd = 0;
      const auto t = contrax::cli::timed([&] {
        torch::Tensor loss = m == "global"      ? loss_global(a, b, ls, comm)
                             : m == "allreduce" ? loss_allreduce(a, b, ls, comm)
                             : m == "floor"     ? loss_floor(a, b, comm, nt ? 4 : 2)
                             : m == "floor_kept" ? loss_floor(a, b, comm, nt ? 4 : 2, kept)
                             : m == "matryoshka_loop" ? loss_prefix_loop(a, b, ls, comm, dims)
                             : m == "matryoshka"
                                 ? contrax::clip_loss(a, b, ls, c10::nullopt,
                                                      contrax::ClipLossOptions().comm(comm).matryoshka_dims(dims).path(
                                                          contrax::MemoryPath::kMaterialised))
                             : nt ? contrax::nt_xent_loss(
                                        a, b, contrax::NTXentLossOptions().comm(comm).path(contrax::MemoryPath::kMaterialised))
                                  : contrax::clip_loss(
                                        a, b, ls, c10::nullopt,
                                        contrax::ClipLossOptions().comm(comm).path(contrax::MemoryPath::kMaterialised));
        fwd = comm->stats().total_bytes_sent();
        if (loss.requires_grad()) loss.backward();
      }, device);
      auto& r = res[m];
      if (it >= 0) r.ms.push_back(t.seconds * 1e3);
      r.fwd_bytes = fwd;
      r.bwd_bytes = comm->stats().total_bytes_sent() - fwd;
      r.peak = std::max(r.peak, t.peak);
      r.grad_a = a.grad().defined() ? a.grad() : torch::zeros_like(a);
      r.scale_grad = ls.grad().defined() ? ls.grad().item<double>() : 0.0;
    }
  }
  // Feature gradients must agree across modes (they are the same gradient).
  std::map<std::string, double> grad_err;
  for (const auto& m : modes) {
    const auto& ref = res[modes.back()].grad_a;
    grad_err[m] = (res[m].grad_a - ref).abs().max().item<double>() / ref.abs().max().item<double>();
  }
  // Report the slowest rank's median time and rank 0's bytes/memory (ranks are symmetric).
  std::vector<double> med;
  for (const auto& m : modes) med.push_back(contrax::cli::median(res[m].ms));
  auto all = contrax::gather_no_grad(torch::tensor(med, torch::kDouble).unsqueeze(0), comm).all;  // [W, modes]
  const auto tmax = std::get<0>(all.max(0));
  // The scale's gradient as data-parallel training sees it: averaged over ranks.
  std::vector<double> sg;
  for (const auto& m : modes) sg.push_back(res[m].scale_grad);
  auto sgt = torch::tensor(sg, torch::kDouble);
  comm->all_reduce_sum(sgt);
  sgt = sgt / static_cast<double>(W);
  if (comm->rank() == 0) {
    append_rows(out_path, loss_name, W, batch, modes, res, tmax, sgt, grad_err, device.is_cuda());
  }
  return 0;
}

int run_bench(const std::vector<std::string>& args) {
  namespace cli = contrax::cli;
  CLI::App app{"benchmark the distributed losses against the all-gather baselines", "bench-losses"};
  cli::setup_app(app);
  std::string nprocs_s = "2,4", batches_s = "1024,4096", modes = "global,allreduce,contrax", out, loss_name = "clip",
              device = "cpu", matryoshka;
  int64_t width = 256, iters = 3, threads = 0;
  app.add_option("--nproc", nprocs_s, "comma-separated world sizes (each a separate launch)");
  app.add_option("--batch", batches_s, "comma-separated per-rank batch sizes");
  cli::add_int(app, "--width", width, "feature width", 1, int64_t{1} << 20);
  cli::add_int(app, "--iters", iters, "timed iterations per mode (after one warm-up)", 1, 100000);
  cli::add_int(app, "--threads", threads, "intra-op threads per rank (0: cores / W, at least 1)", 0, cli::max_procs());
  app.add_option("--modes", modes, "which of global, allreduce, contrax, floor, floor_kept");
  app.add_option("--out", out, "append the table rows to this file (default: stdout)");
  app.add_option("--loss", loss_name, "clip (symmetric) or nt_xent");
  app.add_option("--matryoshka", matryoshka,
                 "modes matryoshka and matryoshka_loop: the prefix widths, comma-separated (the full width is added)");
  cli::add_device(app, device,
                  "where each rank computes: cpu, or cuda (rank r on GPU LOCAL_RANK mod #GPUs, one GPU per rank, NCCL)");
  if (int st = cli::parse(app, args); st >= 0) return st;
  const auto nprocs = cli::parse_int_list("--nproc", nprocs_s, 1, cli::max_procs());
  const auto batches = cli::parse_int_list("--batch", batches_s, 1, int64_t{1} << 30);
  cli::usage_check(!nprocs.empty() && !batches.empty(), "flags '--nproc' and '--batch' must not be empty");
  const auto dims = matryoshka.empty() ? std::vector<int64_t>() : cli::parse_int_list("--matryoshka", matryoshka, 1,
                                                                                         width - 1);
  cli::usage_check(!dims.empty() || modes.find("matryoshka") == std::string::npos,
                   "modes matryoshka and matryoshka_loop need flag '--matryoshka' (the prefix widths)");
  cli::usage_check(loss_name == "clip" || loss_name == "nt_xent", "flag '--loss' must be clip or nt_xent, but got '",
                   loss_name, "'");
  if (device == "cuda") {
    cli::check_cuda_device(device, *std::max_element(nprocs.begin(), nprocs.end()),
                           "flag '--device' is 'cuda' (each rank on its own GPU, NCCL between them)");
  }

  if (contrax::in_launched_worker()) {
    int64_t W = std::stoll(std::getenv("WORLD_SIZE"));
    int64_t nt = threads > 0 ? threads : std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()) / W);
    at::set_num_threads(static_cast<int>(nt));
    // One communicator for the whole run: the rendezvous store lives as long as the process.
    auto comm = contrax::Communicator::from_env(contrax::CommunicatorOptions()
                                                    .timeout(std::chrono::minutes(10))
                                                    .device(device == "cuda" ? torch::kCUDA : torch::kCPU));
    for (int64_t b : batches) worker(comm, b, width, iters, modes, out, loss_name, dims);
    return 0;
  }
  std::string path = out.empty() ? "/tmp/contrax_bench_losses_" + std::to_string(::getpid()) + ".md" : out;
  std::cout << "BLAS: " << contrax::cli::blas_library() << "; cores: " << std::thread::hardware_concurrency() << "; fp32, width "
            << width << ", median of " << iters << " iterations (slowest rank)\n\n";
  std::cout << "| loss | W | batch/rank | mode | fwd+bwd ms | time vs first | fwd MiB sent/rank | bwd MiB sent/rank "
               "| bwd bytes vs (b) | peak MiB/rank | peak vs first | feature grad rel diff vs last "
               "| logit-scale grad (rank mean) vs last |\n";
  std::cout << "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n" << std::flush;
  int rc = 0;
  for (int64_t W : nprocs) {
    std::ofstream(path, std::ios::trunc).close();
    std::vector<std::string> argv{contrax::self_executable(), "bench-losses"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back("--out");
    argv.push_back(path);
    contrax::LaunchOptions lo;
    lo.nproc = W;
    auto r = contrax::launch(argv, lo);
    std::ifstream in(path);
    std::cout << in.rdbuf() << std::flush;
    if (r.exit_code != 0) {
      std::cerr << "contrax bench-losses: " << r.message << "\n";
      rc = r.exit_code;
    }
  }
  if (out.empty()) std::remove(path.c_str());
  return rc;
}

contrax::cli::Command bench_cmd("bench-losses",
                                "benchmark the CLIP loss: seed patterns (global logits, all-reduce backward) vs contrax",
                                run_bench);

}  // namespace
