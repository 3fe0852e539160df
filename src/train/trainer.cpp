#include "contrax/train/trainer.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>

#include "contrax/data_parallel.h"
#include "contrax/failure.h"
#include "contrax/grad_cache.h"
#include "contrax/losses.h"
#include "contrax/train/augment.h"
#include "contrax/train/checkpoint.h"
#include "contrax/train/sampler.h"
#include "contrax/train/schedule.h"

namespace contrax {
namespace train {

namespace {

using Clock = std::chrono::steady_clock;

// The DataParallel reducer waits on its gradient all-reduce inside backward,
// outside the Communicator's own calls: named so its failures are not raw Gloo.
constexpr const char* kReducerOp = "gradient all_reduce (DataParallel, in backward)";

void make_dirs(const std::string& dir) {
  if (dir.empty()) return;
  std::string cur;
  std::stringstream ss(dir);
  std::string part;
  if (dir[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "cannot create run directory '", cur, "': ", std::strerror(errno));
    }
  }
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

// Keeps the metrics lines of steps < `start_step` (a resumed run rewrites the
// steps after its checkpoint).
void truncate_metrics(const std::string& path, int64_t start_step) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    long long s = -1;
    auto pos = line.find("\"step\":");
    if (pos != std::string::npos) s = std::atoll(line.c_str() + pos + 7);
    if (s >= 0 && s < start_step) kept += line + "\n";
  }
  in.close();
  write_file_atomically(path, kept);
}

}  // namespace

std::string checkpoint_path(const std::string& run_dir) { return run_dir + "/checkpoint.pt"; }

