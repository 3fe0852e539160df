// Tests of contrax::GradCache: after one gradient-cache step every parameter
// gradient equals that of one ordinary full-batch step (fp64, rel err <= 1e-10)
// for an MLP encoder with dropout and the CLIP loss with a learnable logit
// scale: on one process, and on thread ranks through DataParallel with uneven
// and empty ranks and with the materialised, tiled and ring losses. Also
// `contrax verify`'s gradient-cache cases, and that their check can fail.
//
// What is checkable about dropout, and how:
//  * The exactness of the chunked two-pass scheme, on one rank and across
//    ranks, needs the reference to see the same masks as the gradient cache.
//    The list/named-input encoders use a dropout whose mask is a fixed
//    function of (example id, feature): any chunking, any rank split and the
//    full batch see the same masks, and the rank threads share no generator.
//  * The random-state replay itself is checked on one rank with torch's own
//    dropout (global generator): the reference runs the chunks in the same
//    order with one graph (so it draws the masks pass 1 drew), the gradient
//    cache must match it, and must not match it with replay turned off.
//    Across thread ranks the global generator is shared and its interleaving
//    is not deterministic, so that check is single-rank only.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <cmath>
#include <iostream>
#include <mutex>
#include <numeric>

#include "contrax/check/verify.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/tiled.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "support/errors.h"
#include "support/hashed_dropout.h"
#include "support/ranks.h"

namespace {

using contrax::BatchInput;
using contrax::CommunicatorPtr;
using contrax::DataParallel;
using contrax::GradCache;
using contrax::GradCacheEncoder;
using contrax::GradCacheOptions;
using contrax::testing::hashed_dropout;
using contrax::testing::rel_err;
using contrax::testing::run_ranks;
using contrax::testing::shard;

// MLP encoder. forward(list {x, ids}) and forward(named {"x", "id"}) use the
// per-example dropout; forward(tensor) uses torch's dropout (global RNG).
struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl(int64_t in, int64_t out, double salt = 1.0) : in(in), out(out), salt(salt) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(in, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, out));
  }
  torch::Tensor forward(const std::vector<torch::Tensor>& x) {
    return fc2(hashed_dropout(torch::tanh(fc1(x.at(0))), x.at(1), 0.3, salt));
  }
  torch::Tensor forward(const std::map<std::string, torch::Tensor>& x) { return forward(std::vector<torch::Tensor>{x.at("x"), x.at("id")}); }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::dropout(torch::tanh(fc1(x)), 0.3, is_training()));
  }
  int64_t in, out;
  double salt;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

Mlp copy_of(const Mlp& m) { return Mlp(std::dynamic_pointer_cast<MlpImpl>(m->clone())); }
contrax::ClipLoss copy_of(const contrax::ClipLoss& m) {
  contrax::ClipLoss c(m->options);
  torch::NoGradGuard ng;
  c->to(torch::kDouble);
  c->logit_scale.copy_(m->logit_scale);
  return c;
}

std::mutex& init_mutex() {
  static std::mutex m;
  return m;
}

// A paired batch: image-like x [B, 6], text-like y [B, 5], example ids [B].
struct Batch {
  torch::Tensor x, y, ids;
};
Batch make_batch(int64_t B, int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({B, 6}, torch::kDouble), torch::randn({B, 5}, torch::kDouble),
          torch::arange(B, torch::kDouble) + 100.0 * static_cast<double>(seed)};
}

