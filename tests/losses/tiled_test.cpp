// Tiled and ring InfoNCE / CLIP / NT-Xent / MoCo v3 against the materialised
// losses and the single-device reference: values and gradients in fp64 to
// 1e-10 for W = 1..4 with uneven (even empty) ranks, the ring over both of its
// transports (send/receive pairs and one all-to-all), tiles that do not divide
// the batch, 1-row tiles and extreme logits; finite differences for the
// autograd function; every argument error. Each loss takes the tiled path
// with its options' `path(MemoryPath::kTiled)` (the always-tiled entry points
// tiled_clip_loss & co. were removed after their one release).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/tiled.h"
#include "support/errors.h"
#include "support/ranks.h"

namespace {

using contrax::CommunicatorPtr;
using contrax::testing::expect_error;
using contrax::testing::rel_err;
using contrax::testing::run_ranks;
using contrax::testing::shard;
using Tensors = std::vector<torch::Tensor>;

constexpr double kTol = 1e-10;

torch::Tensor randn(std::vector<int64_t> shape) { return torch::randn(shape, torch::kFloat64); }

// A loss's options on the tiled path, with the tiles (and ring) of `t`.
template <typename Options>
Options tiled(Options options, contrax::MemoryPathOptions t = {}) {
  return options.memory(t.path(contrax::MemoryPath::kTiled));
}

// Dense per-row InfoNCE for the core's contract.
torch::Tensor dense_info_nce(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& s,
                             const torch::Tensor& bias, int64_t pos, int64_t masked) {
  auto logits = torch::mm(q, k.t()) * s + bias;  // [b, N]
  const int64_t b = q.size(0);
  auto rows = torch::arange(b);
  if (masked >= 0) {
    auto mask = torch::zeros_like(logits, torch::kBool);
    mask.index_put_({rows, rows + masked}, true);
    logits = logits.masked_fill(mask, -std::numeric_limits<double>::infinity());
  }
  return logits.logsumexp(1) - logits.index({rows, rows + pos});
}

bool close_scalar(const torch::Tensor& a, const torch::Tensor& b, double tol) {
  const double x = a.item<double>(), y = b.item<double>();
  return std::abs(x - y) <= tol * std::max(1.0, std::abs(y));
}

// Runs `dist` on W ranks over shards of `feats` (global [B, d]) and compares the
// averaged loss, the features' gradients (rank r's local gradient is W dL/dx_r
// under the data-parallel convention) and the averaged scalar gradients with
// `ref` on the whole batch.
void expect_exact(int64_t W, const std::vector<int64_t>& counts, const Tensors& feats, const Tensors& scalars,
                  const std::function<torch::Tensor(const Tensors&, const Tensors&, const CommunicatorPtr&)>& dist,
                  const std::function<torch::Tensor(const Tensors&, const Tensors&)>& ref, double tol = kTol,
                  const contrax::testing::ConfigureRank& configure = {}) {
  Tensors rf, rs;
  for (auto& f : feats) rf.push_back(f.detach().clone().requires_grad_(true));
  for (auto& s : scalars) rs.push_back(s.detach().clone().requires_grad_(true));
  auto ref_loss = ref(rf, rs);
  ref_loss.backward();

  std::mutex m;
  std::vector<double> losses(W);
  std::vector<Tensors> fgrads(W), sgrads(W);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    Tensors lf, ls;
    for (auto& f : feats) lf.push_back(shard(f, counts, r).detach().clone().requires_grad_(true));
    for (auto& s : scalars) ls.push_back(s.detach().clone().requires_grad_(true));
    auto loss = dist(lf, ls, comm);
    loss.backward();
    std::lock_guard<std::mutex> lock(m);
    losses[r] = loss.item<double>();
    for (auto& t : lf) fgrads[r].push_back(t.grad().defined() ? t.grad() / static_cast<double>(W) : torch::Tensor());
    for (auto& t : ls) sgrads[r].push_back(t.grad());
  }, std::chrono::seconds(30), configure);
  double mean = 0;
  for (double l : losses) mean += l / static_cast<double>(W);
  EXPECT_LE(std::abs(mean - ref_loss.item<double>()), tol * std::abs(ref_loss.item<double>())) << "loss";
  for (size_t i = 0; i < feats.size(); ++i) {
    if (!rf[i].grad().defined()) {
      for (int64_t r = 0; r < W; ++r) EXPECT_FALSE(fgrads[r][i].defined() && fgrads[r][i].abs().max().item<double>() > 0);
      continue;
    }
    Tensors parts;
    for (int64_t r = 0; r < W; ++r) {
      ASSERT_TRUE(fgrads[r][i].defined()) << "feature " << i << " rank " << r;
      parts.push_back(fgrads[r][i]);
    }
    EXPECT_LE(rel_err(torch::cat(parts, 0), rf[i].grad()), tol) << "feature gradient " << i;
  }
  for (size_t i = 0; i < scalars.size(); ++i) {
    auto sum = torch::zeros({}, torch::kFloat64);
    for (int64_t r = 0; r < W; ++r) sum = sum + sgrads[r][i] / static_cast<double>(W);
    EXPECT_TRUE(close_scalar(sum, rs[i].grad(), tol))
        << "scalar gradient " << i << ": " << sum.item<double>() << " vs " << rs[i].grad().item<double>();
  }
}