TrainResult train_contrastive(const CommunicatorPtr& comm_in, const Dataset& data, const TrainOptions& o) {
  CommunicatorPtr comm = comm_in ? comm_in : Communicator::single();
  const int64_t rank = comm->rank(), world = comm->world_size();
  const bool moco = o.recipe() == "moco-v3";
  TORCH_CHECK(moco || o.recipe() == "simclr", "recipe must be 'simclr' or 'moco-v3', but got '", o.recipe(), "'");
  TORCH_CHECK(o.batch_size() >= 1, "batch size must be >= 1, but got ", o.batch_size());
  TORCH_CHECK(o.chunk_size() >= 0, "chunk size must be >= 0, but got ", o.chunk_size());
  TORCH_CHECK(o.dtype() == torch::kFloat || o.dtype() == torch::kDouble, "dtype must be float or double");
  TORCH_CHECK(data.size() > 0, "the training set is empty");
  TORCH_CHECK(!o.resume() || !o.run_dir().empty(), "resuming needs a run directory");

  ShardedSampler sampler(data.size(),
                         ShardedSamplerOptions().global_batch_size(o.batch_size()).world_size(world).seed(o.seed()));
  const int64_t steps_per_epoch = sampler.steps_per_epoch();
  const int64_t total = o.max_steps() > 0 ? o.max_steps() : std::max<int64_t>(1, o.epochs()) * steps_per_epoch;
  // A last global batch with fewer rows than ranks is trained on, not refused:
  // a rank whose slice is empty still runs every collective of the step (the
  // loss's row-count exchange and gathers, MoCo's key gather, the reducer's
  // all-reduce of its all-zero gradients, the loss all-reduce below) and
  // contributes L_r = (W/B) * (empty sum) = 0, which is exactly its share.

  // Same model on every rank: seeded construction (DataParallel also
  // broadcasts rank 0's values).
  // The lock makes the seeded construction safe when ranks are threads of one
  // process (tests): they would otherwise interleave draws from the global
  // generator and build different models.
  static std::mutex init_mutex;
  std::unique_lock<std::mutex> init_lock(init_mutex);
  torch::manual_seed(o.seed());
  auto mopts = o.model();
  mopts.encoder().dropout(0.0);
  SimCLRModel simclr{nullptr};
  MocoV3Model mocom{nullptr};
  std::shared_ptr<torch::nn::Module> module;
  std::vector<torch::Tensor> trainable;
  if (moco) {
    mocom = MocoV3Model(mopts);
    mocom->to(o.dtype());
    module = mocom.ptr();
    trainable = mocom->trainable_parameters();
  } else {
    simclr = SimCLRModel(mopts);
    simclr->to(o.dtype());
    module = simclr.ptr();
    trainable = simclr->parameters();
  }
  init_lock.unlock();
  module->train();
  torch::optim::AdamW optimizer(trainable, torch::optim::AdamWOptions(o.lr()).weight_decay(o.weight_decay()));
  const auto sched = WarmupCosineOptions().base_lr(o.lr()).warmup_steps(std::min(o.warmup_steps(), total)).total_steps(total);

  Checkpoint ckpt;
  ckpt.module("model", *module).optimizer("adamw", optimizer).generator("cpu", at::detail::getDefaultCPUGenerator());
  int64_t start = 0;
  const std::string ckpt_file = o.run_dir().empty() ? "" : checkpoint_path(o.run_dir());
  if (o.resume()) {
    // The run's settings first (a checkpoint with nothing registered reads
    // only its scalars): a MoCo checkpoint resumed as SimCLR should be told
    // so, not that its modules do not match.
    Checkpoint saved;
    saved.load(ckpt_file);
    TORCH_CHECK(saved.strings["recipe"] == o.recipe(), "checkpoint ", ckpt_file, " is of recipe '",
                saved.strings["recipe"], "', not '", o.recipe(), "'");
    TORCH_CHECK(saved.ints["batch_size"] == o.batch_size() && saved.ints["seed"] == static_cast<int64_t>(o.seed()) &&
                    saved.ints["dataset_size"] == data.size() && saved.ints["total_steps"] == total,
                "checkpoint ", ckpt_file, " was written by a run with batch size ", saved.ints["batch_size"],
                ", seed ", saved.ints["seed"], ", ", saved.ints["dataset_size"], " examples, ",
                saved.ints["total_steps"], " steps; this run has ", o.batch_size(), ", ", o.seed(), ", ",
                data.size(), ", ", total, " (resume with the same flags)");
    // Older checkpoints carry no dtype string; Checkpoint::load still refuses
    // a dtype change by comparing the tensors themselves.
    const std::string want_dtype = o.dtype() == torch::kDouble ? "double" : "float";
    TORCH_CHECK(saved.strings.count("dtype") == 0 || saved.strings["dtype"] == want_dtype, "checkpoint ",
                ckpt_file, " was written with --dtype ", saved.strings["dtype"], "; this run has --dtype ",
                want_dtype, " (resume with the same flags)");
    TORCH_CHECK(saved.ints.count("world_size") == 0 || saved.ints["world_size"] == world, "checkpoint ", ckpt_file,
                " was written by a run of ", saved.ints["world_size"], " processes; this run has ", world,
                " (resume with the same number of processes)");
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
    ckpt.strings = {{"recipe", o.recipe()}, {"dtype", o.dtype() == torch::kDouble ? "double" : "float"}};
    ckpt.doubles = {{"lr", o.lr()}, {"temperature", o.temperature()}};
    std::ostringstream meta;
    meta << "{\"recipe\":\"" << o.recipe() << "\",\"step\":" << step << ",\"total_steps\":" << total << "}";
    ckpt.metadata = meta.str();
    ckpt.save(ckpt_file);
  };

  auto dp = std::make_shared<DataParallel>(module, comm);

  std::unique_ptr<GradCache> gc;
  if (o.chunk_size() > 0) {
    if (moco) {
      auto m = mocom;
      EncoderFn q = [m](const BatchInput& x) mutable -> c10::IValue { return c10::IValue(m->query(x.tensor())); };
      gc = std::make_unique<GradCache>(
          std::vector<GradCacheEncoder>{GradCacheEncoder(q, o.chunk_size()).data_parallel(dp).name("view1"),
                                        GradCacheEncoder(q, o.chunk_size()).data_parallel(dp).name("view2")},
          [](const std::vector<torch::Tensor>&) -> torch::Tensor {
            // Never called: the MoCo step hands its loss (which needs the
            // step's keys) to GradCache::finish directly.
            TORCH_INTERNAL_ASSERT(false, "MoCo v3 passes its loss to GradCache::finish");
          });
    } else {
      gc = std::make_unique<GradCache>(
          std::vector<GradCacheEncoder>{GradCacheEncoder(simclr, o.chunk_size()).data_parallel(dp).name("view1"),
                                        GradCacheEncoder(simclr, o.chunk_size()).data_parallel(dp).name("view2")},
          [&](const std::vector<torch::Tensor>& r) {
            return nt_xent_loss(r[0], r[1], NTXentLossOptions().temperature(o.temperature()).comm(comm));
          });
    }
  }

  std::ofstream metrics;
  if (rank == 0 && !o.run_dir().empty()) {
    make_dirs(o.run_dir());
    const std::string mpath = o.run_dir() + "/metrics.jsonl";
    // Partial files of writers killed mid-write (a full disk, SIGKILL).
    remove_stale_temporaries(ckpt_file);
    remove_stale_temporaries(mpath);
    if (o.resume()) {
      truncate_metrics(mpath, start);
      metrics.open(mpath, std::ios::app);
    } else {
      metrics.open(mpath, std::ios::trunc);
    }
    TORCH_CHECK(metrics.good(), "cannot write ", mpath);
  }
  std::ostream& log = o.progress_to_stderr() ? std::cerr : std::cout;

  const AugmentOptions aopts = AugmentOptions().dtype(o.dtype());
  TrainResult result;
  result.start_step = start;
  result.total_steps = total;
  const auto t0 = Clock::now();
  int64_t step = start, examples = 0;
  for (; step < total; ++step) {
    // Agree on stopping at the step boundary: any rank's request stops all.
    const bool want_stop =
        (o.stop_requested() && o.stop_requested()()) || (o.stop_at_step() >= 0 && step >= o.stop_at_step());
    auto flag = torch::full({1}, want_stop ? 1.0 : 0.0, torch::kDouble);
    comm->all_reduce_sum(flag, "stop_flag");
    if (flag.item<double>() > 0) {
      result.interrupted = true;
      break;
    }
    const auto pos = sampler.position(step);
    const auto idx = sampler.local_indices(pos.epoch, pos.step, rank);
    const auto x = data.images.index_select(0, idx);
    const auto v1 = augment(x, idx, AugmentKey{o.seed(), pos.epoch, pos.step, 0}, aopts);
    const auto v2 = augment(x, idx, AugmentKey{o.seed(), pos.epoch, pos.step, 1}, aopts);
    const int64_t b = idx.size(0);
    const double lr = warmup_cosine_lr(step, sched);
    set_learning_rate(optimizer, lr);
    optimizer.zero_grad();

    torch::Tensor loss;
    if (moco) {
      torch::Tensor k1, k2;
      {
        torch::NoGradGuard ng;
        auto k = mocom->key(torch::cat({v1, v2}));
        k1 = k.narrow(0, 0, b);
        k2 = k.narrow(0, b, b);
      }
      auto lopts = MocoV3LossOptions().temperature(o.temperature()).comm(comm);
      if (gc) {
        gc->cache(size_t{0}, v1);
        gc->cache(size_t{1}, v2);
        with_collective_context(*comm, kReducerOp, [&] {
          loss = gc->finish([&](const std::vector<torch::Tensor>& r) { return moco_v3_loss(r[0], r[1], k1, k2, lopts); });
        });
      } else {
        auto q = dp->forward([&] { return mocom->query(torch::cat({v1, v2})); });
        loss = moco_v3_loss(q.narrow(0, 0, b), q.narrow(0, b, b), k1, k2, lopts);
        with_collective_context(*comm, kReducerOp, [&] { loss.backward(); });
      }
    } else {
      if (gc) {
        with_collective_context(*comm, kReducerOp, [&] { loss = gc->step({v1, v2}); });
      } else {
        auto z = dp->forward([&] { return simclr->forward(torch::cat({v1, v2})); });
        loss = nt_xent_loss(z.narrow(0, 0, b), z.narrow(0, b, b),
                            NTXentLossOptions().temperature(o.temperature()).comm(comm));
        with_collective_context(*comm, kReducerOp, [&] { loss.backward(); });
      }
    }
    optimizer.step();
    if (moco) mocom->update_momentum(momentum_schedule(o.moco_momentum(), step, total));

    auto lt = loss.detach().to(torch::kDouble).reshape({1}).clone();
    comm->all_reduce_sum(lt, "loss");
    const double gloss = lt.item<double>() / static_cast<double>(world);
    result.losses.push_back(gloss);
    examples += sampler.global_batch_rows(pos.step);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    const double eps = elapsed > 0 ? examples / elapsed : 0;
    if (rank == 0) {
      if (metrics.is_open()) {
        std::ostringstream m;
        m << std::setprecision(17) << "{\"step\":" << step << ",\"epoch\":" << pos.epoch << ",\"loss\":" << gloss
          << ",\"lr\":" << lr << ",\"examples_per_s\":" << std::setprecision(6) << eps
          << ",\"elapsed_s\":" << elapsed << "}\n";
        metrics << m.str() << std::flush;
      }
      const int64_t done = step + 1 - start;
      if (o.log_every() > 0 && (done % o.log_every() == 0 || step + 1 == total || done == 1)) {
        const double eta = elapsed / done * (total - step - 1);
        std::ostringstream line;
        line << "step " << step + 1 << "/" << total << "  epoch " << pos.epoch + 1 << " ("
             << pos.step + 1 << "/" << steps_per_epoch << ")  loss " << std::fixed << std::setprecision(4) << gloss
             << "  lr " << std::scientific << std::setprecision(2) << lr << std::fixed << std::setprecision(0)
             << "  " << eps << " ex/s  ETA " << fmt_duration(eta) << "\n";
        log << line.str() << std::flush;
      }
    }
    if (o.checkpoint_every() > 0 && (step + 1) % o.checkpoint_every() == 0 && step + 1 < total) save(step + 1);
  }
  result.steps = step;
  result.train_s = std::chrono::duration<double>(Clock::now() - t0).count();
  result.examples_per_s = result.train_s > 0 ? examples / result.train_s : 0;
  result.epochs_done = step > 0 ? sampler.position(step - 1).epoch + 1 : 0;
  save(step);
  comm->barrier();  // the checkpoint is on disk before any rank moves on

  module->eval();
  result.encoder = moco ? mocom->encoder() : simclr->encoder;
  for (const auto& p : module->parameters()) result.parameters.push_back(p.detach());
  return result;
}

}  // namespace train
}  // namespace contrax