// The models of one test: two towers and the loss module with the logit scale.
struct Models {
  Mlp a{nullptr}, b{nullptr};
  contrax::ClipLoss clip{nullptr};
  std::vector<torch::Tensor> params() const {
    std::vector<torch::Tensor> p = a->parameters();
    if (b.ptr() != a.ptr()) {
      for (auto& t : b->parameters()) p.push_back(t);
    }
    for (auto& t : clip->parameters()) p.push_back(t);
    return p;
  }
  std::vector<torch::Tensor> grads() const {
    std::vector<torch::Tensor> g;
    for (const auto& p : params()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    return g;
  }
};

Models make_models(int64_t seed, bool tied = false) {
  torch::manual_seed(seed);
  Models m;
  m.a = Mlp(6, 4, 1.0);
  m.a->to(torch::kDouble);
  m.b = tied ? m.a : Mlp(5, 4, 2.0);
  m.b->to(torch::kDouble);
  m.clip = contrax::ClipLoss(contrax::ClipLossOptions(), 10.0);
  m.clip->to(torch::kDouble);
  return m;
}

Models copy_of(const Models& m, bool tied = false) {
  Models c;
  c.a = copy_of(m.a);
  c.b = tied ? c.a : copy_of(m.b);
  c.clip = copy_of(m.clip);
  return c;
}

void expect_match(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, double tol,
                  const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LE(rel_err(got[i], want[i]), tol) << where << ": parameter " << i;
}

// Ordinary full-batch step; list inputs (per-example dropout). For tied
// towers the second tower's input is x again (same width).
torch::Tensor full_batch_step(Models m, const Batch& b, bool tied = false) {
  auto fa = m.a->forward(std::vector<torch::Tensor>{b.x, b.ids});
  auto fb = m.b->forward(std::vector<torch::Tensor>{tied ? b.x * 0.5 : b.y, b.ids + 0.25});
  auto loss = m.clip(fa, fb);
  loss.backward();
  return loss.detach();
}

GradCache make_cache(Models m, int64_t chunk_a, int64_t chunk_b, GradCacheOptions options = {}) {
  return GradCache({GradCacheEncoder(m.a, chunk_a).name("a"), GradCacheEncoder(m.b, chunk_b).name("b")},
                   [clip = m.clip](const std::vector<torch::Tensor>& r) { return clip.ptr()->forward(r[0], r[1]); },
                   std::move(options));
}

std::vector<BatchInput> list_inputs(const Batch& b, bool tied = false) {
  return {std::vector<torch::Tensor>{b.x, b.ids},
          std::vector<torch::Tensor>{tied ? b.x * 0.5 : b.y, b.ids + 0.25}};
}

// One test's starting models and batch, and the ordinary full-batch step on a
// copy of the models: the loss and gradients the gradient cache must match.
struct FullBatch {
  FullBatch(int64_t B, int64_t model_seed, int64_t batch_seed, bool tied = false)
      : B(B), init(make_models(model_seed, tied)), batch(make_batch(B, batch_seed)), ref(copy_of(init, tied)),
        want_loss(full_batch_step(ref, batch, tied)), want(ref.grads()) {}
  int64_t B;
  Models init;
  Batch batch;
  Models ref;
  torch::Tensor want_loss;
  std::vector<torch::Tensor> want;
};

// ---- single process

TEST(GradCache, MatchesFullBatchForManyChunkSizes) {
  const auto [B, init, batch, ref, want_loss, want] = FullBatch(11, 1, 3);
  // Chunk sizes that divide B, that do not, 1, B and more than B; the two
  // encoders with different chunk sizes.
  for (auto [ca, cb] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 4}, {4, 3}, {5, 11}, {11, 2}, {16, 7}}) {
    auto m = copy_of(init);
    auto gc = make_cache(m, ca, cb);
    auto loss = gc.step(list_inputs(batch));
    EXPECT_LE(rel_err(loss, want_loss), 1e-12) << "chunks " << ca << "," << cb;
    expect_match(m.grads(), want, 1e-10, c10::str("chunks ", ca, ",", cb));
  }
}

TEST(GradCache, TiedEncodersAndNamedInputs) {
  const auto [B, init, batch, ref, want_loss, want] = FullBatch(9, 2, 4, /*tied=*/true);
  auto m = copy_of(init, true);
  ASSERT_EQ(m.a.ptr(), m.b.ptr());
  auto gc = make_cache(m, 2, 4);
  using Named = std::map<std::string, torch::Tensor>;
  gc.step({Named{{"x", batch.x}, {"id", batch.ids}}, Named{{"x", batch.x * 0.5}, {"id", batch.ids + 0.25}}});
  expect_match(m.grads(), want, 1e-10, "tied");
}

TEST(GradCache, SecondStepAfterOptimizerUpdateStillMatches) {
  const int64_t B = 10;
  auto init = make_models(5);
  std::vector<Batch> batches{make_batch(B, 6), make_batch(B, 7)};
  auto ref = copy_of(init);
  auto m = copy_of(init);
  torch::optim::SGD opt_ref(ref.params(), torch::optim::SGDOptions(0.5).momentum(0.9));
  torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.5).momentum(0.9));
  auto gc = make_cache(m, 3, 4);
  for (int s = 0; s < 2; ++s) {
    opt_ref.zero_grad();
    opt.zero_grad();
    full_batch_step(ref, batches[s]);
    gc.step(list_inputs(batches[s]));
    expect_match(m.grads(), ref.grads(), 1e-10, c10::str("step ", s));
    EXPECT_EQ(gc.cached_rows(0), 0);
    opt_ref.step();
    opt.step();
  }
}

