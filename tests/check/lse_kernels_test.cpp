// The engine's fused element-wise kernels (src/engine/lse_kernels.h)
// against fp64 references: the vectorised exp, the row/column log-sum-exps
// (row blocks, the column split across threads, masked and non-finite
// entries) and the in-place softmax gradient, and the fused path of every
// loss against the ATen path it replaces (which CUDA tensors still take).
#include "engine/lse_kernels.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <string>

#include "contrax/check/verify.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "support/ranks.h"

namespace {

using contrax::detail::fused_exp;
using contrax::detail::softmax_grad_;
using contrax::detail::tile_lse;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Restores the kernels switch, instruction set and thread count a test changes.
struct Restore {
  bool fused = contrax::detail::fused_kernels_enabled();
  std::string isa = contrax::detail::fused_kernels_isa();
  int threads = at::get_num_threads();
  ~Restore() {
    contrax::detail::set_fused_kernels_enabled(fused);
    contrax::detail::set_fused_kernels_isa(isa);
    at::set_num_threads(threads);
  }
};

// Runs `fn` once per instruction set this machine runs (each compiled table
// is its own code: the vector width changes every loop's tail).
template <typename Fn>
void for_each_isa(Fn fn) {
  Restore restore;
  int ran = 0;
  for (const char* isa : {"baseline", "avx2", "avx512"}) {
    if (!contrax::detail::set_fused_kernels_isa(isa)) continue;
    SCOPED_TRACE(isa);
    fn();
    ++ran;
  }
  EXPECT_GE(ran, 1);
}

// for_each_isa, each time on 1 and then 2 threads; the generator seeded with
// `seed`, where given, once per instruction set.
template <typename Fn>
void for_each_isa_and_thread_count(std::optional<uint64_t> seed, Fn fn) {
  for_each_isa([&] {
    Restore restore;
    if (seed) torch::manual_seed(*seed);
    for (int threads : {1, 2}) {
      at::set_num_threads(threads);
      fn();
    }
  });
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  // Equal infinities (and both NaN) count as no difference.
  auto same = (x == y) | (torch::isnan(x) & torch::isnan(y));
  auto d = (x - y).abs().masked_fill(same, 0.0);
  return d.numel() ? d.max().item<double>() : 0.0;
}

// The largest |a - b| / (1 + |b|): absolute near 0, relative for large values
// (a float log-sum-exp near -1000 carries an ulp of 6e-5).
double max_scaled_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  auto same = (x == y) | (torch::isnan(x) & torch::isnan(y));
  auto d = ((x - y).abs() / (y.abs() + 1.0)).masked_fill(same, 0.0);
  return d.numel() ? d.max().item<double>() : 0.0;
}

TEST(LseKernels, ReportsAndSwitchesTheInstructionSet) {
  Restore restore;
  const std::string isa = contrax::detail::fused_kernels_isa();
  EXPECT_TRUE(isa == "avx512" || isa == "avx2" || isa == "baseline") << isa;
  EXPECT_TRUE(contrax::detail::set_fused_kernels_isa("baseline"));  // every CPU runs it
  EXPECT_STREQ(contrax::detail::fused_kernels_isa(), "baseline");
  EXPECT_FALSE(contrax::detail::set_fused_kernels_isa("sse9"));
  EXPECT_STREQ(contrax::detail::fused_kernels_isa(), "baseline");
}

// The CUDA panel kernels are opt-in until a GPU check passes them: off unless
// CONTRAX_FUSED_KERNELS=1 (CTest runs this without it), and switching them on
// changes nothing for CPU tiles.
TEST(LseKernels, CudaPanelKernelsAreOptInAndLeaveCpuTilesAlone) {
  const char* env = std::getenv("CONTRAX_FUSED_KERNELS");
  const bool asked = env != nullptr && std::string(env) == "1";
  EXPECT_EQ(contrax::detail::cuda_fused_kernels_enabled(), asked);
  const bool was = contrax::detail::cuda_fused_kernels_enabled();
  auto t = torch::randn({70, 90}, torch::kDouble);
  contrax::detail::set_cuda_fused_kernels_enabled(false);
  auto off = tile_lse(t, true, true);
  contrax::detail::set_cuda_fused_kernels_enabled(true);
  EXPECT_TRUE(contrax::detail::cuda_fused_kernels_enabled());
  auto on = tile_lse(t, true, true);
  contrax::detail::set_cuda_fused_kernels_enabled(was);
  EXPECT_TRUE(torch::equal(on.row, off.row));
  EXPECT_TRUE(torch::equal(on.col, off.col));
}

