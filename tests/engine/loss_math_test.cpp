// The engine's per-element math (src/engine/kernels/loss_math.h), shared by
// the CPU kernels and the CUDA panel kernels, in fp64 (and fp32 where the
// GPU's logits are fp32) at the edges: temperature 0.01 on random-init
// features, fully masked rows, |logit| up to 100, and NaN / inf propagation;
// the gradient elements against autograd.
#include "engine/kernels/loss_math.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

namespace math = contrax::detail::math;
using math::MaxSum;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

template <typename T>
T online_lse(const std::vector<T>& xs) {
  auto p = math::empty_pair<T>();
  for (T x : xs) math::add(p, x);
  return math::finish(p);
}

// log(sum(exp(x))) in long double, shifted by the maximum.
long double reference_lse(const std::vector<double>& xs) {
  long double m = -INFINITY, s = 0;
  for (double x : xs) m = x > m ? x : m;
  for (double x : xs) s += std::exp(static_cast<long double>(x) - m);
  return m + std::log(s);
}

std::vector<double> random_values(int n, double range, uint64_t seed) {
  torch::manual_seed(seed);
  auto t = (torch::rand({n}, torch::kDouble) * 2 - 1) * range;
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + n);
}

TEST(LossMath, OnlineLseMatchesLongDoubleForLogitsUpTo100InAnyOrderAndSplit) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    auto xs = random_values(1 + static_cast<int>(seed) * 37, 100.0, seed);
    const double want = static_cast<double>(reference_lse(xs)), tol = 1e-13 * (1 + std::fabs(want));
    EXPECT_NEAR(online_lse(xs), want, tol);
    // Any split, merged either way round, is the same log-sum-exp.
    const size_t cut = xs.size() / 3;
    auto a = math::empty_pair<double>(), b = math::empty_pair<double>();
    for (size_t i = 0; i < xs.size(); ++i) math::add(i < cut ? a : b, xs[i]);
    EXPECT_NEAR(math::finish(math::merge(a, b)), want, tol);
    EXPECT_NEAR(math::finish(math::merge(b, a)), want, tol);
    // fp32 (the GPU's logits): e^100 and e^-100 are outside fp32's range, the
    // shifted sums are not.
    std::vector<float> xf(xs.begin(), xs.end());
    EXPECT_NEAR(online_lse(xf), want, 2e-5 * (1 + std::fabs(want)));
  }
  // The extreme ends: exactly +-100 and a run of equal maxima.
  EXPECT_NEAR(online_lse<double>({100, -100, 100}), 100 + std::log(2.0 + std::exp(-200.0)), 1e-13);
  EXPECT_NEAR(online_lse<float>({-100, -100, -100}), -100 + std::log(3.0), 1e-5);
}

// Temperature 0.01 on random-init (near-orthogonal, unit) features: logits
// within +-1/T = 100 and far below it (a fixed shift of 1/T, as memeff uses,
// leaves e^(x - 100) ~ e^-100: zero in fp32). The online pair keeps every
// row's log-sum-exp exact in fp64 and within fp32 rounding in fp32.
TEST(LossMath, TemperatureOneHundredthOnRandomInitFeatures) {
  torch::manual_seed(3);
  auto q = torch::nn::functional::normalize(torch::randn({64, 768}, torch::kDouble),
                                            torch::nn::functional::NormalizeFuncOptions().dim(1));
  auto k = torch::nn::functional::normalize(torch::randn({96, 768}, torch::kDouble),
                                            torch::nn::functional::NormalizeFuncOptions().dim(1));
  auto S = q.mm(k.t()) / 0.01;  // [64, 96]
  auto want = S.logsumexp(1);
  for (int64_t i = 0; i < S.size(0); ++i) {
    auto row = S[i].contiguous();
    std::vector<double> xs(row.data_ptr<double>(), row.data_ptr<double>() + row.numel());
    std::vector<float> xf(xs.begin(), xs.end());
    const double w = want[i].item<double>();
    EXPECT_NEAR(online_lse(xs), w, 1e-12);
    EXPECT_NEAR(online_lse(xf), w, 1e-5 * (1 + std::fabs(w)));
    // The row's softmax terms sum to 1 under that log-sum-exp.
    double sum = 0;
    for (double x : xs) sum += math::softmax_term(x, online_lse(xs));
    EXPECT_NEAR(sum, 1.0, 1e-12);
  }
}