// Random-state replay with torch's dropout: the reference draws the masks in
// pass 1's order (chunk by chunk, encoder a then b) inside one graph.
TEST(GradCache, ReplaysRandomStateForDropout) {
  const int64_t B = 10, ca = 3, cb = 4;
  auto init = make_models(8);
  auto batch = make_batch(B, 9);
  auto ref = copy_of(init);
  torch::manual_seed(1234);
  {
    std::vector<torch::Tensor> fa, fb;
    for (int64_t s = 0; s < B; s += ca) fa.push_back(ref.a->forward(batch.x.narrow(0, s, std::min(ca, B - s))));
    for (int64_t s = 0; s < B; s += cb) fb.push_back(ref.b->forward(batch.y.narrow(0, s, std::min(cb, B - s))));
    ref.clip(torch::cat(fa), torch::cat(fb)).backward();
  }
  auto want = ref.grads();
  auto want_next = torch::rand({4}, torch::kDouble);  // the generator after one pass

  auto m = copy_of(init);
  auto gc = make_cache(m, ca, cb);
  torch::manual_seed(1234);
  gc.step({batch.x, batch.y});
  expect_match(m.grads(), want, 1e-10, "replay");
  // The generator is left where one pass would have left it.
  EXPECT_EQ(rel_err(torch::rand({4}, torch::kDouble), want_next), 0.0);

  // Without replay the second pass draws other masks: the test is sensitive.
  auto m2 = copy_of(init);
  auto gc2 = make_cache(m2, ca, cb, GradCacheOptions().replay_rng(false));
  torch::manual_seed(1234);
  gc2.step({batch.x, batch.y});
  double worst = 0;
  auto got2 = m2.grads();
  for (size_t i = 0; i < got2.size() - 1; ++i) worst = std::max(worst, rel_err(got2[i], want[i]));
  EXPECT_GT(worst, 1e-3);
}

// The functional form: sub-batches arrive one at a time (named inputs,
// encoders by name), the step is finished once.
TEST(GradCache, FunctionalFormWithNamedInputs) {
  const auto [B, init, batch, ref, want_loss, want] = FullBatch(12, 10, 11);
  auto m = copy_of(init);
  auto gc = make_cache(m, 2, 3);
  using Named = std::map<std::string, torch::Tensor>;
  // Encoder "a" through named inputs of a callable encoder; here the module's
  // named forward does the work.
  for (int64_t s = 0; s < B; s += 5) {
    const int64_t n = std::min<int64_t>(5, B - s);
    auto rep = gc.cache("a", Named{{"x", batch.x.narrow(0, s, n)}, {"id", batch.ids.narrow(0, s, n)}});
    EXPECT_EQ(rep.size(0), n);
    EXPECT_FALSE(rep.requires_grad());
    gc.cache("b", std::vector<torch::Tensor>{batch.y.narrow(0, s, n), batch.ids.narrow(0, s, n) + 0.25});
  }
  EXPECT_EQ(gc.cached_rows(0), B);
  auto loss = gc.finish();
  EXPECT_LE(rel_err(loss, want_loss), 1e-12);
  expect_match(m.grads(), want, 1e-10, "functional");
  EXPECT_EQ(gc.cached_rows(0), 0);
}

