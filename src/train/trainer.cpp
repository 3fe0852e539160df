#include "contrax/train/trainer.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>

#include "contrax/data_parallel.h"
#include "contrax/failure.h"
#include "contrax/grad_cache.h"
#include "contrax/losses.h"
#include "contrax/train/augment.h"
#include "contrax/train/checkpoint.h"
#include "contrax/train/metrics.h"
#include "contrax/train/sampler.h"
#include "contrax/train/schedule.h"

namespace contrax {
namespace train {

namespace {

// How --dtype spells the training dtype (stored in checkpoints).
std::string dtype_name(torch::Dtype d) { return d == torch::kDouble ? "double" : "float"; }

using Clock = std::chrono::steady_clock;

// Longest schedule accepted: far beyond any real run, far below where step
// counters, the sampler's epoch arithmetic or ETA would overflow.
constexpr int64_t kMaxTotalSteps = int64_t{1} << 40;

void make_dirs(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec, "cannot create run directory '", dir, "/': ", ec.message());
}

std::string fmt_duration(double s) {
  if (!(s >= 0) || s > 1e7) return "?";
  int64_t t = static_cast<int64_t>(s + 0.5);
  std::ostringstream o;
  if (t >= 3600) o << t / 3600 << "h";
  if (t >= 60) o << std::setw(t >= 3600 ? 2 : 1) << std::setfill('0') << (t / 60) % 60 << "m";
  o << std::setw(t >= 60 ? 2 : 1) << std::setfill('0') << t % 60 << "s";
  return o.str();
}

void validate(const TrainOptions& o, const Dataset& data) {
  TORCH_CHECK(o.recipe() == "simclr" || o.recipe() == "moco-v3", "recipe must be 'simclr' or 'moco-v3', but got '",
              o.recipe(), "'");
  TORCH_CHECK(o.batch_size() >= 1, "batch size must be >= 1, but got ", o.batch_size());
  TORCH_CHECK(o.chunk_size() >= 0, "chunk size must be >= 0, but got ", o.chunk_size());
  TORCH_CHECK(o.dtype() == torch::kFloat || o.dtype() == torch::kDouble, "dtype must be float or double");
  TORCH_CHECK(o.skip_nonfinite() >= 0, "skip_nonfinite must be >= 0, but got ", o.skip_nonfinite());
  TORCH_CHECK(data.size() > 0, "the training set is empty");
  TORCH_CHECK(!o.resume() || !o.run_dir().empty(), "resuming needs a run directory");
}

// The model of a recipe, built identically on every rank from the seed.
struct Model {
  SimCLRModel simclr{nullptr};
  MocoV3Model moco{nullptr};
  std::shared_ptr<torch::nn::Module> module;
  std::vector<torch::Tensor> trainable;
};

Model build_model(const TrainOptions& o) {
  // The lock makes the seeded construction safe when ranks are threads of one
  // process (tests): they would otherwise interleave draws from the global
  // generator and build different models. DataParallel also broadcasts rank
  // 0's values, but the optimizer state must match from the start.
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> init_lock(init_mutex);
  torch::manual_seed(o.seed());
  auto mopts = o.model();
  mopts.encoder().dropout(0.0);
  Model m;
  if (o.recipe() == "moco-v3") {
    m.moco = MocoV3Model(mopts);
    m.moco->to(o.dtype());
    m.module = m.moco.ptr();
    m.trainable = m.moco->trainable_parameters();
  } else {
    m.simclr = SimCLRModel(mopts);
    m.simclr->to(o.dtype());
    m.module = m.simclr.ptr();
    m.trainable = m.simclr->parameters();
  }
  m.module->train();
  return m;
}

// Checks that a checkpoint belongs to this run before loading it: the run's
// settings first (a checkpoint with nothing registered reads only its
// scalars), so that a MoCo checkpoint resumed as SimCLR is told so, not that
// its modules do not match.
void check_resumable(const std::string& file, const TrainOptions& o, int64_t dataset_size, int64_t total,
                     int64_t world) {
  Checkpoint saved;
  saved.load(file);
  TORCH_CHECK(saved.strings["recipe"] == o.recipe(), "checkpoint ", file, " is of recipe '", saved.strings["recipe"],
              "', not '", o.recipe(), "'");
  TORCH_CHECK(saved.ints["batch_size"] == o.batch_size() && saved.ints["seed"] == static_cast<int64_t>(o.seed()) &&
                  saved.ints["dataset_size"] == dataset_size && saved.ints["total_steps"] == total,
              "checkpoint ", file, " was written by a run with batch size ", saved.ints["batch_size"], ", seed ",
              saved.ints["seed"], ", ", saved.ints["dataset_size"], " examples, ", saved.ints["total_steps"],
              " steps; this run has ", o.batch_size(), ", ", o.seed(), ", ", dataset_size, ", ", total,
              " (resume with the same flags)");
  // Older checkpoints carry no dtype string; Checkpoint::load still refuses
  // a dtype change by comparing the tensors themselves.
  const std::string want_dtype = dtype_name(o.dtype());
  TORCH_CHECK(saved.strings.count("dtype") == 0 || saved.strings["dtype"] == want_dtype, "checkpoint ", file,
              " was written with --dtype ", saved.strings["dtype"], "; this run has --dtype ", want_dtype,
              " (resume with the same flags)");
  TORCH_CHECK(saved.ints.count("world_size") == 0 || saved.ints["world_size"] == world, "checkpoint ", file,
              " was written by a run of ", saved.ints["world_size"], " processes; this run has ", world,
              " (resume with the same number of processes)");
}

// The DataParallel reducer waits on its gradient all-reduce inside backward,
// outside the Communicator's own calls: named so its failures are not raw Gloo.
constexpr const char* kReducerOp = "gradient all_reduce (DataParallel, in backward)";

// One training step of a recipe on this rank's two views [b, C, H, W]:
// forward, loss and backward (gradients averaged over ranks by the
// DataParallel reducer); returns this rank's loss L_r. The optimizer step is
// the caller's, so that a non-finite step can be refused before it is applied.
using StepFn = std::function<torch::Tensor(const torch::Tensor& v1, const torch::Tensor& v2)>;

StepFn simclr_step(const Model& m, const std::shared_ptr<DataParallel>& dp, const CommunicatorPtr& comm,
                   const TrainOptions& o) {
  const auto lopts = NTXentLossOptions().temperature(o.temperature()).comm(comm);
  if (o.chunk_size() > 0) {
    auto gc = std::make_shared<GradCache>(
        std::vector<GradCacheEncoder>{GradCacheEncoder(m.simclr, o.chunk_size()).data_parallel(dp).name("view1"),
                                      GradCacheEncoder(m.simclr, o.chunk_size()).data_parallel(dp).name("view2")},
        [lopts](const std::vector<torch::Tensor>& r) { return nt_xent_loss(r[0], r[1], lopts); });
    return [gc, comm](const torch::Tensor& v1, const torch::Tensor& v2) {
      torch::Tensor loss;
      with_collective_context(*comm, kReducerOp, [&] { loss = gc->step({v1, v2}); });
      return loss;
    };
  }
  auto model = m.simclr;
  return [model, dp, lopts, comm](const torch::Tensor& v1, const torch::Tensor& v2) mutable {
    const int64_t b = v1.size(0);
    auto z = dp->forward([&] { return model->forward(torch::cat({v1, v2})); });  // [2b, proj_dim]
    auto loss = nt_xent_loss(z.narrow(0, 0, b), z.narrow(0, b, b), lopts);
    with_collective_context(*comm, kReducerOp, [&] { loss.backward(); });
    return loss;
  };
}

StepFn moco_step(const Model& m, const std::shared_ptr<DataParallel>& dp, const CommunicatorPtr& comm,
                 const TrainOptions& o) {
  const auto lopts = MocoV3LossOptions().temperature(o.temperature()).comm(comm);
  auto model = m.moco;
  std::shared_ptr<GradCache> gc;
  if (o.chunk_size() > 0) {
    EncoderFn q = [model](const BatchInput& x) mutable -> c10::IValue { return c10::IValue(model->query(x.tensor())); };
    gc = std::make_shared<GradCache>(
        std::vector<GradCacheEncoder>{GradCacheEncoder(q, o.chunk_size()).data_parallel(dp).name("view1"),
                                      GradCacheEncoder(q, o.chunk_size()).data_parallel(dp).name("view2")},
        [](const std::vector<torch::Tensor>&) -> torch::Tensor {
          // Never called: the MoCo step hands its loss (which needs the
          // step's keys) to GradCache::finish directly.
          TORCH_INTERNAL_ASSERT(false, "MoCo v3 passes its loss to GradCache::finish");
        });
  }
  return [model, dp, lopts, gc, comm](const torch::Tensor& v1, const torch::Tensor& v2) mutable {
    const int64_t b = v1.size(0);
    torch::Tensor k1, k2;  // [b, dim] keys of the momentum encoder, no gradient
    {
      torch::NoGradGuard ng;
      auto k = model->key(torch::cat({v1, v2}));
      k1 = k.narrow(0, 0, b);
      k2 = k.narrow(0, b, b);
    }
    if (gc) {
      gc->cache(size_t{0}, v1);
      gc->cache(size_t{1}, v2);
      torch::Tensor loss;
      with_collective_context(*comm, kReducerOp, [&] {
        loss = gc->finish([&](const std::vector<torch::Tensor>& r) { return moco_v3_loss(r[0], r[1], k1, k2, lopts); });
      });
      return loss;
    }
    auto q = dp->forward([&] { return model->query(torch::cat({v1, v2})); });  // [2b, dim]
    auto loss = moco_v3_loss(q.narrow(0, 0, b), q.narrow(0, b, b), k1, k2, lopts);
    with_collective_context(*comm, kReducerOp, [&] { loss.backward(); });
    return loss;
  };
}

// The sum of every gradient entry of `params`, in fp64: finite exactly when no
// gradient holds a NaN or infinity (up to an overflow of the sum, which is a
// divergence too). One reduction per parameter and no host sync here; the
// caller reads it together with the loss after their all-reduce.
torch::Tensor gradient_sum(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> sums;
  for (const auto& p : params) {
    if (p.grad().defined()) sums.push_back(p.grad().sum(torch::kDouble));
  }
  return sums.empty() ? torch::zeros({}, torch::kDouble) : torch::stack(sums).sum();
}

// A testing aid (docs/reliability.md): CONTRAX_FAULT_EXIT_AT_STEP=<step>[:<rank>]
// makes rank <rank> (default 0) fail just before it runs step <step> (counted
// from 1, as on the console), in a launcher's first attempt only
// (TORCHELASTIC_RESTART_COUNT unset or 0): a restart test sees one failure,
// then a clean run. The failure is an error, so the process exits non-zero
// without writing a checkpoint, as a crash would.
struct Fault {
  int64_t step = -1;  // -1: none
  int64_t rank = 0;
  std::string spec;
};

Fault fault_from_env() {
  const char* v = std::getenv("CONTRAX_FAULT_EXIT_AT_STEP");
  Fault f;
  if (v == nullptr || *v == '\0') return f;
  f.spec = v;
  char* end = nullptr;
  errno = 0;
  const long long step = std::strtoll(v, &end, 10);
  long long rank = 0;
  bool ok = end != v && errno == 0 && step >= 1;
  if (ok && *end == ':') {
    const char* r = end + 1;
    rank = std::strtoll(r, &end, 10);
    ok = end != r && errno == 0 && rank >= 0;
  }
  TORCH_CHECK(ok && *end == '\0', "environment variable 'CONTRAX_FAULT_EXIT_AT_STEP' must be <step>[:<rank>] with ",
              "step >= 1 and rank >= 0, but got '", v, "'");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (restart != nullptr && *restart != '\0' && std::string(restart) != "0") return f;  // a restart: no fault
  f.step = step;
  f.rank = rank;
  return f;
}

}  // namespace

std::string checkpoint_path(const std::string& run_dir) { return run_dir + "/checkpoint.pt"; }

std::string metrics_path(const std::string& run_dir) { return run_dir + "/metrics.jsonl"; }

int64_t total_steps(const TrainOptions& o, int64_t dataset_size) {
  if (o.max_steps() > 0) {
    TORCH_CHECK(o.max_steps() <= kMaxTotalSteps, "max_steps must be <= 2^40, but got ", o.max_steps());
    return o.max_steps();
  }
  TORCH_CHECK(o.batch_size() >= 1, "batch size must be >= 1, but got ", o.batch_size());
  // (Not (n + b - 1) / b: that overflows for a batch size near 2^63.)
  const int64_t per_epoch = dataset_size / o.batch_size() + (dataset_size % o.batch_size() != 0);
  const int64_t epochs = std::max<int64_t>(1, o.epochs());
  TORCH_CHECK(epochs <= kMaxTotalSteps / std::max<int64_t>(1, per_epoch), "epochs x steps per epoch (", epochs,
              " x ", per_epoch, ") must be <= 2^40 steps");
  return epochs * per_epoch;
}

TrainResult train_contrastive(const CommunicatorPtr& comm_in, const Dataset& data, const TrainOptions& o) {
  CommunicatorPtr comm = comm_in ? comm_in : Communicator::single();
  const int64_t rank = comm->rank(), world = comm->world_size();
  validate(o, data);
  const bool moco = o.recipe() == "moco-v3";

  const int64_t total = total_steps(o, data.size());
  ShardedSampler sampler(data.size(),
                         ShardedSamplerOptions().global_batch_size(o.batch_size()).world_size(world).seed(o.seed()));
  const int64_t steps_per_epoch = sampler.steps_per_epoch();
  // A last global batch with fewer rows than ranks is trained on, not refused:
  // a rank whose slice is empty still runs every collective of the step (the
  // loss's row-count exchange and gathers, MoCo's key gather, the reducer's
  // all-reduce of its all-zero gradients, the loss all-reduce below) and
  // contributes L_r = (W/B) * (empty sum) = 0, which is exactly its share.

  Model model = build_model(o);
  torch::optim::AdamW optimizer(model.trainable, torch::optim::AdamWOptions(o.lr()).weight_decay(o.weight_decay()));
  const auto sched =
      WarmupCosineOptions().base_lr(o.lr()).warmup_steps(std::min(o.warmup_steps(), total)).total_steps(total);

  Checkpoint ckpt;
  ckpt.module("model", *model.module)
      .optimizer("adamw", optimizer)
      .generator("cpu", at::detail::getDefaultCPUGenerator());
  int64_t start = 0;
  const std::string ckpt_file = o.run_dir().empty() ? "" : checkpoint_path(o.run_dir());
  if (o.resume()) {
    check_resumable(ckpt_file, o, data.size(), total, world);
    ckpt.load(ckpt_file);
    start = ckpt.ints["step"];
  }
  auto save = [&](int64_t step) {
    if (ckpt_file.empty() || rank != 0) return;
    const auto pos = sampler.position(step);
    ckpt.ints = {{"step", step},
                 {"epoch", pos.epoch},
                 {"step_in_epoch", pos.step},
                 {"batch_size", o.batch_size()},
                 {"seed", static_cast<int64_t>(o.seed())},
                 {"dataset_size", data.size()},
                 {"total_steps", total},
                 {"world_size", world}};
    ckpt.strings = {{"recipe", o.recipe()}, {"dtype", dtype_name(o.dtype())}};
    ckpt.doubles = {{"lr", o.lr()}, {"temperature", o.temperature()}};
    std::ostringstream meta;
    meta << "{\"recipe\":\"" << o.recipe() << "\",\"step\":" << step << ",\"total_steps\":" << total << "}";
    ckpt.metadata = meta.str();
    ckpt.save(ckpt_file);
  };

  auto dp = std::make_shared<DataParallel>(model.module, comm);
  const StepFn train_step = moco ? moco_step(model, dp, comm, o) : simclr_step(model, dp, comm, o);

  std::unique_ptr<MetricsWriter> metrics;
  if (rank == 0 && !o.run_dir().empty()) {
    make_dirs(o.run_dir());
    metrics = std::make_unique<MetricsWriter>(metrics_path(o.run_dir()), o.resume() ? start : -1);
  }
  auto log = [&](const std::string& line) {
    if (o.log()) {
      o.log()(line);
    } else {
      (o.progress_to_stderr() ? std::cerr : std::cout) << line << std::flush;
    }
  };

  AugmentOptions aopts = o.augment();
  aopts.dtype(o.dtype());
  const Fault fault = fault_from_env();
  TrainResult result;
  result.start_step = start;
  result.total_steps = total;
  const auto t0 = Clock::now();
  const int64_t bytes0 = comm->stats().total_bytes_sent();
  int64_t step = start, examples = 0;
  // A failed write of the metrics or the log (a full disk) stops the run at
  // the next step boundary, with a checkpoint while one can still be written,
  // then reports the cause: never a run that silently loses its record.
  std::string write_error;
  auto checked = [&](const std::function<void()>& write) {
    if (!write_error.empty()) return;
    try {
      write();
    } catch (const std::exception& e) {
      const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
      write_error = ce != nullptr ? ce->what_without_backtrace() : e.what();
      // Said at once, straight to stderr (the log may be what failed).
      std::cerr << "contrax train: " << write_error << "; stopping at the next step boundary\n" << std::flush;
    }
  };
  for (; step < total; ++step) {
    // Agree on stopping at the step boundary: any rank's request stops all.
    const bool want_stop = (o.stop_requested() && o.stop_requested()()) ||
                           (o.stop_at_step() >= 0 && step >= o.stop_at_step()) || !write_error.empty();
    auto flag = torch::full({1}, want_stop ? 1.0 : 0.0, torch::kDouble);
    comm->all_reduce_sum(flag, "stop_flag");
    if (flag.item<double>() > 0) {
      result.interrupted = true;
      break;
    }
    TORCH_CHECK(fault.step != step + 1 || fault.rank != rank, "rank ", rank, " failed before step ", step + 1,
                " as asked by CONTRAX_FAULT_EXIT_AT_STEP=", fault.spec, " (a testing aid; unset it to train)");
    const int64_t step_bytes0 = comm->stats().total_bytes_sent();
    const auto pos = sampler.position(step);
    const auto idx = sampler.local_indices(pos.epoch, pos.step, rank);
    const auto x = data.images.index_select(0, idx);
    const auto v1 = augment(x, idx, AugmentKey{o.seed(), pos.epoch, pos.step, 0}, aopts);
    const auto v2 = augment(x, idx, AugmentKey{o.seed(), pos.epoch, pos.step, 1}, aopts);
    const double lr = warmup_cosine_lr(step, sched);
    set_learning_rate(optimizer, lr);
    optimizer.zero_grad();
    const torch::Tensor loss = train_step(v1, v2);

    // The global loss and whether any rank's gradient is non-finite, in the
    // one all-reduce the step already had: decided before the update, so a
    // diverged step never reaches the parameters or a checkpoint.
    // (The gradients are averaged over ranks already, so every rank sees the
    // same ones; summing them too keeps the decision on identical numbers.)
    auto lt = torch::stack({loss.detach().to(torch::kDouble).reshape({}), gradient_sum(model.trainable)});
    comm->all_reduce_sum(lt, "loss");
    const double gloss = lt[0].item<double>() / static_cast<double>(world);
    const bool finite = std::isfinite(gloss) && std::isfinite(lt[1].item<double>());
    if (finite) {
      optimizer.step();
      if (moco) model.moco->update_momentum(momentum_schedule(o.moco_momentum(), step, total));
    } else {
      ++result.skipped_steps;
    }
    result.losses.push_back(gloss);
    examples += sampler.global_batch_rows(pos.step);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    const double eps = elapsed > 0 ? examples / elapsed : 0;
    if (rank == 0) {
      if (metrics) {
        StepMetrics m;
        m.step = step + 1;
        m.epoch = pos.epoch + 1;
        m.step_in_epoch = pos.step + 1;
        m.rows = sampler.global_batch_rows(pos.step);
        m.loss = gloss;
        m.lr = lr;
        m.examples_per_s = eps;
        m.elapsed_s = elapsed;
        m.bytes_sent = comm->stats().total_bytes_sent() - step_bytes0;
        m.applied = finite;
        checked([&] { metrics->write(m); });
      }
      const int64_t done = step + 1 - start;
      if (o.log_every() > 0 && (done % o.log_every() == 0 || step + 1 == total || done == 1 || !finite)) {
        const double eta = elapsed / done * (total - step - 1);
        std::ostringstream line;
        line << "step " << step + 1 << "/" << total << "  epoch " << pos.epoch + 1 << " (" << pos.step + 1 << "/"
             << steps_per_epoch << ")  loss " << std::fixed << std::setprecision(4) << gloss << "  lr "
             << std::scientific << std::setprecision(2) << lr << std::fixed << std::setprecision(0) << "  " << eps
             << " ex/s  ETA " << fmt_duration(eta);
        if (sampler.global_batch_rows(pos.step) < o.batch_size()) {
          line << "  (short batch: " << sampler.global_batch_rows(pos.step) << " rows)";
        }
        if (!finite) line << "  NOT APPLIED: non-finite " << (std::isfinite(gloss) ? "gradient" : "loss");
        checked([&] { log(line.str() + "\n"); });
      }
    }
    if (!finite && result.skipped_steps > o.skip_nonfinite()) {
      // Every rank reaches this on the same numbers. No checkpoint is
      // written: the last one (if any) stays the last good state.
      TORCH_CHECK(false, "training diverged at step ", step + 1, "/", total, ": the ",
                  std::isfinite(gloss) ? "gradient" : "loss", " is not finite (loss ", gloss, ", lr ", lr, "); ",
                  o.skip_nonfinite() > 0 ? "more than the allowed " + std::to_string(o.skip_nonfinite()) +
                                               " non-finite steps (--skip-nonfinite); "
                                         : std::string(),
                  ckpt_file.empty() ? std::string("nothing was saved")
                                    : "the last good checkpoint " + ckpt_file + " is kept (if one was written)",
                  "; lower --lr or allow skipping with --skip-nonfinite N");
    }
    if (o.checkpoint_every() > 0 && (step + 1) % o.checkpoint_every() == 0 && step + 1 < total) save(step + 1);
  }
  result.steps = step;
  result.train_s = std::chrono::duration<double>(Clock::now() - t0).count();
  result.examples_per_s = result.train_s > 0 ? examples / result.train_s : 0;
  result.epochs_done = step > 0 ? sampler.position(step - 1).epoch + 1 : 0;
  result.bytes_sent = comm->stats().total_bytes_sent() - bytes0;
  try {
    // A resumed run that had nothing left to do (re-evaluating a finished
    // run) leaves its checkpoint untouched.
    if (step > start || !o.resume()) save(step);
  } catch (const c10::Error& e) {
    if (write_error.empty()) throw;
    TORCH_CHECK(false, write_error, "; the run stopped at step ", step, "/", total,
                " but its checkpoint could not be written either: ", e.what_without_backtrace());
  }
  comm->barrier();  // the checkpoint is on disk before any rank moves on
  TORCH_CHECK(write_error.empty(), write_error, "; the run stopped at step ", step, "/", total,
              ckpt_file.empty() ? std::string() : " with checkpoint " + ckpt_file, " (free space, then --resume)");

  model.module->eval();
  result.encoder = moco ? model.moco->encoder() : model.simclr->encoder;
  for (const auto& p : model.module->parameters()) result.parameters.push_back(p.detach());
  return result;
}

TrainOptions peer_recipe() {
  return TrainOptions()
      .recipe("simclr")
      .epochs(8)
      .batch_size(256)
      .lr(2e-3)
      .weight_decay(1e-4)
      .warmup_steps(20)
      .temperature(0.2)
      .model(ContrastiveModelOptions()
                 .encoder(EncoderOptions().channels({32, 64, 128}).strides({2, 2, 1}).norm("group").groups(8).pool_grid(1))
                 .proj_hidden_dim(256)
                 .proj_dim(128)
                 .proj_layers(2)
                 .head_layer_norm(false))
      .augment(AugmentOptions().scale_min(0.2).scale_max(1.0).flip_prob(0.5).jitter_prob(0.8).brightness(0.4)
                   .contrast(0.4).blur_prob(0.0).noise_prob(0.0));
}

}  // namespace train
}  // namespace contrax