TEST(LseKernels, VectorExpIsWithinThreeUlpOverTheWholeRange) {
  for_each_isa([&] {
    auto x = torch::linspace(-110.0, 90.0, 200001, torch::kFloat);
    auto y = fused_exp(x).to(torch::kDouble);
    auto want = x.to(torch::kDouble).exp();
    // Relative error where the result is a normal float; absolute (below the
    // smallest normal) where it is denormal or zero.
    const double tiny = std::numeric_limits<float>::min();
    auto normal = (want >= tiny) & (want <= std::numeric_limits<float>::max());
    auto rel = ((y - want).abs() / want).masked_select(normal);
    EXPECT_LT(rel.max().item<double>(), 3 * 1.2e-7);
    auto sub = want < tiny;
    EXPECT_LT((y - want).abs().masked_select(sub).max().item<double>(), tiny);
    auto special = fused_exp(torch::tensor({-INFINITY, INFINITY, NAN, 0.0f, 89.0f, -200.0f}, torch::kFloat));
    auto s = special.accessor<float, 1>();
    EXPECT_EQ(s[0], 0.0f);
    EXPECT_EQ(s[1], INFINITY);
    EXPECT_TRUE(std::isnan(s[2]));
    EXPECT_EQ(s[3], 1.0f);
    EXPECT_EQ(s[4], INFINITY);  // e^89 > FLT_MAX
    EXPECT_EQ(s[5], 0.0f);
  });
}

// fp64 reference: logsumexp of rows and columns, -inf for empty or all -inf.
torch::Tensor ref_lse(const torch::Tensor& t, int64_t dim) {
  auto x = t.to(torch::kDouble);
  if (x.size(dim) == 0) return torch::full({x.size(1 - dim)}, -kInf, x.options());
  return x.logsumexp(dim);
}

void expect_lse_matches(const torch::Tensor& t, double tol) {
  auto got = tile_lse(t, true, true);
  ASSERT_TRUE(got.row.defined() && got.col.defined());
  EXPECT_EQ(got.row.scalar_type(), t.scalar_type());
  EXPECT_LE(max_scaled_diff(got.row, ref_lse(t, 1)), tol) << "rows of " << t.sizes();
  EXPECT_LE(max_scaled_diff(got.col, ref_lse(t, 0)), tol) << "columns of " << t.sizes();
  auto rows_only = tile_lse(t, true, false);
  EXPECT_FALSE(rows_only.col.defined());
  EXPECT_LE(max_scaled_diff(rows_only.row, ref_lse(t, 1)), tol);
  auto cols_only = tile_lse(t, false, true);
  EXPECT_FALSE(cols_only.row.defined());
  EXPECT_LE(max_scaled_diff(cols_only.col, ref_lse(t, 0)), tol);
}

TEST(LseKernels, TileLseMatchesFp64AtEveryShapeDtypeAndThreadCount) {
  for_each_isa_and_thread_count(0, [&] {
    // Shapes: lane tails, one row/column, empty, several ~1 MiB row blocks
    // (600 x 1000 fp32), and a tile large enough for the column split.
    for (auto shape : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {3, 17}, {17, 3}, {0, 5}, {5, 0}, {64, 33}, {600, 1000}, {300, 1000}}) {
      for (auto dt : {torch::kFloat, torch::kDouble}) {
        auto t = torch::randn({shape.first, shape.second}, torch::TensorOptions().dtype(dt)) * 20.0;
        expect_lse_matches(t, dt == torch::kFloat ? 2e-5 : 1e-12);
      }
    }
  });
}