// A 0-row input is one empty chunk (what an empty rank runs): cache() returns
// [0, d] rows, and the chunk changes nothing in the step's gradients.
TEST(GradCache, ZeroRowInputIsOneEmptyChunk) {
  const auto [B, init, batch, ref, want_loss, want] = FullBatch(6, 17, 18);
  auto m = copy_of(init);
  auto gc = make_cache(m, 4, 4);
  auto rep = gc.cache("a", std::vector<torch::Tensor>{batch.x.narrow(0, 0, 0), batch.ids.narrow(0, 0, 0)});
  EXPECT_EQ(rep.sizes(), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(gc.cached_rows(0), 0);
  auto inputs = list_inputs(batch);
  gc.cache("a", inputs[0]);
  gc.cache("b", inputs[1]);
  EXPECT_LE(rel_err(gc.finish(), want_loss), 1e-12);
  expect_match(m.grads(), want, 1e-10, "with an empty chunk");
}

// Callable encoders with structured output and a representation getter, a
// user split function, and the loss-scale hook.
TEST(GradCacheCallables, GetRepSplitAndLossScale) {
  const auto [B, init, batch, ref, want_loss, want] = FullBatch(7, 12, 13);
  auto m = copy_of(init);
  auto a = m.a, b = m.b;
  GradCacheEncoder ea([a](const BatchInput& x) -> c10::IValue {
    auto f = a.ptr()->forward(std::vector<torch::Tensor>{x[0], x[1]});
    return c10::ivalue::Tuple::create({c10::IValue(f * 2.0), c10::IValue(f)});
  }, 3);
  ea.get_rep([](const c10::IValue& out) { return out.toTupleRef().elements()[1].toTensor(); });
  int split_calls = 0;
  GradCacheEncoder eb([b](const BatchInput& x) -> c10::IValue { return b.ptr()->forward(x.list()); }, 100);
  eb.split([&](const BatchInput& x, int64_t chunk) {
    ++split_calls;
    EXPECT_EQ(chunk, 100);
    return std::vector<BatchInput>{x.narrow(0, 2), x.narrow(2, 4), x.narrow(6, 1)};
  });
  GradCache gc({ea, eb}, [clip = m.clip](const std::vector<torch::Tensor>& r) { return clip.ptr()->forward(r[0], r[1]); },
               GradCacheOptions().scale_loss([](const torch::Tensor& l) { return l * 8.0; }));
  auto loss = gc.step(list_inputs(batch));
  EXPECT_EQ(split_calls, 1);
  EXPECT_LE(rel_err(loss, want_loss), 1e-12);  // returned unscaled
  auto got = m.grads();
  for (auto& g : got) g.div_(8.0);
  expect_match(got, want, 1e-10, "callables");
}

TEST(GradCache, Bf16AutocastOnCpu) {
  const int64_t B = 16;
  torch::manual_seed(14);
  Mlp a(6, 4, 1.0), b(5, 4, 2.0);  // float32
  contrax::ClipLoss clip(contrax::ClipLossOptions(), 10.0);
  auto x = torch::randn({B, 6}), y = torch::randn({B, 5}), ids = torch::arange(B, torch::kFloat);
  // fp32 reference
  auto a_ref = copy_of(a), b_ref = copy_of(b);
  clip(a_ref->forward(std::vector<torch::Tensor>{x, ids}), b_ref->forward(std::vector<torch::Tensor>{y, ids}))
      .backward();
  auto want = a_ref->fc1->weight.grad().clone();
  clip->zero_grad();
  torch::ScalarType rep_dtype = torch::kFloat;
  GradCache gc({GradCacheEncoder(a, 4), GradCacheEncoder(b, 4)},
               [&](const std::vector<torch::Tensor>& r) {
                 rep_dtype = r[0].scalar_type();
                 return clip(r[0].to(torch::kFloat), r[1].to(torch::kFloat));
               },
               GradCacheOptions().bf16_autocast(true));
  gc.step({std::vector<torch::Tensor>{x, ids}, std::vector<torch::Tensor>{y, ids}});
  EXPECT_EQ(rep_dtype, torch::kBFloat16);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));  // the caller's state is restored
  ASSERT_TRUE(a->fc1->weight.grad().defined());
  EXPECT_EQ(a->fc1->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_LE(rel_err(a->fc1->weight.grad(), want), 0.1);  // bf16 has 8 significant bits
}

