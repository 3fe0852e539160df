// `contrax train`: distributed SimCLR / MoCo v3 on Fashion-MNIST, then the
// evaluation table (trained encoder vs random-init encoder vs raw pixels) and
// `contrax verify`'s exactness line.
//
//   contrax train                                  # defaults: 2 processes, SimCLR, 8 epochs
//   contrax train --recipe moco-v3 --nproc 2 --epochs 3 --run-dir runs/moco
//   contrax train --run-dir runs/a --resume        # continue a stopped run
//   contrax train --max-steps 20 --train-limit 2048 --json
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include "cli.h"
#include "contrax/communicator.h"
#include "contrax/launcher.h"
#include "contrax/train/augment.h"
#include "contrax/train/eval.h"
#include "contrax/train/idx.h"
#include "contrax/train/trainer.h"
#include "contrax/verify.h"

namespace {

volatile std::sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

std::string json_number(double v) {
  std::ostringstream o;
  o << std::setprecision(6) << v;
  return o.str();
}

int run_train(const std::vector<std::string>& args) {
  contrax::cli::Args a("train", args);
  const std::string recipe = a.get("recipe", "simclr", "simclr or moco-v3");
  const int64_t nproc = a.get_int("nproc", 2, "local processes (ignored under a launcher)");
  const std::string data_dir = a.get("data", contrax::train::kDefaultDataDir, "directory of the MNIST-format IDX files");
  const int64_t epochs = a.get_int("epochs", 8, "epochs over the training subset (unless --max-steps)");
  const int64_t max_steps = a.get_int("max-steps", -1, "> 0: train exactly this many steps (the schedule's length)");
  const int64_t batch = a.get_int("batch-size", 256, "global batch size (all processes together)");
  const int64_t chunk = a.get_int("chunk-size", 0, "> 0: gradient cache with chunks of this many rows");
  const double lr = a.get_double("lr", 2e-3, "peak learning rate of AdamW");
  const double wd = a.get_double("weight-decay", 1e-4, "AdamW weight decay");
  const int64_t warmup = a.get_int("warmup-steps", 20, "linear warm-up steps before the cosine decay");
  const double temperature = a.get_double("temperature", 0.2, "temperature of NT-Xent / MoCo v3");
  const double moco_m = a.get_double("moco-momentum", 0.99, "MoCo v3 base momentum (cosine to 1)");
  const int64_t seed = a.get_int("seed", 0, "seed of the model, the data order and the augmentations");
  const std::string run_dir = a.get("run-dir", "runs/" + recipe, "directory for metrics.jsonl and checkpoint.pt");
  const int64_t ckpt_every = a.get_int("checkpoint-every", 200, "checkpoint every K steps (0: only at the end)");
  const bool resume = a.flag("resume", "continue from run-dir/checkpoint.pt");
  const bool json = a.flag("json", "print the summary as one JSON object");
  const int64_t train_limit = a.get_int("train-limit", -1, "train on the first N training examples (-1: all)");
  const int64_t eval_limit = a.get_int(
      "eval-limit", -1, "evaluate with the first N train (kNN memory bank) and N test examples (-1: all)");
  const int64_t probe_limit =
      a.get_int("probe-limit", 10000, "fit the linear probe on the first N of those train examples (-1: all)");
  const int64_t threads = a.get_int("threads", 0, "intra-op threads per process (0: cores / processes)");
  const std::string dtype_s = a.get("dtype", "float", "float or double (exactness tests)");
  const int64_t log_every = a.get_int("log-every", 10, "progress line every N steps (0: none)");
  const int64_t stop_at = a.get_int("stop-at-step", -1, ">= 0: stop with a checkpoint at this step (tests)");
  const bool no_eval = a.flag("no-eval", "skip the evaluation");
  const bool no_verify = a.flag("no-verify", "skip the exactness check after training");
  const int64_t timeout_s = a.get_int("timeout", 300, "seconds any collective may wait for a peer");
  if (a.finish()) return 0;

  TORCH_CHECK(recipe == "simclr" || recipe == "moco-v3", "flag '--recipe' must be simclr or moco-v3, but got '",
              recipe, "'");
  TORCH_CHECK(nproc >= 1, "flag '--nproc' must be >= 1, but got ", nproc);
  TORCH_CHECK(batch >= 1, "flag '--batch-size' must be >= 1, but got ", batch);
  TORCH_CHECK(chunk >= 0, "flag '--chunk-size' must be >= 0, but got ", chunk);
  TORCH_CHECK(epochs >= 1 || max_steps > 0, "flag '--epochs' must be >= 1, but got ", epochs);
  TORCH_CHECK(lr > 0, "flag '--lr' must be > 0, but got ", lr);
  TORCH_CHECK(temperature > 0, "flag '--temperature' must be > 0, but got ", temperature);
  TORCH_CHECK(warmup >= 0, "flag '--warmup-steps' must be >= 0, but got ", warmup);
  TORCH_CHECK(ckpt_every >= 0, "flag '--checkpoint-every' must be >= 0, but got ", ckpt_every);
  TORCH_CHECK(threads >= 0, "flag '--threads' must be >= 0, but got ", threads);
  TORCH_CHECK(eval_limit == -1 || eval_limit >= 1, "flag '--eval-limit' must be -1 (all) or >= 1, but got ",
              eval_limit);
  TORCH_CHECK(probe_limit == -1 || probe_limit >= 1, "flag '--probe-limit' must be -1 (all) or >= 1, but got ",
              probe_limit);
  TORCH_CHECK(dtype_s == "float" || dtype_s == "double", "flag '--dtype' must be float or double, but got '", dtype_s,
              "'");
  TORCH_CHECK(!run_dir.empty(), "flag '--run-dir' must not be empty");
  TORCH_CHECK(seed >= 0, "flag '--seed' must be >= 0, but got ", seed);

  if (!contrax::in_launched_worker() && nproc > 1) {
    std::vector<std::string> argv{contrax::self_executable(), "train"};
    argv.insert(argv.end(), args.begin(), args.end());
    contrax::LaunchOptions lo;
    lo.nproc = nproc;
    lo.prefix_output = false;
    lo.grace = std::chrono::seconds(60);  // time to finish a step and write the checkpoint
    auto r = contrax::launch(argv, lo);
    if (r.exit_code != 0) std::cerr << "contrax train: " << r.message << "\n";
    return r.exit_code;
  }

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  const auto wall0 = std::chrono::steady_clock::now();
  auto comm = contrax::Communicator::from_env(
      contrax::CommunicatorOptions().timeout(std::chrono::seconds(timeout_s)));
  const int64_t world = comm->world_size(), rank = comm->rank();
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  at::set_num_threads(threads > 0 ? threads : std::max<int64_t>(1, cores / world));

  auto train_data = contrax::train::load_dataset(data_dir, "train", train_limit);
  auto opts = contrax::train::TrainOptions()
                  .recipe(recipe)
                  .epochs(epochs)
                  .max_steps(max_steps)
                  .stop_at_step(stop_at)
                  .batch_size(batch)
                  .chunk_size(chunk)
                  .lr(lr)
                  .weight_decay(wd)
                  .warmup_steps(warmup)
                  .temperature(temperature)
                  .moco_momentum(moco_m)
                  .seed(static_cast<uint64_t>(seed))
                  .dtype(dtype_s == "double" ? torch::kDouble : torch::kFloat)
                  .run_dir(run_dir)
                  .checkpoint_every(ckpt_every)
                  .resume(resume)
                  .log_every(log_every)
                  .progress_to_stderr(json)
                  .stop_requested([] { return g_signal != 0; });
  if (rank == 0) {
    std::ostream& os = json ? std::cerr : std::cout;
    os << "contrax train: " << recipe << " on " << train_data.size() << " examples of " << data_dir << ", "
       << world << " process" << (world > 1 ? "es" : "") << " x " << at::get_num_threads() << " thread"
       << (at::get_num_threads() > 1 ? "s" : "") << ", global batch " << batch
       << (chunk > 0 ? ", gradient cache chunks of " + std::to_string(chunk) : std::string()) << ", run dir "
       << run_dir << (resume ? " (resuming)" : "") << "\n"
       << std::flush;
  }
  auto r = contrax::train::train_contrastive(comm, train_data, opts);

  if (r.interrupted) {
    if (rank == 0) {
      std::cerr << "contrax train: stopped at step " << r.steps << "/" << r.total_steps << "; checkpoint "
                << contrax::train::checkpoint_path(run_dir) << " written; continue with --resume\n";
    }
    if (g_signal != 0) return contrax::in_launched_worker() ? 0 : 128 + static_cast<int>(g_signal);
    return 0;
  }

  std::string verdict;
  if (!no_verify) {
    auto results = contrax::verify(comm);
    double worst = 0;
    bool ok = true;
    for (const auto& v : results) {
      worst = std::max(worst, v.max_rel_err);
      ok = ok && v.passed;
    }
    std::ostringstream vs;
    vs << (ok ? "distributed gradients equal single-device" : "MISMATCH: distributed gradients differ from single-device")
       << ": max rel err " << std::setprecision(3) << worst << " over " << results.size() << " cases (W=" << world
       << ")";
    verdict = vs.str();
  }

  // Evaluation on rank 0, after the last collective: the other ranks are done
  // and exit, so a slow evaluation can never time out a peer that waits for it
  // (a barrier here failed after its 300 s timeout when a loaded machine slowed
  // the evaluation down). It keeps the training's thread count rather than
  // taking the idle ranks' cores: on a shared 2-core machine two OpenMP threads
  // made the many small L-BFGS steps of the probe many times slower (threads
  // spinning against other processes).
  contrax::train::EvalResult trained, random_init, raw;
  if (!no_eval && rank == 0) {
    auto eval_train = contrax::train::load_dataset(data_dir, "train", eval_limit);
    auto eval_test = contrax::train::load_dataset(data_dir, "test", eval_limit);
    auto enc = r.encoder;
    enc->to(torch::kFloat);
    // One protocol for all three representations, so that they compare.
    const auto eopts = contrax::train::EvalOptions().probe_train_limit(probe_limit);
    trained = contrax::train::evaluate_encoder(enc, eval_train, eval_test, eopts);
    random_init = contrax::train::evaluate_random_init(enc->options, static_cast<uint64_t>(seed) + 1000003,
                                                        eval_train, eval_test, eopts);
    raw = contrax::train::evaluate_raw_pixels(eval_train, eval_test, eopts);
    if (!json) {
      const int64_t n_probe = probe_limit > 0 ? std::min(probe_limit, eval_train.size()) : eval_train.size();
      std::cout << "\nevaluation of frozen features on " << eval_test.size()
                << " test images (backbone output, not the projection head):\n"
                << "  linear probe: logistic regression (L-BFGS to convergence) on standardised features of "
                << n_probe << " train images, L2 chosen on " << eopts.probe().val_fraction() * 100 << "% of them\n"
                << "  kNN: cosine similarity to " << eval_train.size() << " train images, " << eopts.knn().k()
                << " neighbours voting with weight exp(sim / " << eopts.knn().temperature() << ")\n";
      std::cout << std::left << std::setw(22) << "representation" << std::setw(20) << "linear probe acc"
                << std::setw(16) << "kNN acc (k=" + std::to_string(eopts.knn().k()) + ")" << "probe L2\n";
      auto row = [](const std::string& name, const contrax::train::EvalResult& e) {
        std::cout << std::left << std::setw(22) << name << std::setw(20) << std::fixed << std::setprecision(4)
                  << e.linear_probe_acc << std::setw(16) << e.knn_acc << std::scientific << std::setprecision(0)
                  << e.probe.l2 << (e.probe.converged ? "" : " (probe not converged)") << std::fixed << "\n";
      };
      row("trained encoder", trained);
      row("random-init encoder", random_init);
      row("raw pixels", raw);
      std::cout.flush();
    }
  }

  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  if (rank == 0) {
    if (json) {
      std::ostringstream j;
      j << "{\"recipe\":\"" << recipe << "\",\"world_size\":" << world << ",\"steps\":" << r.steps
        << ",\"epochs\":" << r.epochs_done << ",\"batch_size\":" << batch << ",\"chunk_size\":" << chunk
        << ",\"final_loss\":" << json_number(r.losses.empty() ? 0.0 : r.losses.back());
      if (!no_eval) {
        j << ",\"linear_probe_acc\":" << json_number(trained.linear_probe_acc)
          << ",\"knn_acc\":" << json_number(trained.knn_acc)
          << ",\"random_init_linear_probe_acc\":" << json_number(random_init.linear_probe_acc)
          << ",\"random_init_knn_acc\":" << json_number(random_init.knn_acc)
          << ",\"raw_pixel_linear_probe_acc\":" << json_number(raw.linear_probe_acc)
          << ",\"raw_pixel_knn_acc\":" << json_number(raw.knn_acc)
          << ",\"linear_probe_l2\":" << json_number(trained.probe.l2)
          << ",\"random_init_linear_probe_l2\":" << json_number(random_init.probe.l2)
          << ",\"raw_pixel_linear_probe_l2\":" << json_number(raw.probe.l2)
          << ",\"eval_s\":" << json_number(trained.seconds + random_init.seconds + raw.seconds);
      }
      j << ",\"examples_per_s\":" << json_number(r.examples_per_s) << ",\"train_s\":" << json_number(r.train_s)
        << ",\"wall_s\":" << json_number(wall);
      if (!verdict.empty()) j << ",\"verify\":\"" << verdict << "\"";
      j << "}";
      std::cout << j.str() << "\n";
    } else {
      std::cout << "trained " << r.steps << " steps (" << r.epochs_done << " epoch" << (r.epochs_done == 1 ? "" : "s")
                << ") in " << std::fixed << std::setprecision(1) << r.train_s << " s, " << std::setprecision(0)
                << r.examples_per_s << " examples/s; " << std::setprecision(1);
      if (!no_eval) {
        std::cout << "evaluated in " << trained.seconds + random_init.seconds + raw.seconds << " s; ";
      }
      std::cout << "wall " << wall << " s\n";
      if (!verdict.empty()) std::cout << verdict << "\n";
    }
    std::cout.flush();
  }
  return 0;
}

contrax::cli::Command train_cmd("train", "train SimCLR or MoCo v3 on Fashion-MNIST over N processes, then evaluate",
                                run_train);

}  // namespace
