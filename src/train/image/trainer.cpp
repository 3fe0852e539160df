// The image recipes (see trainer.h): the SimCLR and MoCo v3 models and their
// steps on two augmented views, run by the shared loop (common/loop.h).
#include "contrax/train/image/trainer.h"

#include <memory>
#include <mutex>

#include "contrax/comm/failure.h"
#include "contrax/losses/losses.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "contrax/train/image/augment.h"

namespace contrax::train {

namespace {

void check_train_options(const TrainOptions& o, const Dataset& data) {
  TORCH_CHECK(o.recipe() == "simclr" || o.recipe() == "moco-v3", "recipe must be 'simclr' or 'moco-v3', but got '",
              o.recipe(), "'");
  check_run_options(o.run());
  TORCH_CHECK(o.chunk_size() >= 0, "chunk size must be >= 0, but got ", o.chunk_size());
  TORCH_CHECK(data.size() > 0, "the training set is empty");
}

// The model of a recipe, built identically on every rank from the seed.
struct Model {
  SimCLRModel simclr{nullptr};
  MocoV3Model moco{nullptr};
  std::shared_ptr<torch::nn::Module> module;
  std::vector<torch::Tensor> trainable;
};

Model build_model(const TrainOptions& o, const torch::Device& device) {
  // The lock makes the seeded construction safe when ranks are threads of one
  // process (tests): they would otherwise interleave draws from the global
  // generator and build different models. DataParallel also broadcasts rank
  // 0's values, but the optimizer state must match from the start.
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> init_lock(init_mutex);
  torch::manual_seed(o.run().seed());
  auto mopts = o.model();
  mopts.encoder().dropout(0.0);
  Model m;
  if (o.recipe() == "moco-v3") {
    m.moco = MocoV3Model(mopts);
    m.moco->to(device, o.run().dtype());
    m.module = m.moco.ptr();
    m.trainable = m.moco->trainable_parameters();
  } else {
    m.simclr = SimCLRModel(mopts);
    m.simclr->to(device, o.run().dtype());
    m.module = m.simclr.ptr();
    m.trainable = m.simclr->parameters();
  }
  m.module->train();
  return m;
}

// One step of a recipe on this rank's two views [b, C, H, W]: forward, loss
// and backward (gradients averaged over ranks by the DataParallel reducer);
// returns this rank's loss L_r (see Step::loss).
using ViewsStep = std::function<torch::Tensor(const torch::Tensor& v1, const torch::Tensor& v2)>;

ViewsStep simclr_step(const Model& m, const std::shared_ptr<DataParallel>& dp, const CommunicatorPtr& comm,
                   const TrainOptions& o) {
  const auto lopts = NTXentLossOptions().temperature(o.temperature()).comm(comm);
  if (o.chunk_size() > 0) {
    auto gc = std::make_shared<GradCache>(
        std::vector<GradCacheEncoder>{GradCacheEncoder(m.simclr, o.chunk_size()).data_parallel(dp).name("view1"),
                                      GradCacheEncoder(m.simclr, o.chunk_size()).data_parallel(dp).name("view2")},
        [lopts](const std::vector<torch::Tensor>& r) { return nt_xent_loss(r[0], r[1], lopts); });
    return [gc, comm](const torch::Tensor& v1, const torch::Tensor& v2) {
      torch::Tensor loss;
      with_collective_context(*comm, kReducerAllReduce, [&] { loss = gc->step({v1, v2}); });
      return loss;
    };
  }
  auto model = m.simclr;
  return [model, dp, lopts, comm](const torch::Tensor& v1, const torch::Tensor& v2) mutable {
    const int64_t b = v1.size(0);
    auto z = dp->forward([&] { return model->forward(torch::cat({v1, v2})); });  // [2b, proj_dim]
    auto loss = nt_xent_loss(z.narrow(0, 0, b), z.narrow(0, b, b), lopts);
    with_collective_context(*comm, kReducerAllReduce, [&] { loss.backward(); });
    return loss;
  };
}

ViewsStep moco_step(const Model& m, const std::shared_ptr<DataParallel>& dp, const CommunicatorPtr& comm,
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
      with_collective_context(*comm, kReducerAllReduce, [&] {
        loss = gc->finish([&](const std::vector<torch::Tensor>& r) { return moco_v3_loss(r[0], r[1], k1, k2, lopts); });
      });
      return loss;
    }
    auto q = dp->forward([&] { return model->query(torch::cat({v1, v2})); });  // [2b, dim]
    auto loss = moco_v3_loss(q.narrow(0, 0, b), q.narrow(0, b, b), k1, k2, lopts);
    with_collective_context(*comm, kReducerAllReduce, [&] { loss.backward(); });
    return loss;
  };
}

}  // namespace