TEST(GradCache, Errors) {
  auto m = make_models(15);
  auto loss = [clip = m.clip](const std::vector<torch::Tensor>& r) { return clip.ptr()->forward(r[0], r[1]); };
  CONTRAX_EXPECT_ERROR(GradCache({}, loss), "GradCache(): argument 'encoders' is empty");
  CONTRAX_EXPECT_ERROR(GradCache({GradCacheEncoder(m.a, 2)}, nullptr), "GradCache(): argument 'loss' is empty");
  CONTRAX_EXPECT_ERROR(GradCache({GradCacheEncoder(m.a, 0).name("img")}, loss),
                       "GradCache(): encoder 0 ('img') has chunk_size 0; it must be positive");
  CONTRAX_EXPECT_ERROR(GradCache({GradCacheEncoder(m.a, 2).name("x"), GradCacheEncoder(m.b, 2).name("x")}, loss),
                       "GradCache(): encoders 0 and 1 are both named 'x'");
  CONTRAX_EXPECT_ERROR(GradCacheEncoder(contrax::EncoderFn(), 2), "GradCacheEncoder(): argument 'forward' is empty");

  auto gc = make_cache(m, 2, 2);
  auto batch = make_batch(4, 16);
  CONTRAX_EXPECT_ERROR(gc.step({batch.x}), "GradCache::step(): got 1 inputs for 2 encoders");
  CONTRAX_EXPECT_ERROR(gc.finish(), "GradCache::finish(): nothing cached for encoder 'a'; call cache() for every "
                       "encoder before finish(), with 0 rows on a rank that has none");
  CONTRAX_EXPECT_ERROR(gc.cache("c", batch.x), "GradCache::cache(): no encoder named 'c'; the named encoders are 'a', 'b'");
  CONTRAX_EXPECT_ERROR(gc.cache(5, batch.x), "GradCache::cache(): encoder index 5 out of range; there are 2 encoders");
  CONTRAX_EXPECT_ERROR(gc.cache(0, std::vector<torch::Tensor>{batch.x, batch.ids.narrow(0, 0, 3)}),
                       "BatchInput: tensor 1 has 3 rows but tensor 0 has 4");
  CONTRAX_EXPECT_ERROR(gc.cache(0, BatchInput::other(c10::IValue(3))),
                       "GradCache::cache(): encoder 'a' got an IValue input, which cannot be split along dim 0");
  gc.clear();

  struct OnlyTensorImpl : torch::nn::Module {
    torch::Tensor forward(const torch::Tensor& x) { return x; }
  };
  auto only = std::make_shared<OnlyTensorImpl>();
  GradCache gc2({GradCacheEncoder(only, 2)}, [](const std::vector<torch::Tensor>& r) { return r[0].sum(); });
  CONTRAX_EXPECT_ERROR(gc2.step({std::vector<torch::Tensor>{batch.x}}),
                       "GradCacheEncoder: the module has no forward() for this input: a list input needs "
                       "forward(std::vector<torch::Tensor>)");
  GradCache gc3({GradCacheEncoder([](const BatchInput& x) -> c10::IValue {
                   return c10::ivalue::Tuple::create({c10::IValue(x.tensor())});
                 }, 2)},
                [](const std::vector<torch::Tensor>& r) { return r[0].sum(); });
  CONTRAX_EXPECT_ERROR(gc3.step({batch.x}),
                       "GradCache: encoder 0 returned Tuple, not a tensor; set GradCacheEncoder::get_rep");
  GradCache gc4({GradCacheEncoder(only, 2)}, [](const std::vector<torch::Tensor>& r) { return r[0]; });
  CONTRAX_EXPECT_ERROR(gc4.step({batch.x}), "GradCache: the loss must be a single value, but got shape [4, 6]");
  GradCache gc5({GradCacheEncoder(only, 2)},
                [](const std::vector<torch::Tensor>& r) { return torch::zeros({}, torch::kDouble); });
  CONTRAX_EXPECT_ERROR(gc5.step({batch.x}), "GradCache: the loss does not depend on any representation");
  EXPECT_EQ(gc5.cached_rows(0), 0);  // a failed step leaves nothing behind

  BatchInput t = batch.x;
  CONTRAX_EXPECT_ERROR(t.named(), "BatchInput::named(): the input is a tensor, not named tensors");
  BatchInput n = std::map<std::string, torch::Tensor>{{"x", batch.x}};
  CONTRAX_EXPECT_ERROR(n["y"], "BatchInput[\"y\"]: no input named 'y'; the inputs are 'x'");
}

// ---- several ranks, through DataParallel

// The loss the distributed step runs on the cached representations.
enum class LossPath { kMaterialised, kTiled, kRing };

struct DistributedSetup {
  std::vector<int64_t> counts;  // rows per rank (W = counts.size()); may hold 0
  bool tied = false;
  LossPath path = LossPath::kMaterialised;
};