TEST(LseKernels, MaskedAndLateColumnsAndStridedTiles) {
  for_each_isa_and_thread_count(std::nullopt, [&] {
    for (auto dt : {torch::kFloat, torch::kDouble}) {
      const double tol = dt == torch::kFloat ? 2e-5 : 1e-12;
      auto t = torch::randn({700, 1000}, torch::TensorOptions().dtype(dt)) * 5.0;
      t.index_put_({3}, -kInf);     // a row masked throughout
      t.select(1, 7).fill_(-kInf);  // a column masked throughout
      t.diagonal().fill_(-kInf);    // a masked self column per row
      // A column that is -inf in the first row blocks and far below 0 later:
      // its shift must follow its own maximum, not stay at 0.
      auto late = t.select(1, 11);
      late.narrow(0, 0, 500).fill_(-kInf);
      late.narrow(0, 500, 200).copy_(torch::randn({200}, t.options()) - 1000.0);
      expect_lse_matches(t, tol);
      auto got = tile_lse(t, true, true);
      EXPECT_EQ(got.row[3].item<double>(), -kInf);
      EXPECT_EQ(got.col[7].item<double>(), -kInf);
      EXPECT_NEAR(got.col[11].item<double>(), ref_lse(t, 0)[11].item<double>(), 1e-3);
      // A tile of a larger buffer (row stride > columns) and a transposed view
      // (the ATen path).
      expect_lse_matches(t.narrow(1, 100, 513).narrow(0, 5, 300), tol);
      expect_lse_matches(t.t(), tol);
    }
  });
}

TEST(LseKernels, NonFiniteEntriesPropagateAsInAten) {
  for_each_isa([&] {
    for (auto dt : {torch::kFloat, torch::kDouble}) {
      auto t = torch::randn({40, 50}, torch::TensorOptions().dtype(dt));
      t.index_put_({2, 3}, NAN);
      t.index_put_({5, 6}, INFINITY);
      auto got = tile_lse(t, true, true);
      EXPECT_TRUE(std::isnan(got.row[2].item<double>()));
      EXPECT_TRUE(std::isnan(got.col[3].item<double>()));
      // +inf: the row's log-sum-exp is +inf or NaN (as in ATen), never finite.
      EXPECT_FALSE(std::isfinite(got.row[5].item<double>()));
      EXPECT_FALSE(std::isfinite(got.col[6].item<double>()));
      EXPECT_TRUE(std::isfinite(got.row[0].item<double>()));
    }
  });
}

TEST(LseKernels, SoftmaxGradMatchesTheAtenFormWithAndWithoutWeights) {
  for_each_isa_and_thread_count(1, [&] {
    for (auto dt : {torch::kFloat, torch::kDouble}) {
      const double tol = dt == torch::kFloat ? 1e-6 : 1e-15;
      auto opt = torch::TensorOptions().dtype(dt);
      auto t = torch::randn({257, 301}, opt) * 4.0;
      t.diagonal().fill_(-kInf);
      auto lr = ref_lse(t, 1).to(dt), lc = ref_lse(t, 0).to(dt);
      auto wr = torch::rand({257}, opt), wc = torch::rand({301}, opt);
      for (int form = 0; form < 4; ++form) {
        const bool col = form & 1, weights = form & 2;
        torch::Tensor want, got;
        for (bool fused : {false, true}) {
          contrax::detail::set_fused_kernels_enabled(fused);
          auto x = t.clone();
          softmax_grad_(x, lr, weights ? wr : torch::Tensor(), col ? lc : torch::Tensor(),
                        col && weights ? wc : torch::Tensor());
          (fused ? got : want) = x;
        }
        EXPECT_LE(max_abs_diff(got, want), tol) << "form " << form << " dtype " << dt;
        // Rows of a row softmax sum to their weight.
        if (form == 0) {
          EXPECT_LE(max_abs_diff(got.sum(1), torch::ones({257}, opt)), dt == torch::kFloat ? 1e-5 : 1e-13);
        }
      }
    }
  });
}