const std::vector<std::vector<int64_t>> kCounts = {{7}, {5, 3}, {4, 0, 3}, {3, 1, 4, 2}};
const std::vector<int64_t> kTiles = {1, 3, 0, 2};

// ---------------------------------------------------------------------------
// The core

TEST(TiledInfoNce, MatchesDenseForEveryTileSize) {
  torch::manual_seed(0);
  auto q = randn({7, 5}), k = randn({16, 5});
  auto s = torch::tensor(2.5, torch::kFloat64), bias = torch::tensor(0.3, torch::kFloat64);
  for (int64_t masked : {-1, 9}) {
    for (int64_t tile : {1, 2, 3, 4, 7, 16, 100, 0}) {
      Tensors x = {q.clone().requires_grad_(true), k.clone().requires_grad_(true), s.clone().requires_grad_(true),
                   bias.clone().requires_grad_(true)};
      Tensors y = {q.clone().requires_grad_(true), k.clone().requires_grad_(true), s.clone().requires_grad_(true),
                   bias.clone().requires_grad_(true)};
      auto w = randn({7});
      auto lt = contrax::tiled_info_nce(x[0], x[1], x[2], x[3],
                                        contrax::InfoNceOptions().positive_offset(2).masked_offset(masked).tile_size(tile));
      auto ld = dense_info_nce(y[0], y[1], y[2], y[3], 2, masked);
      EXPECT_LE(rel_err(lt, ld), kTol) << "tile " << tile;
      (lt * w).sum().backward();
      (ld * w).sum().backward();
      for (int i = 0; i < 3; ++i) EXPECT_LE(rel_err(x[i].grad(), y[i].grad()), kTol) << "tile " << tile << " input " << i;
      EXPECT_NEAR(x[3].grad().item<double>(), y[3].grad().item<double>(), 1e-12);
    }
  }
}

TEST(TiledInfoNce, FiniteDifferences) {
  torch::manual_seed(1);
  Tensors in = {randn({4, 3}).requires_grad_(true), randn({9, 3}).requires_grad_(true),
                torch::tensor(1.7, torch::kFloat64).requires_grad_(true),
                torch::tensor(-0.4, torch::kFloat64).requires_grad_(true)};
  auto f = [](const Tensors& x) {
    return contrax::tiled_info_nce(x[0], x[1], x[2], x[3],
                                   contrax::InfoNceOptions().positive_offset(1).masked_offset(5).tile_size(2));
  };
  EXPECT_LE(contrax::testing::finite_difference_error(f, in), 1e-6);
}

TEST(TiledInfoNce, DoubleBackwardIsAnError) {
  auto q = randn({3, 2}).requires_grad_(true), k = randn({3, 2}).requires_grad_(true);
  auto s = torch::tensor(1.0, torch::kFloat64).requires_grad_(true);
  auto l = contrax::tiled_info_nce(q, k, s).sum();
  CONTRAX_EXPECT_ERROR(torch::autograd::grad({l}, {q}, {}, /*retain_graph=*/true, /*create_graph=*/true),
                       "tiled_info_nce(): double backward");
}

