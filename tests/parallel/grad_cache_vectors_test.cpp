// contrax::GradCache against the gradient cache's shared test vectors
// (tests/vectors/grad_cache.json, written by tools/gen_grad_cache_vectors.py
// from plain PyTorch), the same file python/tests/test_grad_cache_vectors.py
// checks contrax.GradCache against: the rows of every encoder call for each
// chunking, the loss and gradients any chunking must give, torch's dropout
// replayed from the saved random state, and on thread ranks with uneven rows
// and an empty one, the same gradients with each DataParallel module
// synchronised once per step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "contrax/losses/losses.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "support/errors.h"
#include "support/ranks.h"

namespace {

using json = nlohmann::json;

const json& vectors() {
  static const json v = [] {
    const std::string path = std::string(CONTRAX_TEST_SOURCE_DIR) + "/vectors/grad_cache.json";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    return json::parse(in);
  }();
  return v;
}

// A JSON number, list of numbers, or list of rows as an fp64 tensor.
torch::Tensor tensor_of(const json& j) {
  if (j.is_number()) return torch::tensor(j.get<double>(), torch::kDouble);
  if (!j.at(0).is_array()) return torch::tensor(j.get<std::vector<double>>(), torch::kDouble);
  std::vector<torch::Tensor> rows;
  for (const auto& row : j) rows.push_back(tensor_of(row));
  return torch::stack(rows);
}

std::vector<int64_t> ints(const json& j) { return j.get<std::vector<int64_t>>(); }

// The vectors' model: towers a and b (linear) and the loss module holding the
// log-scale, in fp64, with the parameters the file gives.
struct Model {
  torch::nn::Linear a{nullptr}, b{nullptr};
  contrax::ClipLoss clip{nullptr};