TEST(LseKernels, ExpRowsAndScaleMatchTheAtenForm) {
  for_each_isa([&] {
    for (auto dt : {torch::kFloat, torch::kDouble}) {
      const double tol = dt == torch::kFloat ? 1e-6 : 1e-15;
      auto opt = torch::TensorOptions().dtype(dt);
      auto t = torch::rand({70, 133}, opt) * 20.0 - 10.0;  // within [-10, 10]: shift 10 is a bound
      t.diagonal().fill_(-kInf);
      auto a = torch::rand({70}, opt), b = torch::rand({133}, opt);
      torch::Tensor want_e, want_s, got_e, got_s, want_g, got_g;
      for (bool fused : {false, true}) {
        contrax::detail::set_fused_kernels_enabled(fused);
        auto e = t.clone();
        auto sums = contrax::detail::exp_rows_(e, 10.0);
        auto g = e.clone();
        contrax::detail::scale_rows_plus_cols_(g, a, b);
        (fused ? got_e : want_e) = e;
        (fused ? got_s : want_s) = sums;
        (fused ? got_g : want_g) = g;
      }
      EXPECT_LE(max_abs_diff(got_e, want_e), tol);
      EXPECT_LE(max_abs_diff(got_s, want_s), tol * 133);
      EXPECT_LE(max_abs_diff(got_g, want_g), tol * 2);
      EXPECT_LE(max_abs_diff(got_e, (t.to(torch::kDouble) - 10.0).exp()), tol);
    }
  });
}

// Matryoshka's shared-pass kernels (engine/prefix_block.h) against their
// ATen form: the scaled logits (through a strided panel) and the backward's
// sums, on a tile wide enough to be split by columns across two threads;
// and, under a bound, the statistics and the gradient without the logits
// written.
TEST(LseKernels, PrefixKernelsMatchTheAtenForm) {
  for_each_isa_and_thread_count(11, [&] {
    for (auto dt : {torch::kFloat, torch::kDouble}) {
      const double tol = dt == torch::kFloat ? 1e-5 : 1e-13;
      auto opt = torch::TensorOptions().dtype(dt);
      auto x = (torch::rand({300, 1030}, opt) * 4.0 - 2.0).narrow(1, 3, 1021);  // row stride 1030
      auto g = torch::randn({300, 1021}, opt);
      auto a = torch::rand({300}, opt) + 0.5, b = torch::rand({1021}, opt) + 0.5;
      const auto k = torch::tensor(0.75, opt);
      std::vector<torch::Tensor> out[2];
      for (bool fused : {false, true}) {
        contrax::detail::set_fused_kernels_enabled(fused);
        auto t = torch::empty({300, 1021}, opt);
        contrax::detail::scaled_logits_out(t, x, a, b, -1.5);
        auto h = x.clone(), col = torch::zeros({1021}, opt);
        const auto sums = contrax::detail::raw_products_grad_(h, g, a, b, k, col);
        // Under the bound 4 of |a b x - 1.5|: the statistics, and the
        // gradient's sums and H added into h2 (in place into h3).
        auto col_e = torch::full({1021}, 0.5, opt), col_b = torch::zeros({1021}, opt);
        const auto rows_e = contrax::detail::scaled_exp_sums(x, a, b, -1.5, 4.0, col_e);
        auto h2 = torch::ones({300, 1021}, opt), h3 = x.clone(), col_h3 = torch::zeros({1021}, opt);
        const auto u = a * 0.5, v = b - 0.25;
        const auto bs = contrax::detail::bounded_raw_products_grad(x, h2, a, b, -1.5, 4.0, u, v, k, true, col_b);
        contrax::detail::bounded_raw_products_grad(h3, h3, a, b, -1.5, 4.0, u, v, k, false, col_h3);
        out[fused] = {t, h, col, sums.gx, sums.g, rows_e, col_e, h2, h3, col_b, bs.gx, bs.g};
      }
      const auto x64 = x.to(torch::kDouble), g64 = g.to(torch::kDouble);
      const auto a64 = a.to(torch::kDouble).unsqueeze(1), b64 = b.to(torch::kDouble).unsqueeze(0);
      const auto e64 = (a64 * b64 * x64 - 1.5 - 4.0).exp(), ge = e64 * (a64 * 0.5 + b64 - 0.25);
      const std::vector<torch::Tensor> want{a64 * b64 * x64 - 1.5, 0.75 * a64 * b64 * g64,
                                            (g64 * x64 * a64).sum(0), (g64 * x64 * b64).sum(1), g64.sum(1),
                                            e64.sum(1), e64.sum(0) + 0.5, 1.0 + 0.75 * a64 * b64 * ge,
                                            0.75 * a64 * b64 * ge, (ge * x64 * a64).sum(0), (ge * x64 * b64).sum(1),
                                            ge.sum(1)};
      for (size_t i = 0; i < want.size(); ++i) {
        const double scale = std::max(1.0, want[i].abs().max().item<double>());
        EXPECT_LE(max_abs_diff(out[1][i], want[i]) / scale, tol) << "output " << i << " dtype " << dt;
        EXPECT_LE(max_abs_diff(out[0][i], want[i]) / scale, tol) << "ATen output " << i << " dtype " << dt;
      }
    }
  });
}