TEST(TiledInfoNce, ArgumentErrors) {
  auto q = randn({3, 2}), k = randn({5, 2}), s = torch::tensor(1.0, torch::kFloat64);
  using O = contrax::InfoNceOptions;
  expect_error([&] { contrax::tiled_info_nce(q, k, torch::ones({3}, torch::kFloat64)); },
               "tiled_info_nce(): argument 'scale' must be a 0-dim tensor, but got shape [3]");
  expect_error([&] { contrax::tiled_info_nce(q, randn({5, 3}), s); },
               "tiled_info_nce(): arguments 'q' and 'k' must have the same width");
  expect_error([&] { contrax::tiled_info_nce(q, k.to(torch::kFloat32), s); },
               "tiled_info_nce(): arguments 'q' and 'k' must have the same dtype");
  expect_error([&] { contrax::tiled_info_nce(randn({3}), k, s); }, "tiled_info_nce(): argument 'q' must be a 2-D");
  expect_error([&] { contrax::tiled_info_nce(q, k, s, torch::ones({2}, torch::kFloat64)); },
               "tiled_info_nce(): argument 'bias' must be a 0-dim tensor");
  expect_error([&] { contrax::tiled_info_nce(q, k, s, {}, O().positive_offset(3)); },
               "tiled_info_nce(): argument 'positive_offset' must leave room");
  expect_error([&] { contrax::tiled_info_nce(q, k, s, {}, O().masked_offset(4)); },
               "tiled_info_nce(): argument 'masked_offset' must leave room");
  expect_error([&] { contrax::tiled_info_nce(q, k, s, {}, O().masked_offset(0)); },
               "tiled_info_nce(): argument 'masked_offset' must differ from 'positive_offset'");
  expect_error([&] { contrax::tiled_info_nce(q, k, s, {}, O().tile_size(-1)); },
               "tiled_info_nce(): argument 'tile_size' must be >= 0");
  expect_error([&] { contrax::tiled_info_nce(q, k, s, {}, O().tile_bytes(0)); },
               "tiled_info_nce(): argument 'tile_bytes' must be positive");
}

TEST(TiledLosses, ArgumentErrors) {
  using contrax::MemoryPathOptions;
  auto a = randn({3, 2}), b = randn({3, 2}), ls = torch::tensor(1.0, torch::kFloat64);
  const auto clip = tiled(contrax::ClipLossOptions());
  const auto nt_xent = tiled(contrax::NTXentLossOptions());
  const auto moco = tiled(contrax::MocoV3LossOptions());
  expect_error([&] { contrax::clip_loss(a, b, ls, {}, tiled(clip, MemoryPathOptions().tile_size(-2))); },
               "clip_loss(): argument 'tile_size' must be >= 0 (the tile side; 0 chooses it from tile_bytes), "
               "but got -2");
  expect_error([&] { contrax::clip_loss(a, b, ls, {}, tiled(clip, MemoryPathOptions().tile_bytes(-1))); },
               "clip_loss(): argument 'tile_bytes' must be positive");
  expect_error([&] { contrax::clip_loss(a, randn({4, 2}), ls, {}, clip); },
               "clip_loss(): arguments 'a' and 'b' must have the same number of rows");
  expect_error([&] { contrax::clip_loss(a, b, torch::ones({2}, torch::kFloat64), {}, clip); },
               "clip_loss(): argument 'logit_scale' must be a 0-dim tensor, but got shape [2]");
  expect_error([&] { contrax::nt_xent_loss(a, b, tiled(contrax::NTXentLossOptions().temperature(0))); },
               "nt_xent_loss(): argument 'temperature' must be a positive finite number");
  expect_error([&] { contrax::nt_xent_loss(a, randn({2, 2}), nt_xent); },
               "nt_xent_loss(): argument 'z2' must have the same shape as 'z1'");
  expect_error([&] { contrax::moco_v3_loss(a, a, b, randn({3, 5}), moco); },
               "moco_v3_loss(): argument 'k2' must have the same shape as 'q1'");
  expect_error([&] { contrax::moco_v3_loss(a, a, b, b, tiled(moco, MemoryPathOptions().tile_size(-1))); },
               "moco_v3_loss(): argument 'tile_size' must be >= 0");
  const auto empty = torch::zeros({0, 2}, torch::kFloat64);
  expect_error([&] { contrax::clip_loss(empty, empty, ls, {}, clip); }, "clip_loss(): the global batch is empty");
  expect_error([&] { contrax::clip_loss(a, b, ls, torch::ones({2}, torch::kFloat64), clip); },
               "clip_loss(): argument 'logit_bias' must be a 0-dim tensor");
  expect_error([&] { contrax::clip_loss(a, b, ls, {}, tiled(contrax::ClipLossOptions().max_logit_scale(0))); },
               "clip_loss(): argument 'max_logit_scale' must be a positive finite number");
  expect_error([&] { contrax::nt_xent_loss(a, b, tiled(nt_xent, MemoryPathOptions().tile_size(-1))); },
               "nt_xent_loss(): argument 'tile_size' must be >= 0");
  expect_error([&] { contrax::moco_v3_loss(a, a, b, b, tiled(contrax::MocoV3LossOptions().temperature(-1))); },
               "moco_v3_loss(): argument 'temperature' must be a positive finite number");
}