TEST(LossMath, FullyMaskedRowsGiveMinusInfAndAZeroGradientWithoutNaN) {
  EXPECT_EQ(online_lse<double>({}), -kInf);
  EXPECT_EQ(online_lse<double>({-kInf, -kInf, -kInf}), -kInf);
  EXPECT_EQ(online_lse<float>({-INFINITY}), -INFINITY);
  auto e = math::empty_pair<double>();
  EXPECT_EQ(math::finish(math::merge(e, e)), -kInf);
  EXPECT_EQ(math::shift_of(-kInf), 0.0);
  // A masked entry of a fully masked row (lse = -inf) in either direction.
  EXPECT_EQ(math::softmax_term(-kInf, -kInf), 0.0);
  EXPECT_EQ(math::contrastive_grad(-kInf, -kInf, 0.5, true, -kInf, 2.0, false), 0.0);
  EXPECT_EQ(math::contrastive_grad(-INFINITY, -INFINITY, 1.0f, false, 0.0f, 1.0f, false), 0.0f);
  // Merging a masked part into a live one changes nothing.
  auto live = math::empty_pair<double>();
  math::add(live, 1.5);
  EXPECT_EQ(math::finish(math::merge(live, e)), 1.5);
  EXPECT_EQ(math::finish(math::merge(e, live)), 1.5);
}

TEST(LossMath, NaNAndInfPropagateAsInAten) {
  // NaN anywhere: NaN, whatever comes before or after, merged either way.
  EXPECT_TRUE(std::isnan(online_lse<double>({1.0, kNaN, 2.0})));
  EXPECT_TRUE(std::isnan(online_lse<double>({kNaN})));
  EXPECT_TRUE(std::isnan(online_lse<double>({-kInf, kNaN})));
  EXPECT_TRUE(std::isnan(online_lse<double>({kInf, kNaN, 3.0})));
  EXPECT_TRUE(std::isnan(online_lse<float>({1.0f, NAN})));
  // +inf: +inf (torch.logsumexp gives inf), also with several +inf.
  EXPECT_EQ(online_lse<double>({1.0, kInf, 2.0}), kInf);
  EXPECT_EQ(online_lse<double>({kInf, kInf}), kInf);
  EXPECT_EQ(online_lse<double>({-kInf, kInf}), kInf);
  auto a = math::empty_pair<double>(), b = math::empty_pair<double>(), n = math::empty_pair<double>();
  math::add(a, kInf);
  math::add(b, kInf);
  math::add(n, kNaN);
  EXPECT_EQ(math::finish(math::merge(a, b)), kInf);
  EXPECT_TRUE(std::isnan(math::finish(math::merge(a, n))));
  EXPECT_TRUE(std::isnan(math::finish(math::merge(n, a))));
  // The same cases as ATen.
  auto t = torch::tensor({1.0, kInf, 2.0}, torch::kDouble);
  EXPECT_EQ(t.logsumexp(0).item<double>(), online_lse<double>({1.0, kInf, 2.0}));
  // Gradient elements: a NaN logit or lse gives NaN.
  EXPECT_TRUE(std::isnan(math::contrastive_grad(kNaN, 0.0, 1.0, true, 0.0, 1.0, false)));
  EXPECT_TRUE(std::isnan(math::contrastive_grad(0.0, kNaN, 1.0, false, 0.0, 1.0, false)));
  EXPECT_TRUE(std::isnan(math::siglip_pair(kNaN, true).loss));
  EXPECT_TRUE(std::isnan(math::siglip_pair(kNaN, false).grad));
  // SigLIP at +-inf: a positive at +inf costs nothing, a negative there all.
  EXPECT_EQ(math::siglip_pair(kInf, true).loss, 0.0);
  EXPECT_EQ(math::siglip_pair(kInf, true).grad, 0.0);
  EXPECT_EQ(math::siglip_pair(kInf, false).loss, kInf);
  EXPECT_EQ(math::siglip_pair(kInf, false).grad, 1.0);
  EXPECT_EQ(math::siglip_pair(-kInf, false).loss, 0.0);
  EXPECT_EQ(math::siglip_pair(-kInf, true).grad, -1.0);
}

