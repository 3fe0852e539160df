// Tests of contrax::GradCache on one process: after one gradient-cache step
// every parameter gradient equals that of one ordinary full-batch step (fp64,
// rel err <= 1e-10) for an MLP encoder with dropout and the CLIP loss with a
// learnable logit scale (parallel/grad_cache_models.h), for any chunk sizes,
// tied encoders, named inputs, the functional form, bf16 autocast; its errors;
// and the CUDA generators its random-state replay saves.
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
//    is not deterministic, so that check is single-rank only
//    (grad_cache_distributed_test.cpp uses the per-example dropout).

#include <gtest/gtest.h>
#include <ATen/autocast_mode.h>

#include <map>

#include "contrax/losses/losses.h"
#include "contrax/losses/maxsim.h"
#include "contrax/parallel/grad_cache.h"
#include "support/errors.h"
#include "support/ranks.h"
#include "parallel/grad_cache_models.h"

using namespace contrax::testing::grad_cache;

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

// Late interaction through the gradient cache: one token tower (per token a
// Linear and tanh) caches its [n, L, d] outputs in chunks of 2 (queries) and
// 3 (documents); maxsim_loss over them gives the full-batch step's gradients.
TEST(GradCache, TokenEmbeddingsThroughMaxSim) {
  torch::manual_seed(0);
  torch::nn::Linear tower(6, 4);
  tower->to(torch::kDouble);
  auto gen = at::detail::createCPUGenerator(2);
  auto xq = torch::randn({7, 3, 6}, gen, torch::kDouble), xd = torch::randn({7, 5, 6}, gen, torch::kDouble);
  const auto encode = [&](const torch::Tensor& x) { return torch::tanh(tower(x)); };
  const auto options = contrax::MaxSimLossOptions().temperature(0.2);
  contrax::maxsim_loss(encode(xq), encode(xd), c10::nullopt, options).backward();
  std::vector<torch::Tensor> want;
  for (const auto& p : tower->parameters()) want.push_back(p.grad().clone());
  tower->zero_grad();
  const contrax::EncoderFn forward = [&](const contrax::BatchInput& in) -> c10::IValue { return encode(in.tensor()); };
  contrax::GradCache gc({contrax::GradCacheEncoder(forward, 2), contrax::GradCacheEncoder(forward, 3)},
                        [&](const std::vector<torch::Tensor>& r) {
                          return contrax::maxsim_loss(r[0], r[1], c10::nullopt, options);
                        });
  gc.step({xq, xd});
  const auto got = tower->parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LE((got[i].grad() - want[i]).abs().max().item<double>() / want[i].abs().max().item<double>(), 1e-10);
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