// Each rank: one DataParallel per tower (one shared for tied towers), one over
// the loss module, distributed CLIP loss on the local rows (materialised, or
// tiled with tiles of 3 rows, which divide no row count here, gathered or
// around the ring). Two steps with an optimizer in between, compared with the
// single-process full-batch steps; every reducer synchronises once per step.
// Short collective timeouts: a rank that skips a collective (an empty rank
// that runs no chunk) fails the test in seconds instead of hanging it.
void run_distributed(const DistributedSetup& setup) {
  const auto& counts = setup.counts;
  const bool tied = setup.tied;
  const int64_t W = static_cast<int64_t>(counts.size());
  const int64_t B = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  auto init = make_models(20, tied);
  std::vector<Batch> batches{make_batch(B, 21), make_batch(B, 22)};
  auto ref = copy_of(init, tied);
  torch::optim::SGD opt_ref(ref.params(), torch::optim::SGDOptions(0.3));
  std::vector<std::vector<torch::Tensor>> want;
  for (const auto& b : batches) {
    opt_ref.zero_grad();
    full_batch_step(ref, b, tied);
    want.push_back(ref.grads());
    opt_ref.step();
  }

  run_ranks(W, [&](const CommunicatorPtr& comm) {
    Models m;
    {
      std::lock_guard<std::mutex> lock(init_mutex());
      m = copy_of(init, tied);
    }
    // Tiny buckets: several per module, so "once" means num_buckets calls.
    auto opts = contrax::DataParallelOptions().bucket_bytes(200).first_bucket_bytes(100);
    auto dp_a = std::make_shared<DataParallel>(m.a, comm, opts);
    auto dp_b = tied ? dp_a : std::make_shared<DataParallel>(m.b, comm, opts);
    auto dp_loss = std::make_shared<DataParallel>(m.clip, comm, opts);
    contrax::ClipLoss clip = m.clip;
    clip->options.comm(comm);
    contrax::RepresentationLossFn loss = [clip](const std::vector<torch::Tensor>& r) {
      return clip.ptr()->forward(r[0], r[1]);
    };
    if (setup.path != LossPath::kMaterialised) {
      clip->options.path(contrax::MemoryPath::kTiled).tile_size(3).ring(setup.path == LossPath::kRing);
    }
    GradCache gc({GradCacheEncoder(m.a, 2).data_parallel(dp_a), GradCacheEncoder(m.b, 3).data_parallel(dp_b)},
                 loss, GradCacheOptions().loss_data_parallel(dp_loss));
    torch::optim::SGD opt(m.params(), torch::optim::SGDOptions(0.3));
    for (size_t s = 0; s < batches.size(); ++s) {
      Batch local{shard(batches[s].x, counts, comm->rank()), shard(batches[s].y, counts, comm->rank()),
                  shard(batches[s].ids, counts, comm->rank())};
      opt.zero_grad();
      const int64_t calls_before = comm->stats().op("reducer_all_reduce").calls;
      gc.step(list_inputs(local, tied));
      const int64_t calls = comm->stats().op("reducer_all_reduce").calls - calls_before;
      // After the step: the reducer re-buckets once, at the start of the
      // second synchronised backward (gradient-ready order), as DDP does.
      const int64_t buckets = dp_a->num_buckets() + (tied ? 0 : dp_b->num_buckets()) + dp_loss->num_buckets();
      expect_match(m.grads(), want[s], 1e-10,
                   c10::str("W=", W, " tied=", tied, " rank ", comm->rank(), " step ", s));
      if (W > 1) {
        EXPECT_EQ(dp_a->sync_count(), static_cast<int64_t>(s + 1));
        EXPECT_EQ(dp_b->sync_count(), static_cast<int64_t>(s + 1));
        EXPECT_EQ(dp_loss->sync_count(), static_cast<int64_t>(s + 1));
        // Several chunks per encoder (2 and 3 rows), yet each bucket of each
        // reducer is all-reduced once: no-sync held for all other chunks.
        EXPECT_EQ(calls, buckets) << "each reducer must synchronise exactly once per step";
      } else {
        EXPECT_EQ(calls, 0);
      }
      opt.step();
    }
  }, std::chrono::seconds(15));
}

TEST(GradCacheDistributed, WorldOfOne) { run_distributed({{9}}); }
TEST(GradCacheDistributed, TwoRanksUneven) { run_distributed({{7, 4}}); }
TEST(GradCacheDistributed, ThreeRanksUneven) { run_distributed({{5, 2, 4}}); }
TEST(GradCacheDistributed, TwoRanksTiedEncoders) { run_distributed({{3, 6}, true}); }

// A rank with no rows (a short last batch, or verify's row pattern) still
// takes part in every collective: its loss, its reducers' all-reduces.
TEST(GradCacheDistributed, ThreeRanksOneEmpty) { run_distributed({{5, 0, 4}}); }
TEST(GradCacheDistributed, FourRanksOneEmpty) { run_distributed({{6, 3, 0, 5}}); }
TEST(GradCacheDistributed, TwoRanksOneEmptyTiedEncoders) { run_distributed({{0, 5}, true}); }

// The memory-bounded losses under the gradient cache: tiles of 3 rows against
// 2- and 3-row chunks and uneven ranks; gathered keys and the ring.
TEST(GradCacheDistributed, TiledLossTwoRanks) { run_distributed({{7, 4}, false, LossPath::kTiled}); }
TEST(GradCacheDistributed, TiledLossThreeRanks) { run_distributed({{5, 2, 4}, false, LossPath::kTiled}); }
TEST(GradCacheDistributed, RingLossTwoRanks) { run_distributed({{7, 4}, false, LossPath::kRing}); }
TEST(GradCacheDistributed, RingLossThreeRanks) { run_distributed({{5, 2, 4}, false, LossPath::kRing}); }
TEST(GradCacheDistributed, RingLossFourRanksOneEmpty) { run_distributed({{6, 3, 0, 5}, false, LossPath::kRing}); }
TEST(GradCacheDistributed, RingLossWorldOfOne) { run_distributed({{9}, false, LossPath::kRing}); }


// ---- `contrax verify`'s gradient-cache cases