  explicit Model(const contrax::CommunicatorPtr& comm = nullptr) {
    const auto& v = vectors();
    torch::NoGradGuard no_grad;
    for (auto* t : {&a, &b}) {
      const auto& p = v.at("towers").at(t == &a ? "a" : "b");
      auto w = tensor_of(p.at("weight"));
      *t = torch::nn::Linear(torch::nn::LinearOptions(w.size(1), w.size(0)));
      (*t)->to(torch::kDouble);
      (*t)->weight.copy_(w);
      (*t)->bias.copy_(tensor_of(p.at("bias")));
    }
    clip = contrax::ClipLoss(contrax::ClipLossOptions().normalize(true).comm(comm));
    clip->to(torch::kDouble);
    clip->logit_scale.fill_(v.at("log_scale").get<double>());
  }
  std::map<std::string, torch::Tensor> grads() const {
    return {{"a.weight", a->weight.grad()}, {"a.bias", a->bias.grad()}, {"b.weight", b->weight.grad()},
            {"b.bias", b->bias.grad()},     {"log_scale", clip->logit_scale.grad()}};
  }
  contrax::RepresentationLossFn loss() const {
    return [clip = clip](const std::vector<torch::Tensor>& r) { return clip.ptr()->forward(r[0], r[1]); };
  }
};

void expect_expected(const Model& m, const json& expected, const std::string& what) {
  const double tol = vectors().at("tolerance").get<double>();
  const auto grads = m.grads();
  ASSERT_EQ(grads.size(), expected.at("grads").size()) << what;
  for (const auto& [name, grad] : grads) {
    ASSERT_TRUE(grad.defined()) << what << ": " << name << " has no gradient";
    EXPECT_LE(contrax::testing::rel_err(grad, tensor_of(expected.at("grads").at(name))), tol) << what << ": " << name;
  }
}

torch::Tensor input(const char* name) { return tensor_of(vectors().at("inputs").at(name)); }

TEST(GradCacheVectors, EveryChunkingCallsTheEncodersOnTheRowsAndGivesTheGradients) {
  const auto& v = vectors();
  for (const auto& c : v.at("chunking")) {
    const auto sizes = ints(c.at("chunk_sizes"));
    const std::string what = "chunk sizes " + c.at("chunk_sizes").dump();
    Model m;
    std::vector<int64_t> calls_a, calls_b;
    contrax::GradCacheEncoder ea(
        [&](const contrax::BatchInput& x) -> c10::IValue {
          calls_a.push_back(x.rows());
          return m.a->forward(x.tensor());
        },
        sizes[0]);
    contrax::GradCacheEncoder eb(
        [&](const contrax::BatchInput& x) -> c10::IValue {
          calls_b.push_back(x.rows());
          return m.b->forward(x.tensor());
        },
        sizes[1]);
    contrax::GradCache gc({ea, eb}, m.loss());
    const auto loss = gc.step({input("x"), input("y")});
    EXPECT_EQ(calls_a, ints(c.at("calls").at("a"))) << what;
    EXPECT_EQ(calls_b, ints(c.at("calls").at("b"))) << what;
    EXPECT_NEAR(loss.item<double>(), v.at("expected").at("loss").get<double>(), 1e-12) << what;
    expect_expected(m, v.at("expected"), what);
  }
}

TEST(GradCacheVectors, DropoutIsReplayedFromTheSavedRandomState) {
  const auto& r = vectors().at("rng_replay");
  const auto sizes = ints(r.at("chunk_sizes"));
  const double p = r.at("dropout").get<double>();
  Model m;
  contrax::GradCacheEncoder ea(
      [&](const contrax::BatchInput& x) -> c10::IValue {
        return torch::dropout(m.a->forward(x.tensor()), p, /*train=*/true);
      },
      sizes[0]);
  contrax::GradCache gc({ea, contrax::GradCacheEncoder(m.b, sizes[1])}, m.loss());
  torch::manual_seed(r.at("seed").get<uint64_t>());
  const auto loss = gc.step({input("x"), input("y")});
  EXPECT_NEAR(loss.item<double>(), r.at("expected").at("loss").get<double>(), 1e-12);
  expect_expected(m, r.at("expected"), "rng replay");
}

TEST(GradCacheVectors, DataParallelRanksGetTheGradientsWithOneSynchronisationPerStep) {
  const auto& v = vectors();
  for (const auto& c : v.at("ddp")) {
    const auto counts = ints(c.at("rows"));
    const auto sizes = ints(c.at("chunk_sizes"));
    const int64_t per_step = c.at("synchronised_backwards_per_step").get<int64_t>();
    const std::string what = "rows " + c.at("rows").dump();
    contrax::testing::run_ranks(static_cast<int64_t>(counts.size()), [&](const contrax::CommunicatorPtr& comm) {
      Model m(comm);
      auto opts = contrax::DataParallelOptions().bucket_bytes(64).first_bucket_bytes(32);  // several buckets
      auto dp_a = std::make_shared<contrax::DataParallel>(m.a, comm, opts);
      auto dp_b = std::make_shared<contrax::DataParallel>(m.b, comm, opts);
      auto dp_loss = std::make_shared<contrax::DataParallel>(m.clip, comm, opts);
      contrax::GradCache gc({contrax::GradCacheEncoder(m.a, sizes[0]).data_parallel(dp_a),
                             contrax::GradCacheEncoder(m.b, sizes[1]).data_parallel(dp_b)},
                            m.loss(), contrax::GradCacheOptions().loss_data_parallel(dp_loss));
      const int64_t before = comm->stats().op("reducer_all_reduce").calls;
      gc.step({contrax::testing::shard(input("x"), counts, comm->rank()),
               contrax::testing::shard(input("y"), counts, comm->rank())});
      const int64_t calls = comm->stats().op("reducer_all_reduce").calls - before;
      const std::string rank = what + ", rank " + std::to_string(comm->rank());
      expect_expected(m, v.at("expected"), rank);
      for (const auto* dp : {dp_a.get(), dp_b.get(), dp_loss.get()}) EXPECT_EQ(dp->sync_count(), per_step) << rank;
      // Each bucket of each module all-reduced in that one synchronised backward.
      EXPECT_EQ(calls, per_step * (dp_a->num_buckets() + dp_b->num_buckets() + dp_loss->num_buckets())) << rank;
    }, std::chrono::seconds(15));
  }
}

}  // namespace
