// The gradient-cache tests' models and batches: an MLP encoder whose
// list/named-input forward uses a per-example dropout (support/hashed_dropout.h)
// and whose tensor forward uses torch's, two towers and the CLIP loss module,
// a paired batch, and the ordinary full-batch step the gradient cache must
// match (tests/parallel/grad_cache*_test.cpp, tests/check/grad_cache_verify_test.cpp).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "contrax/losses/losses.h"
#include "contrax/parallel/grad_cache.h"
#include "support/hashed_dropout.h"
#include "support/ranks.h"

namespace contrax::testing::grad_cache {

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

inline Mlp copy_of(const Mlp& m) { return Mlp(std::dynamic_pointer_cast<MlpImpl>(m->clone())); }
inline contrax::ClipLoss copy_of(const contrax::ClipLoss& m) {
  contrax::ClipLoss c(m->options);
  torch::NoGradGuard ng;
  c->to(torch::kDouble);
  c->logit_scale.copy_(m->logit_scale);
  return c;
}

inline std::mutex& init_mutex() {
  static std::mutex m;
  return m;
}

// A paired batch: image-like x [B, 6], text-like y [B, 5], example ids [B].
struct Batch {
  torch::Tensor x, y, ids;
};
inline Batch make_batch(int64_t B, int64_t seed) {
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

inline Models make_models(int64_t seed, bool tied = false) {
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

inline Models copy_of(const Models& m, bool tied = false) {
  Models c;
  c.a = copy_of(m.a);
  c.b = tied ? c.a : copy_of(m.b);
  c.clip = copy_of(m.clip);
  return c;
}

inline void expect_match(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, double tol,
                  const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LE(rel_err(got[i], want[i]), tol) << where << ": parameter " << i;
}

// Ordinary full-batch step; list inputs (per-example dropout). For tied
// towers the second tower's input is x again (same width).
inline torch::Tensor full_batch_step(Models m, const Batch& b, bool tied = false) {
  auto fa = m.a->forward(std::vector<torch::Tensor>{b.x, b.ids});
  auto fb = m.b->forward(std::vector<torch::Tensor>{tied ? b.x * 0.5 : b.y, b.ids + 0.25});
  auto loss = m.clip(fa, fb);
  loss.backward();
  return loss.detach();
}

inline GradCache make_cache(Models m, int64_t chunk_a, int64_t chunk_b, GradCacheOptions options = {}) {
  return GradCache({GradCacheEncoder(m.a, chunk_a).name("a"), GradCacheEncoder(m.b, chunk_b).name("b")},
                   [clip = m.clip](const std::vector<torch::Tensor>& r) { return clip.ptr()->forward(r[0], r[1]); },
                   std::move(options));
}

inline std::vector<BatchInput> list_inputs(const Batch& b, bool tied = false) {
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

}  // namespace contrax::testing::grad_cache