constexpr const char* kVerifyCases[] = {"grad_cache_clip", "grad_cache_tiled_ring"};

// Runs `c` on W thread ranks with verify's default rows (an empty rank from
// W = 3 on); one result per rank.
std::vector<contrax::VerifyResult> verify_on_ranks(const contrax::VerifyCase& c, int64_t W) {
  std::vector<contrax::VerifyResult> results(W);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    results[comm->rank()] = contrax::verify_case(c, comm, contrax::VerifyOptions());
  }, std::chrono::seconds(15));
  return results;
}

const contrax::VerifyCase& registered_case(const std::string& name) {
  for (const auto& c : contrax::verify_cases()) {
    if (c.name == name) return c;
  }
  throw std::runtime_error("no verify case " + name);
}

TEST(GradCacheVerify, CasesPassAtEveryWorldSize) {
  for (int64_t W = 1; W <= 4; ++W) {
    for (const char* name : kVerifyCases) {
      auto results = verify_on_ranks(registered_case(name), W);
      for (const auto& r : results) {
        EXPECT_TRUE(r.passed) << name << " W=" << W << ": " << contrax::to_json(r);
        EXPECT_LE(r.max_rel_err, 1e-10) << name << " W=" << W;
        EXPECT_EQ(contrax::to_json(r), contrax::to_json(results[0])) << "ranks disagree on the verdict";
      }
    }
  }
}

// The check must be able to fail. The case is wrapped so that after the real
// step one parameter's gradient is off by a relative 1e-6 on one rank only
// (the last, which is the empty one at W = 3): every parameter in turn, for
// both cases. Each time the case fails on every rank and names the parameter.
TEST(GradCacheVerify, CheckCatchesAWrongGradientInAnyParameterOnAnyRank) {
  for (const char* name : kVerifyCases) {
    const auto& good = registered_case(name);
    const auto names = good.parameters(4, at::detail::createCPUGenerator(0)).keys();
    ASSERT_EQ(names.size(), 9u);  // two towers of 4 tensors and the logit scale
    for (size_t k = 0; k < names.size(); ++k) {
      contrax::VerifyCase wrong = good;
      wrong.distributed = [&good, k](const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& s,
                                     const CommunicatorPtr& comm) {
        auto loss = good.distributed(x, s, comm);
        if (comm->rank() == comm->world_size() - 1) s[k].grad().mul_(1 + 1e-6);
        return loss;
      };
      for (int64_t W : {1, 3}) {
        for (const auto& r : verify_on_ranks(wrong, W)) {
          EXPECT_FALSE(r.passed) << name << " parameter " << names[k] << " W=" << W;
          EXPECT_EQ(r.worst, "grad " + names[k]) << name << " W=" << W;
          EXPECT_GT(r.max_rel_err, 1e-7);
        }
      }
    }
  }
}

// Ranks whose gradients disagree fail even when their mean is right: what a
// missing loss-side DataParallel does to the logit scale (each rank keeps its
// own dL_r/ds, whose mean is dL/ds). Comparing the rank mean would pass this.
TEST(GradCacheVerify, CheckCatchesRanksThatDisagreeAroundTheRightMean) {
  const auto& good = registered_case("grad_cache_clip");
  contrax::VerifyCase wrong = good;
  wrong.distributed = [&good](const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& s,
                              const CommunicatorPtr& comm) {
    auto loss = good.distributed(x, s, comm);
    auto& g = s.back().grad();  // the logit scale's
    g.add_(g.abs() * (comm->rank() == 0 ? 1e-3 : -1e-3));
    return loss;
  };
  for (const auto& r : verify_on_ranks(wrong, 2)) {
    EXPECT_FALSE(r.passed);
    EXPECT_EQ(r.worst, "grad logit_scale");
  }
}

}  // namespace

// ---- grouped candidates: the second encoder's input has g rows per row of the first

// Query tower a ([b, 6] inputs), candidate tower b ([b g, 5] inputs: each
// query's positive then g-1 hard negatives), grouped_loss with the loss module's
// logit scale; chunk sizes 2 and 3 (neither divides the other's rows). One
// gradient-cache step against the one-shot step on the whole batch, on one
// process and on W = 3 thread ranks with an empty rank.
namespace {

struct GroupedBatch {
  torch::Tensor x, x_ids, y, y_ids;  // [B, 6], [B], [B g, 5], [B g]
};

GroupedBatch make_grouped_batch(int64_t B, int64_t g, int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({B, 6}, torch::kDouble), torch::arange(B, torch::kDouble),
          torch::randn({B * g, 5}, torch::kDouble), torch::arange(B * g, torch::kDouble) + 1000.0};
}

