// `contrax verify`: runs every distributed loss, and a gradient-cache training
// step (GradCache + DataParallel, materialised and ring CLIP loss), over N
// local processes on random fp64 inputs with uneven per-rank batches (one rank
// empty from N = 3 on) and compares the loss and every gradient with the
// single-device reference on the concatenated batch. Exits non-zero if any
// error exceeds the tolerance.
//
//   contrax verify --nproc 4            # table
//   contrax verify --nproc 2 --json     # one JSON object per case
//   contrax verify --case grad_cache_clip,grad_cache_tiled_ring
//   contrax verify --nproc 2 --device cuda   # every case on CUDA tensors (Gloo between the ranks)
//   contrax verify --nproc 2 --device cuda --backend nccl   # NCCL, one GPU per rank
#include <algorithm>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/machine.h"
#include "contrax/check/verify.h"
#include "contrax/comm/communicator.h"
#include "contrax/launch/launcher.h"
#include "cli/json_util.h"

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// The human-readable result: one row per case and the verdict.
void print_table(const std::vector<contrax::VerifyResult>& results, int64_t world, const std::string& dtype, double tol,
                 bool ok) {
  std::ostringstream rs;
  for (size_t i = 0; i < results.front().rows.size(); ++i) rs << (i ? "," : "") << results.front().rows[i];
  std::cout << "contrax verify: W=" << world << ", rows per rank [" << rs.str()
            << "], " << dtype << " on " << results.front().device << ", tolerance " << tol << "\n";
  int name_width = 14;
  for (const auto& r : results) name_width = std::max(name_width, static_cast<int>(r.loss.size()) + 2);
  std::cout << std::left << std::setw(name_width) << "case" << std::setw(14) << "loss rel err" << std::setw(14)
            << "max rel err" << std::setw(24) << "worst" << "result\n";
  for (const auto& r : results) {
    std::cout << std::left << std::setw(name_width) << r.loss << std::setw(14) << std::setprecision(3)
              << r.loss_rel_err << std::setw(14) << r.max_rel_err << std::setw(24) << r.worst
              << (r.passed ? "ok" : "FAIL") << "\n";
  }
  if (!ok) {
    std::cout << "MISMATCH: some distributed gradients differ from the single-device ones\n";
  } else if (dtype == "fp64") {
    std::cout << "all distributed gradients equal the single-device ones\n";
  } else {
    std::cout << "all distributed gradients are within " << dtype << "'s tolerance of the single-device fp64 ones\n";
  }
}

// What can be refused before any process starts: the backend and device
// flags against this machine, and the reference's memory.
void check_before_start(const std::string& device, const std::string& backend, int64_t nproc,
                        const std::vector<int64_t>& rows, const std::string& rows_s, int64_t width) {
  namespace cli = contrax::cli;
  cli::usage_check(backend != "nccl" || device == "cuda",
                   "flag '--backend' is 'nccl', which moves CUDA tensors only; use --device cuda, or --backend gloo");
  cli::check_cuda_device(device, nproc, backend == "nccl" ? "flag '--backend' is 'nccl'" : "",
                         "; use --backend gloo to share GPUs");

  if (!contrax::in_launched_worker()) {
    const auto r = rows.empty() ? contrax::default_row_counts(nproc) : rows;
    int64_t total = 0;
    for (auto n : r) total += n;
    cli::usage_check(total > 0, "flag '--rows' must give at least one rank a row, but got ", rows_s);
    const auto problem = contrax::verify_memory_problem(total, width, "flag '--rows'", "--width");
    cli::usage_check(problem.empty(), problem);
  }
}

// Re-runs this command as `nproc` local workers; only rank 0 prints, without
// prefixes so that --json output stays machine-readable.
int run_as_workers(const std::vector<std::string>& args, int64_t nproc) {
  std::vector<std::string> argv{contrax::self_executable(), "verify"};
  argv.insert(argv.end(), args.begin(), args.end());
  contrax::LaunchOptions lo;
  lo.nproc = nproc;
  lo.prefix_output = false;
  auto r = contrax::launch(argv, lo);
  if (r.exit_code != 0) std::cerr << "contrax verify: " << r.message << "\n";
  return r.exit_code;
}