int64_t total_steps(const TrainOptions& o, int64_t dataset_size) { return total_steps(o.run(), dataset_size); }

TrainResult train_contrastive(const CommunicatorPtr& comm_in, const Dataset& data, const TrainOptions& o) {
  CommunicatorPtr comm = comm_in ? comm_in : Communicator::single();
  check_train_options(o, data);
  const bool moco = o.recipe() == "moco-v3";
  // The model trains on the communicator's device (a GPU bound to this
  // rank, or the CPU); the augmentation runs on the CPU, into pinned memory
  // when the views go to a GPU, whence they are copied without blocking.
  const torch::Device device = comm->device();
  if (device.is_cuda()) {
    // A run stopped and resumed must repeat the uninterrupted one bit for
    // bit: cuDNN's benchmark mode picks convolution algorithms by timing
    // (another choice each run), and some of its algorithms sum with atomics
    // (another order each call).
    at::globalContext().setBenchmarkCuDNN(false);
    at::globalContext().setDeterministicCuDNN(true);
  }
  Model model = build_model(o, device);
  TrainLoop loop(comm, o.run(),
                 {o.recipe(), data.size(), {{"model", model.module.get()}}, model.trainable, {},
                  {{"temperature", o.temperature()}}});
  auto dp = std::make_shared<DataParallel>(model.module, comm);
  const ViewsStep views_step = moco ? moco_step(model, dp, comm, o) : simclr_step(model, dp, comm, o);
  const AugmentOptions aopts = AugmentOptions(o.augment()).dtype(o.run().dtype());
  Step step;
  step.loss = [&](const StepBatch& b) {
    const auto x = data.images.index_select(0, b.indices);
    const uint64_t seed = o.run().seed();
    auto v1 = augment(x, b.indices, AugmentKey{seed, b.epoch, b.step_in_epoch, 0}, aopts);
    auto v2 = augment(x, b.indices, AugmentKey{seed, b.epoch, b.step_in_epoch, 1}, aopts);
    if (device.is_cuda()) {
      v1 = v1.pin_memory().to(device, /*non_blocking=*/true);
      v2 = v2.pin_memory().to(device, /*non_blocking=*/true);
    }
    return views_step(v1, v2);
  };
  if (moco) {
    step.after_update = [&](int64_t s, int64_t total) {
      model.moco->update_momentum(momentum_schedule(o.moco_momentum(), s, total));
    };
  }
  TrainResult result;
  static_cast<RunResult&>(result) = loop.run(step);
  model.module->eval();
  model.module->to(torch::kCPU);  // the evaluation and the caller work on the CPU
  result.encoder = moco ? model.moco->encoder() : model.simclr->encoder;
  for (const auto& p : model.module->parameters()) result.parameters.push_back(p.detach());
  return result;
}

TrainOptions peer_recipe() {
  return TrainOptions()
      .recipe("simclr")
      .run(RunOptions(TrainOptions().run()).epochs(8).batch_size(256).lr(2e-3).weight_decay(1e-4).warmup_steps(20))
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

}  // namespace contrax::train