// A bad argument on one rank is an error on every rank (ring or gather), not a hang.
TEST(TiledLosses, OneRankBadArgumentFailsEveryRank) {
  for (bool ring : {false, true}) {
    auto errors = contrax::testing::run_ranks_collect_errors(2, [&](const CommunicatorPtr& comm) {
      auto a = randn({3, 2});
      auto b = comm->rank() == 1 ? randn({2, 2}) : randn({3, 2});
      contrax::clip_loss(a, b, torch::tensor(0.0, torch::kFloat64), {},
                         tiled(contrax::ClipLossOptions().comm(comm), contrax::MemoryPathOptions().ring(ring)));
    });
    EXPECT_NE(errors[1].find("clip_loss(): arguments 'a' and 'b' must have the same number of rows"),
              std::string::npos)
        << errors[1];
    EXPECT_FALSE(errors[0].empty());
  }
}

// ---------------------------------------------------------------------------
// Single device: tiled equals materialised for every tile size.

TEST(TiledLosses, SingleDeviceMatchesMaterialisedForEveryTile) {
  torch::manual_seed(2);
  auto a = randn({9, 4}), b = randn({9, 4});
  auto ls = torch::tensor(std::log(3.0), torch::kFloat64);
  for (int64_t tile : {1, 2, 4, 5, 9, 64, 0}) {
    contrax::MemoryPathOptions t;
    t.tile_size(tile);
    Tensors x = {a.clone().requires_grad_(true), b.clone().requires_grad_(true), ls.clone().requires_grad_(true)};
    Tensors y = {a.clone().requires_grad_(true), b.clone().requires_grad_(true), ls.clone().requires_grad_(true)};
    auto lt = contrax::clip_loss(x[0], x[1], x[2], {}, tiled(contrax::ClipLossOptions(), t));
    auto lm = contrax::clip_loss(y[0], y[1], y[2]);
    EXPECT_LE(rel_err(lt, lm), kTol);
    lt.backward();
    lm.backward();
    for (int i = 0; i < 3; ++i) EXPECT_LE(rel_err(x[i].grad(), y[i].grad()), kTol) << "tile " << tile;

    auto z1 = a.clone().requires_grad_(true), z2 = b.clone().requires_grad_(true);
    auto w1 = a.clone().requires_grad_(true), w2 = b.clone().requires_grad_(true);
    auto nt = contrax::nt_xent_loss(z1, z2, tiled(contrax::NTXentLossOptions().temperature(0.3), t));
    auto nm = contrax::nt_xent_loss(w1, w2, contrax::NTXentLossOptions().temperature(0.3));
    EXPECT_LE(rel_err(nt, nm), kTol);
    nt.backward();
    nm.backward();
    EXPECT_LE(rel_err(z1.grad(), w1.grad()), kTol);
    EXPECT_LE(rel_err(z2.grad(), w2.grad()), kTol);
  }
}

// ---------------------------------------------------------------------------
// Distributed: gathered tiles and ring, W = 1..4, uneven counts.

// The gathered tiles, the ring over send/receive pairs (Gloo's default), and
// the ring over one all-to-all per step (NCCL's default, run here over Gloo).
enum class Path { kGather, kRing, kRingAllToAll };

class TiledDistributed : public ::testing::TestWithParam<std::tuple<int64_t, Path>> {
 protected:
  // W ranks with kCounts[W - 1] rows (B in all), and the tiles and ring of the
  // path under test.
  void SetUp() override {
    std::tie(W, path) = GetParam();
    for (auto c : kCounts[W - 1]) B += c;
    t.tile_size(kTiles[W - 1]).ring(path != Path::kGather);
  }
  // expect_exact over this world's shards, with the path's ring transport set
  // on every rank's options.
  void expect(const Tensors& feats, const Tensors& scalars,
              const std::function<torch::Tensor(const Tensors&, const Tensors&, const CommunicatorPtr&)>& dist,
              const std::function<torch::Tensor(const Tensors&, const Tensors&)>& ref) {
    const Path p = path;
    expect_exact(W, kCounts[W - 1], feats, scalars, dist, ref, kTol, [p](int64_t, contrax::CommunicatorOptions& o) {
      o.ring_transport(p == Path::kRingAllToAll ? contrax::RingTransport::kAllToAll : contrax::RingTransport::kSendRecv);
    });
  }
  int64_t W = 0, B = 0;
  Path path = Path::kGather;
  contrax::MemoryPathOptions t;
};