// The CLIP gradient element against autograd of the symmetric, weighted
// InfoNCE loss sum_i w_i (l^row_i + l^col_i) / 2 in fp64 (engine/block.h: G =
// h [w_i (softmax_row - Y) + w_j (softmax_col - Y)], h = 1/2), with a masked
// entry, at temperature 0.01.
TEST(LossMath, ContrastiveGradientMatchesAutograd) {
  torch::manual_seed(5);
  const int64_t n = 24;
  auto f = torch::nn::functional::normalize(torch::randn({n, 32}, torch::kDouble),
                                            torch::nn::functional::NormalizeFuncOptions().dim(1));
  auto g = torch::nn::functional::normalize(torch::randn({n, 32}, torch::kDouble),
                                            torch::nn::functional::NormalizeFuncOptions().dim(1));
  auto S = (f.mm(g.t()) / 0.01).detach();
  S.index_put_({3, 7}, -kInf);  // a masked entry (never a positive)
  S.requires_grad_(true);
  auto w = torch::rand({n}, torch::kDouble) + 0.5;
  auto idx = torch::arange(n);
  auto diag = S.diagonal();
  auto loss = (w * ((S.logsumexp(1) - diag) + (S.logsumexp(0) - diag))).sum() * 0.5;
  loss.backward();
  auto want = S.grad();
  auto lr = S.detach().logsumexp(1), lc = S.detach().logsumexp(0);
  auto Sd = S.detach();
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double x = Sd[i][j].item<double>(), wi = w[i].item<double>(), wj = w[j].item<double>();
      const double got = 0.5 * math::contrastive_grad(x, lr[i].item<double>(), wi, true, lc[j].item<double>(), wj,
                                                      math::is_positive(i, j, 0, 1));
      worst = std::max(worst, std::fabs(got - want[i][j].item<double>()));
    }
  }
  EXPECT_LE(worst, 1e-14);
  EXPECT_EQ(want[3][7].item<double>(), 0.0);
}

// softplus and sigmoid: against long double over |y| <= 100, no overflow far
// beyond, and the SigLIP gradient against a central difference of its loss.
TEST(LossMath, SiglipElementIsStableAndItsGradientIsTheLossDerivative) {
  for (double y = -100; y <= 100; y += 0.37) {
    const long double e = std::exp(static_cast<long double>(y));
    EXPECT_NEAR(math::softplus(y), static_cast<double>(std::log1p(e)), 1e-15 * (1 + std::fabs(y)));
    EXPECT_NEAR(math::sigmoid(y), static_cast<double>(e / (1 + e)), 1e-16 + 1e-15 * static_cast<double>(e / (1 + e)));
    EXPECT_NEAR(math::softplus(static_cast<float>(y)), static_cast<double>(std::log1p(e)), 1e-6 * (1 + std::fabs(y)));
  }
  EXPECT_EQ(math::softplus(1000.0), 1000.0);
  EXPECT_EQ(math::softplus(-1000.0), 0.0);
  EXPECT_EQ(math::softplus(1000.0f), 1000.0f);
  EXPECT_EQ(math::sigmoid(-1000.0f), 0.0f);
  EXPECT_EQ(math::sigmoid(1000.0f), 1.0f);
  for (bool pos : {true, false}) {
    for (double x : {-30.0, -2.5, -0.1, 0.0, 0.7, 4.0, 25.0}) {
      const double h = 1e-5;
      const double fd = (math::siglip_pair(x + h, pos).loss - math::siglip_pair(x - h, pos).loss) / (2 * h);
      EXPECT_NEAR(math::siglip_pair(x, pos).grad, fd, 1e-9) << "x " << x << " positive " << pos;
      // -log sigmoid(z x), as ATen computes it.
      const double z = pos ? 1.0 : -1.0;
      EXPECT_NEAR(math::siglip_pair(x, pos).loss,
                  -torch::log_sigmoid(torch::tensor(z * x, torch::kDouble)).item<double>(), 1e-15 * (1 + std::fabs(x)));
    }
  }
}

}  // namespace