int run_verify(const std::vector<std::string>& args) {
  namespace cli = contrax::cli;
  CLI::App app{"check every distributed loss and the gradient-cache step against the single-device reference",
               "verify"};
  cli::setup_app(app);
  const contrax::VerifyOptions defaults;
  int64_t nproc = 4, width = defaults.width(), seed = static_cast<int64_t>(defaults.seed()), timeout_s = 60;
  double tol = defaults.tolerance();
  bool json = false, force = false;
  std::string rows_s, cases, device = defaults.device().is_cuda() ? "cuda" : "cpu";
  cli::add_int(app, "--nproc", nproc, "local processes to verify over (ignored under a launcher)", 1);
  app.add_flag("--json", json, "print one JSON object per loss instead of a table");
  cli::add_double(app, "--tol", tol, "largest relative error that passes (>= 0)", 0);
  cli::add_int(app, "--width", width, "feature width", 1, 1 << 20);
  cli::add_int(app, "--seed", seed, "seed of the random inputs", 0);
  app.add_option("--rows", rows_s, "rows per rank, comma-separated (default: uneven, one empty rank)");
  app.add_option("--case", cases, "comma-separated cases to run (default: all)");
  cli::add_device(app, device,
                  "where each rank computes: cpu, or cuda (rank r on GPU r mod #GPUs; Gloo between the ranks, which "
                  "carries CUDA tensors through host memory, since NCCL refuses two ranks on one GPU)");
  std::string backend = "gloo";
  cli::add_choice(app, "--backend", backend,
                  "process group between the ranks: gloo (CPU or CUDA tensors, any number of ranks per GPU) or nccl "
                  "(--device cuda, one GPU per rank: --nproc at most the number of GPUs)",
                  {"gloo", "nccl"});
  std::string dtype = "fp64";
  cli::add_choice(app, "--dtype", dtype,
                  "dtype of the distributed run's features and model parameters (the inputs are rounded to it and the "
                  "fp64 reference gets the rounded values); --tol defaults to the dtype's: fp64 1e-10, fp32 1e-4, "
                  "fp16 1e-2, bf16 1e-1",
                  {"fp64", "fp32", "bf16", "fp16"});
  cli::add_int(app, "--timeout", timeout_s, "seconds any collective may wait for a peer", 1, 24 * 3600);
  cli::add_force(app, force);
  if (int st = cli::parse(app, args); st >= 0) return st;
  cli::check_procs("--nproc", nproc, force);
  const auto rows = cli::parse_int_list("--rows", rows_s, 0, int64_t{1} << 24);
  check_before_start(device, backend, nproc, rows, rows_s, width);
  if (!contrax::in_launched_worker() && nproc > 1) return run_as_workers(args, nproc);

  // Gloo by default: it carries CPU and CUDA tensors, and lets several ranks
  // share one GPU (the "auto" backend of a CUDA device would be NCCL). The
  // communicator binds rank r to GPU (local rank mod #GPUs).
  auto comm = contrax::Communicator::from_env(contrax::CommunicatorOptions()
                                                  .timeout(std::chrono::seconds(timeout_s))
                                                  .backend(backend)
                                                  .device(device == "cuda" ? torch::kCUDA : torch::kCPU));
  const auto dt = dtype == "fp32"   ? torch::kFloat
                  : dtype == "bf16" ? torch::kBFloat16
                  : dtype == "fp16" ? torch::kHalf
                                    : torch::kDouble;
  if (app.count("--tol") == 0) tol = contrax::default_tolerance(dt);
  contrax::VerifyOptions o;
  o.dtype(dt).tolerance(tol).width(width).seed(static_cast<uint64_t>(seed)).cases(split(cases, ','));
  o.device(comm->device());
  if (!rows.empty()) {
    cli::usage_check(static_cast<int64_t>(rows.size()) == comm->world_size(),
                     "flag '--rows' must have one entry per rank (", comm->world_size(), "), but got ", rows.size());
    o.rows(rows);
  }
  auto results = contrax::verify(comm, o);
  bool ok = true;
  for (const auto& r : results) ok = ok && r.passed;
  if (comm->rank() == 0) {
    if (json) {
      for (const auto& r : results) std::cout << cli::verify_json(r).dump() << "\n";
    } else {
      print_table(results, comm->world_size(), dtype, tol, ok);
    }
    std::cout.flush();
  }
  return ok ? 0 : 1;
}

contrax::cli::Command verify_cmd("verify",
                                 "check every distributed loss and the gradient-cache step against the single-device "
                                 "reference",
                                 run_verify);

}  // namespace