// The bounded shift (a known bound of the logits as every softmax's shift: one
// exponential per logit forward, none backward) against the general path on
// the same inputs, fp64: CLIP symmetric (also with Matryoshka prefixes) and
// one-directional with a bias, per-row weights and duplicate masking, grouped candidates, NT-Xent (mean
// and per-example), MoCo v3; values and every gradient.
TEST(LseKernels, BoundedShiftEqualsTheGeneralPath) {
  Restore restore;
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  torch::manual_seed(4);
  auto a0 = torch::randn({29, 8}, opt), b0 = torch::randn({29, 8}, opt), c0 = torch::randn({58, 8}, opt);
  auto labels = torch::randint(0, 6, {29}, torch::kLong), w = torch::rand({29}, opt);
  using contrax::MemoryPath;
  using contrax::Reduction;
  std::vector<std::pair<std::string, std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                                                 const torch::Tensor&, const torch::Tensor&)>>>
      cases = {
          {"clip",
           [&](auto& a, auto& b, auto& s, auto& bias) {
             return contrax::clip_loss(a, b, s, bias,
                                       contrax::ClipLossOptions().normalize(true).path(MemoryPath::kMaterialised));
           }},
          {"clip_matryoshka",  // the shared pass (engine/prefix_block.h)
           [&](auto& a, auto& b, auto& s, auto& bias) {
             return contrax::clip_loss(
                 a, b, s, bias,
                 contrax::ClipLossOptions().matryoshka_dims({2, 5}).path(MemoryPath::kMaterialised));
           }},
          {"clip_raw_weighted",
           [&](auto& a, auto& b, auto& s, auto& bias) {
             auto rows = contrax::clip_loss(
                 a, b, s, bias, contrax::ClipLossOptions().path(MemoryPath::kMaterialised).reduction(Reduction::kNone));
             return (rows * w).sum();
           }},
          {"infonce_masked",
           [&](auto& a, auto& b, auto& s, auto& bias) {
             return contrax::clip_loss(a, b, s, bias,
                                       contrax::ClipLossOptions()
                                           .symmetric(false)
                                           .normalize(true)
                                           .labels(labels)
                                           .label_mode(contrax::LabelMode::kMaskDuplicates)
                                           .path(MemoryPath::kMaterialised));
           }},
          {"grouped",
           [&](auto& a, auto& b, auto& s, auto& bias) {
             return contrax::grouped_loss(
                 a, torch::cat({b, b.flip(0)}, 1).view({58, 8}), s, bias,
                 contrax::GroupedLossOptions().normalize(true).path(MemoryPath::kMaterialised));
           }},
          {"nt_xent",
           [&](auto& a, auto& b, auto&, auto&) {
             return contrax::nt_xent_loss(a, b, contrax::NTXentLossOptions().path(MemoryPath::kMaterialised));
           }},
          {"nt_xent_weighted",
           [&](auto& a, auto& b, auto&, auto&) {
             auto rows = contrax::nt_xent_loss(
                 a, b, contrax::NTXentLossOptions().path(MemoryPath::kMaterialised).reduction(Reduction::kNone));
             return (rows * w).sum();
           }},
          {"moco_v3",
           [&](auto& a, auto& b, auto&, auto&) {
             return contrax::moco_v3_loss(
                 a, b, b.detach(), a.detach(),
                 contrax::MocoV3LossOptions().temperature(0.2).path(MemoryPath::kMaterialised));
           }},
      };
  int differing = 0;  // cases whose two paths differ in the last bits: both really ran
  for (const auto& c : cases) {
    std::vector<torch::Tensor> out[2];
    for (bool bounded : {false, true}) {
      contrax::detail::set_bounded_shift_enabled(bounded);
      auto a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      auto s = torch::tensor(std::log(1 / 0.07), opt).requires_grad_(true);
      auto bias = torch::tensor(-0.5, opt).requires_grad_(true);
      auto loss = c.second(a, b, s, bias);
      loss.backward();
      auto grad = [](const torch::Tensor& t) { return t.grad().defined() ? t.grad() : torch::zeros_like(t); };
      out[bounded] = {loss.detach(), grad(a), grad(b), grad(s), grad(bias)};
    }
    bool differs = false;
    for (size_t i = 0; i < out[0].size(); ++i) {
      EXPECT_LE(max_scaled_diff(out[1][i], out[0][i]), 1e-12) << c.first << " output " << i;
      differs = differs || !torch::equal(out[1][i], out[0][i]);
    }
    differing += differs;
  }
  EXPECT_GE(differing, 5) << "the bounded shift changed almost nothing: did it run?";
  // fp32 at CLIP's initial scale: the same to fp32 rounding.
  for (bool bounded : {false, true}) {
    contrax::detail::set_bounded_shift_enabled(bounded);
    auto a = a0.to(torch::kFloat), b = b0.to(torch::kFloat);
    auto l = contrax::clip_loss(a, b, torch::tensor(std::log(1 / 0.07f)), {},
                                contrax::ClipLossOptions().normalize(true).path(MemoryPath::kMaterialised));
    static double first = 0;
    if (!bounded) first = l.item<double>();
    if (bounded) EXPECT_NEAR(l.item<double>(), first, 1e-5);
  }
}