torch::Tensor grouped_of(const contrax::ClipLoss& clip, const torch::Tensor& q, const torch::Tensor& c,
                         const CommunicatorPtr& comm) {
  // Normalised: without it a shift of every candidate leaves each softmax unchanged, so the candidate
  // tower's output bias would have an all-zero (round-off) gradient that no relative check can compare.
  return contrax::grouped_loss(q, c, clip->logit_scale, {}, contrax::GroupedLossOptions().comm(comm).normalize(true));
}

}  // namespace

TEST(GradCacheGrouped, CandidatesWithGTimesTheRowsMatchTheOneShotStep) {
  const int64_t g = 3;
  const std::vector<int64_t> counts{3, 0, 2};
  const int64_t B = 5;
  auto init = make_models(31);
  auto batch = make_grouped_batch(B, g, 32);
  auto ref = copy_of(init);
  auto fq = ref.a->forward(std::vector<torch::Tensor>{batch.x, batch.x_ids});
  auto fc = ref.b->forward(std::vector<torch::Tensor>{batch.y, batch.y_ids});
  auto want_loss = grouped_of(ref.clip, fq, fc, nullptr);
  want_loss.backward();
  auto want = ref.grads();

  {  // one process
    auto m = copy_of(init);
    GradCache gc({GradCacheEncoder(m.a, 2), GradCacheEncoder(m.b, 3)},
                 [clip = m.clip](const std::vector<torch::Tensor>& r) { return grouped_of(clip, r[0], r[1], nullptr); });
    auto loss = gc.step({std::vector<torch::Tensor>{batch.x, batch.x_ids},
                         std::vector<torch::Tensor>{batch.y, batch.y_ids}});
    EXPECT_LE(rel_err(loss, want_loss.detach()), 1e-12);
    expect_match(m.grads(), want, 1e-10, "grouped, one process");
  }

  run_ranks(3, [&](const CommunicatorPtr& comm) {
    Models m;
    {
      std::lock_guard<std::mutex> lock(init_mutex());
      m = copy_of(init);
    }
    auto dp_a = std::make_shared<DataParallel>(m.a, comm);
    auto dp_b = std::make_shared<DataParallel>(m.b, comm);
    auto dp_loss = std::make_shared<DataParallel>(m.clip, comm);
    GradCache gc({GradCacheEncoder(m.a, 2).data_parallel(dp_a), GradCacheEncoder(m.b, 3).data_parallel(dp_b)},
                 [clip = m.clip, comm](const std::vector<torch::Tensor>& r) { return grouped_of(clip, r[0], r[1], comm); },
                 GradCacheOptions().loss_data_parallel(dp_loss));
    const int64_t r = comm->rank();
    std::vector<int64_t> cand_counts;
    for (auto c : counts) cand_counts.push_back(c * g);
    auto loss = gc.step({std::vector<torch::Tensor>{shard(batch.x, counts, r), shard(batch.x_ids, counts, r)},
                         std::vector<torch::Tensor>{shard(batch.y, cand_counts, r), shard(batch.y_ids, cand_counts, r)}});
    expect_match(m.grads(), want, 1e-10, c10::str("grouped, rank ", r));
  }, std::chrono::seconds(15));
}

// Issue 28, item 5: the generators replayed on CUDA. Before, only the CUDA
// devices of a chunk's input tensors were saved: an encoder that moves CPU
// inputs to its GPU, or draws on the current device, replayed a different
// dropout mask in pass 2. The choice of devices is pure and checked here; the
// replay itself runs in tools/gpu_check.sh's suite on a GPU.
TEST(GradCacheRng, CudaGeneratorsOfInputsParametersAndTheCurrentDevice) {
  const c10::Device cpu(torch::kCPU), g0(torch::kCUDA, 0), g1(torch::kCUDA, 1), g2(torch::kCUDA, 2);
  using D = std::vector<c10::Device>;
  EXPECT_EQ(contrax::detail::rng_cuda_devices({cpu, cpu}, c10::nullopt), D{});
  EXPECT_EQ(contrax::detail::rng_cuda_devices({cpu, g1}, c10::nullopt), D{g1});
  // CPU inputs, parameters on cuda:1, current device cuda:0.
  EXPECT_EQ(contrax::detail::rng_cuda_devices({cpu, g1, g1}, g0), (D{g1, g0}));
  EXPECT_EQ(contrax::detail::rng_cuda_devices({g2, cpu, g0, g2}, g0), (D{g2, g0}));
  EXPECT_EQ(contrax::detail::rng_cuda_devices({}, g1), D{g1});
}