TEST_P(TiledDistributed, ClipMatchesReference) {
  torch::manual_seed(10 + W);
  for (bool symmetric : {true, false}) {
    expect(
        {randn({B, 6}), randn({B, 6})},
        {torch::tensor(std::log(4.0), torch::kFloat64), torch::tensor(-0.7, torch::kFloat64)},
        [&](const Tensors& f, const Tensors& s, const CommunicatorPtr& comm) {
          auto o = contrax::ClipLossOptions().comm(comm).symmetric(symmetric).normalize(true);
          auto on_tiles = contrax::clip_loss(f[0], f[1], s[0], s[1], tiled(o, t));
          // The materialised path on the same shards agrees too.
          auto mat = contrax::clip_loss(f[0].detach(), f[1].detach(), s[0].detach(), s[1].detach(), o);
          EXPECT_LE(rel_err(on_tiles.detach(), mat), kTol);
          return on_tiles;
        },
        [&](const Tensors& f, const Tensors& s) {
          return contrax::reference::clip_loss(f[0], f[1], s[0], s[1], symmetric, 100.0, true);
        });
  }
}

TEST_P(TiledDistributed, NTXentMatchesReference) {
  torch::manual_seed(20 + W);
  expect(
      {randn({B, 5}), randn({B, 5})}, {},
      [&](const Tensors& f, const Tensors&, const CommunicatorPtr& comm) {
        return contrax::nt_xent_loss(f[0], f[1], tiled(contrax::NTXentLossOptions().temperature(0.2).comm(comm), t));
      },
      [&](const Tensors& f, const Tensors&) { return contrax::reference::nt_xent_loss(f[0], f[1], 0.2); });
}

TEST_P(TiledDistributed, MocoV3MatchesReference) {
  torch::manual_seed(30 + W);
  expect(
      {randn({B, 4}), randn({B, 4}), randn({B, 4}), randn({B, 4})}, {},
      [&](const Tensors& f, const Tensors&, const CommunicatorPtr& comm) {
        const auto o = contrax::MocoV3LossOptions().temperature(0.2).comm(comm);
        return contrax::moco_v3_loss(f[0], f[1], f[2], f[3], tiled(o, t));
      },
      [&](const Tensors& f, const Tensors&) { return contrax::reference::moco_v3_loss(f[0], f[1], f[2], f[3], 0.2); });
}

// Temperature 0.01 on near-duplicate unit vectors: logits near 100 everywhere,
// differences of 1e-3; the online LSE must neither overflow nor lose accuracy.
TEST_P(TiledDistributed, ExtremeLogits) {
  torch::manual_seed(40 + W);
  auto base = randn({1, 8});
  auto z1 = base + 1e-3 * randn({B, 8}), z2 = base + 1e-3 * randn({B, 8});
  expect(
      {z1, z2}, {},
      [&](const Tensors& f, const Tensors&, const CommunicatorPtr& comm) {
        auto l = contrax::nt_xent_loss(f[0], f[1], tiled(contrax::NTXentLossOptions().temperature(0.01).comm(comm), t));
        EXPECT_TRUE(std::isfinite(l.item<double>()));
        return l;
      },
      [&](const Tensors& f, const Tensors&) { return contrax::reference::nt_xent_loss(f[0], f[1], 0.01); });
  // CLIP at the clamp (scale 100) with unnormalised near-duplicates of norm ~3.
  expect(
      {z1, z2}, {torch::tensor(std::log(100.0), torch::kFloat64)},
      [&](const Tensors& f, const Tensors& s, const CommunicatorPtr& comm) {
        return contrax::clip_loss(f[0], f[1], s[0], {}, tiled(contrax::ClipLossOptions().comm(comm), t));
      },
      [&](const Tensors& f, const Tensors& s) { return contrax::reference::clip_loss(f[0], f[1], s[0], {}); });
}

INSTANTIATE_TEST_SUITE_P(Worlds, TiledDistributed,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(Path::kGather, Path::kRing, Path::kRingAllToAll)),
                         [](const auto& info) {
                           const Path path = std::get<1>(info.param);
                           return "W" + std::to_string(std::get<0>(info.param)) +
                                  (path == Path::kGather ? "_gather" : path == Path::kRing ? "_ring" : "_ring_all_to_all");
                         });

}  // namespace