// contrax verify's whole table at W = 3 with an empty rank, general path and
// bounded shift: both exact against the single-device reference.
TEST(LseKernels, VerifyTableIsExactWithAndWithoutTheBoundedShift) {
  Restore restore;
  for (bool bounded : {false, true}) {
    contrax::detail::set_bounded_shift_enabled(bounded);
    std::mutex mu;
    std::vector<contrax::VerifyResult> all;
    contrax::testing::run_ranks(3, [&](const contrax::CommunicatorPtr& comm) {
      auto r = contrax::verify(comm, contrax::VerifyOptions().rows({4, 0, 3}));
      std::lock_guard<std::mutex> lock(mu);
      all.insert(all.end(), r.begin(), r.end());
    });
    EXPECT_GE(all.size(), 3u * 20);
    for (const auto& x : all) {
      EXPECT_TRUE(x.passed) << x.loss << " max rel err " << x.max_rel_err << " (" << x.worst << "), bounded shift "
                            << bounded;
    }
  }
}

// Every loss through the fused kernels equals the ATen path (CUDA's) in fp64
// to rounding, value and gradients, materialised and tiled.
TEST(LseKernels, LossesAgreeWithTheAtenPath) {
  Restore restore;
  torch::manual_seed(2);
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  auto a0 = torch::randn({37, 8}, opt), b0 = torch::randn({37, 8}, opt);
  for (int64_t tile : {int64_t{0}, int64_t{16}}) {  // 0: materialised; 16: tiled, 16 x 16 tiles
    std::vector<torch::Tensor> results[2];
    for (bool fused : {false, true}) {
      contrax::detail::set_fused_kernels_enabled(fused);
      auto a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      auto scale = torch::tensor(2.0, opt).requires_grad_(true);
      const auto path = tile ? contrax::MemoryPath::kTiled : contrax::MemoryPath::kMaterialised;
      auto l1 = contrax::clip_loss(a, b, scale, {}, contrax::ClipLossOptions().path(path).tile_size(tile));
      auto l2 = contrax::nt_xent_loss(a, b, contrax::NTXentLossOptions().path(path).tile_size(tile));
      (l1 + l2).backward();
      results[fused] = {l1.detach(), l2.detach(), a.grad(), b.grad(), scale.grad()};
    }
    for (size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_LE(max_abs_diff(results[1][i], results[0][i]), 1e-13) << "tile " << tile << " output " << i;
    }
  }
}

}  // namespace
