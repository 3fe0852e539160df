// The CUDA panel kernels' grids run on the CPU (support/panel_emulation.h)
// against the ATen path in fp64, on shapes that are not multiples of the
// blocks (1 row, 1 column, empty, a strip and a tile plus one, a row stride
// wider than the panel) and device sizes that change the column splits: the
// kernels' indexing (strips, splits, tiles, tails, partial pairs, masks and
// positives by index) is checked here, without a GPU.
#include "support/panel_emulation.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

namespace panels = contrax::detail::panels;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Shapes around the kernels' blocks (32-row strips, 256-column ranges, 8-row
// tiles) and device sizes: 1 multiprocessor (no column split), 4 and 132.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{0, 0}, {0, 5},   {5, 0},   {1, 1},   {1, 300}, {300, 1},
                                                          {33, 257}, {65, 513}, {31, 1000}, {7, 9}, {100, 70}};
const int kSms[] = {1, 4, 132};

// The largest |a - b|, equal infinities and both-NaN counting as equal.
double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  auto same = (x == y) | (torch::isnan(x) & torch::isnan(y));
  auto d = (x - y).abs().masked_fill(same, 0.0);
  return d.numel() ? d.max().item<double>() : 0.0;
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// Row log-sum-exps of `x` ([R, C], any row stride) and the running column
// pairs (m, s) after it, through the emulated lse kernel.
struct LseOut {
  torch::Tensor row, col_m, col_s;
  torch::Tensor col() const { return col_m + col_s.log(); }
};
LseOut emulate_lse(const torch::Tensor& x, int sms, const panels::Masks& masks = {}, const torch::Tensor& bias = {},
                   torch::Tensor col_m = {}, torch::Tensor col_s = {}) {
  const int64_t R = x.size(0), C = x.size(1);
  LseOut out;
  out.row = torch::empty({R}, torch::kDouble);
  out.col_m = col_m.defined() ? col_m : torch::full({C}, -kInf, torch::kDouble);
  out.col_s = col_s.defined() ? col_s : torch::zeros({C}, torch::kDouble);
  const auto g = panels::strip_grid(R, C, sms);
  auto ws = torch::full({std::max<int64_t>(1, panels::strip_workspace(g, R, C))}, 12345.0, torch::kDouble);
  panels::LseArgs<double> a;
  a.logits = ptr<double>(x), a.rows = R, a.cols = C, a.ld = std::max<int64_t>(x.stride(0), 1);
  a.bias = ptr<double>(bias), a.masks = masks;
  a.row_lse = ptr<double>(out.row), a.col_m = ptr<double>(out.col_m), a.col_s = ptr<double>(out.col_s);
  a.ws = ptr<double>(ws);
  panels::emulate_lse_panel(a, sms);
  return out;
}

TEST(PanelEmulation, LseRowsAndColumnsMatchAtenOnOddShapes) {
  torch::manual_seed(1);
  for (auto [R, C] : kShapes) {
    for (int sms : kSms) {
      SCOPED_TRACE(testing::Message() << R << " x " << C << ", " << sms << " SMs");
      auto x = torch::randn({R, C}, torch::kDouble) * 10;
      auto got = emulate_lse(x, sms);
      EXPECT_LE(max_diff(got.row, R ? x.logsumexp(1) : torch::empty({0}, torch::kDouble)), 1e-12);
      auto want_col = R ? x.logsumexp(0) : torch::full({C}, -kInf, torch::kDouble);
      EXPECT_LE(max_diff(got.col(), want_col), 1e-12);
      if (C == 0) EXPECT_TRUE((got.row == -kInf).all().item<bool>());
    }
  }
}

// Two row panels of one matrix, the second merged into the first's column
// pairs, as the engine walks a block; the second panel a strided view (row
// stride wider than its columns) at temperature-0.01 scale.
TEST(PanelEmulation, ColumnPairsMergeAcrossPanelsAndStridedViews) {
  torch::manual_seed(2);
  auto big = torch::randn({70, 400}, torch::kDouble) * 100;
  auto x = big.narrow(1, 3, 301);  // [70, 301], row stride 400
  for (int sms : kSms) {
    auto top = emulate_lse(x.narrow(0, 0, 33).contiguous(), sms);
    auto bottom = emulate_lse(x.narrow(0, 33, 37), sms, {}, {}, top.col_m, top.col_s);
    EXPECT_LE(max_diff(bottom.col(), x.logsumexp(0)), 1e-12);
    EXPECT_LE(max_diff(bottom.row, x.narrow(0, 33, 37).logsumexp(1)), 1e-12);
  }
}

// The diagonal, equal labels (not on the designated positive) and the bias by
// index, against the same logits masked in ATen; a fully masked row gives
// -inf, and non-finite entries propagate.
TEST(PanelEmulation, MasksBiasAndNonFiniteEntriesByIndex) {
  torch::manual_seed(3);
  const int64_t R = 37, C = 300, row0 = 5, col0 = 40, group = 2, pos_offset = 15;
  auto x = torch::randn({R, C}, torch::kDouble);
  auto bias = torch::tensor(-1.25, torch::kDouble);
  auto rl = torch::randint(0, 4, {R}, torch::kLong), cl = torch::randint(0, 4, {C}, torch::kLong);
  panels::Masks m;
  m.row0 = row0, m.col0 = col0, m.diag = true, m.diag_offset = 30;
  m.row_labels = ptr<int64_t>(rl), m.col_labels = ptr<int64_t>(cl);
  m.positives = true, m.pos_offset = pos_offset, m.group = group;
  // The reference: global i = row0 + r, j = col0 + c.
  auto i = torch::arange(R).unsqueeze(1) + row0, j = torch::arange(C).unsqueeze(0) + col0;
  auto positive = j == (i + pos_offset) * group;
  ASSERT_GT(positive.sum().item<int64_t>(), 0);
  // A NaN and a +inf on entries no mask covers (labels no column has).
  rl[6] = 100, rl[9] = 100;
  auto masked = (j == i + 30) | ((rl.unsqueeze(1) == cl.unsqueeze(0)) & ~positive);
  x.index_put_({6, 7}, NAN);
  x.index_put_({9, 11}, kInf);
  auto want = (x + bias).masked_fill(masked, -kInf);
  for (int sms : kSms) {
    auto got = emulate_lse(x, sms, m, bias);
    EXPECT_LE(max_diff(got.row, want.logsumexp(1)), 1e-12);
    EXPECT_LE(max_diff(got.col(), want.logsumexp(0)), 1e-12);
    EXPECT_TRUE(std::isnan(got.row[6].item<double>()));
    EXPECT_EQ(got.row[9].item<double>(), kInf);
  }
  // Labels: every entry of row 2 shares its label with every column, and no
  // positive lies in the panel: the row is wholly masked (-inf, no NaN).
  panels::Masks all;
  auto rl2 = torch::zeros({R}, torch::kLong), cl2 = torch::ones({C}, torch::kLong);
  rl2[2] = 1;
  all.row_labels = ptr<int64_t>(rl2), all.col_labels = ptr<int64_t>(cl2);
  auto got = emulate_lse(x.narrow(0, 0, 5).contiguous(), 4, all);
  EXPECT_EQ(got.row[2].item<double>(), -kInf);
  auto want2 = x.narrow(0, 0, 5).clone();
  want2[2].fill_(-kInf);
  EXPECT_LE(max_diff(got.row, want2.logsumexp(1)), 1e-12);
}

// The gradient panel: the emulated kernel's G against the ATen form, and the
// whole chain (lse kernel, then gradient kernel) against autograd of the
// weighted symmetric InfoNCE loss in fp64.
template <typename Out>
torch::Tensor emulate_grad(const torch::Tensor& x, const torch::Tensor& lr, const torch::Tensor& wr,
                           const torch::Tensor& lc, const torch::Tensor& wc, const torch::Tensor& factor,
                           const panels::Masks& m, torch::Tensor out = {}) {
  if (!out.defined()) out = torch::full(x.sizes(), 777.0, c10::CppTypeToScalarType<Out>::value);
  panels::GradArgs<double, Out> a;
  a.logits = ptr<double>(x), a.rows = x.size(0), a.cols = x.size(1), a.ld = std::max<int64_t>(x.stride(0), 1);
  a.masks = m;
  a.lse_row = ptr<double>(lr), a.w_row = ptr<double>(wr), a.lse_col = ptr<double>(lc), a.w_col = ptr<double>(wc);
  a.factor = ptr<double>(factor);
  a.out = ptr<Out>(out), a.ld_out = std::max<int64_t>(out.stride(0), 1);
  panels::emulate_grad_panel(a);
  return out;
}

TEST(PanelEmulation, GradientMatchesTheAtenFormOnOddShapes) {
  torch::manual_seed(4);
  for (auto [R, C] : kShapes) {
    SCOPED_TRACE(testing::Message() << R << " x " << C);
    auto x = torch::randn({R, C}, torch::kDouble) * 5;
    // The true log-sum-exps (entries in [0, 1]), shifted a little so that
    // the row and column terms are told apart from a plain softmax.
    auto lr = x.logsumexp(1) + 0.25, lc = x.logsumexp(0) - 0.5;
    auto wr = torch::rand({R}, torch::kDouble), wc = torch::rand({C}, torch::kDouble);
    auto c = torch::tensor(0.3, torch::kDouble);
    panels::Masks m;
    m.positives = true, m.row0 = 2, m.col0 = 1, m.pos_offset = 0, m.group = 1;  // positives at c = r + 1
    auto Y = (torch::arange(C).unsqueeze(0) + 1 == torch::arange(R).unsqueeze(1) + 2).to(torch::kDouble);
    for (int form = 0; form < 4; ++form) {
      const bool sym = form & 1, weights = form & 2;
      torch::Tensor want = (x - lr.unsqueeze(1)).exp() - Y;
      if (weights) want = want * wr.unsqueeze(1);
      if (sym) {
        auto col = (x - lc.unsqueeze(0)).exp() - Y;
        want = want + (weights ? col * wc.unsqueeze(0) : col);
      }
      want = want * 0.3;
      auto got = emulate_grad<double>(x, lr, weights ? wr : torch::Tensor(), sym ? lc : torch::Tensor(),
                                      weights && sym ? wc : torch::Tensor(), c, m);
      EXPECT_LE(max_diff(got, want), 1e-13) << "form " << form;
      // fp32 output from fp64 logits (the cast folded into the write).
      auto got32 = emulate_grad<float>(x, lr, weights ? wr : torch::Tensor(), sym ? lc : torch::Tensor(),
                                       weights && sym ? wc : torch::Tensor(), c, m);
      EXPECT_LE(max_diff(got32, want.to(torch::kFloat)), 0.0) << "form " << form;
    }
  }
}

TEST(PanelEmulation, LseThenGradientIsTheAutogradOfSymmetricInfoNce) {
  torch::manual_seed(5);
  for (int64_t n : {1, 9, 33, 300}) {
    SCOPED_TRACE(n);
    auto f = torch::nn::functional::normalize(torch::randn({n, 16}, torch::kDouble),
                                              torch::nn::functional::NormalizeFuncOptions().dim(1));
    auto S = (f.mm(torch::randn({16, n}, torch::kDouble)) / 0.01).detach().requires_grad_(true);
    auto w = torch::rand({n}, torch::kDouble) + 0.5;
    auto d = S.diagonal();
    ((w * ((S.logsumexp(1) - d) + (S.logsumexp(0) - d))).sum() * 0.5).backward();
    auto x = S.detach().contiguous();
    auto st = emulate_lse(x, 4);
    panels::Masks m;
    m.positives = true;
    auto half = torch::tensor(0.5, torch::kDouble);
    // In place: the output is the logits buffer itself, as the engine uses it.
    auto buf = x.clone();
    emulate_grad<double>(buf, st.row, w, st.col(), w, half, m, buf);
    EXPECT_LE(max_diff(buf, S.grad()), 1e-12);
  }
}

TEST(PanelEmulation, GradientOfMaskedEntriesAndFullyMaskedRowsIsZero) {
  auto x = torch::randn({9, 40}, torch::kDouble);
  panels::Masks m;
  m.diag = true, m.diag_offset = 0;
  auto rl = torch::zeros({9}, torch::kLong), cl = torch::zeros({40}, torch::kLong);
  rl[3] = 5;  // row 3 differs from every column: the only row not wholly masked
  m.row_labels = ptr<int64_t>(rl), m.col_labels = ptr<int64_t>(cl);
  auto st = emulate_lse(x, 1, m);
  EXPECT_EQ(st.row[0].item<double>(), -kInf);
  auto g = emulate_grad<double>(x, st.row, {}, {}, {}, {}, m);
  EXPECT_FALSE(torch::isnan(g).any().item<bool>());
  auto others = torch::cat({g.narrow(0, 0, 3), g.narrow(0, 4, 5)});
  EXPECT_EQ(others.abs().max().item<double>(), 0.0);
  // Row 3 without its masked diagonal entry: a softmax, summing to 1.
  EXPECT_EQ(g[3][3].item<double>(), 0.0);
  EXPECT_NEAR(g[3].sum().item<double>(), 1.0, 1e-12);
}

// SigLIP: the rows' loss sums, the gradient panel and its row sums against
// ATen's -log sigmoid(z x) and autograd, with the bias, the positives of an
// own block off the panel's diagonal (row0 != col0) and a factor.
TEST(PanelEmulation, SiglipPanelMatchesAtenOnOddShapes) {
  torch::manual_seed(6);
  for (auto [R, C] : kShapes) {
    for (int sms : kSms) {
      for (bool own : {false, true}) {
        SCOPED_TRACE(testing::Message() << R << " x " << C << ", " << sms << " SMs, own " << own);
        const int64_t row0 = 3, col0 = 1;
        auto raw = torch::randn({R, C + 2}, torch::kDouble) * 8;
        auto x = raw.narrow(1, 1, C);  // row stride C + 2
        auto bias = torch::tensor(-2.0, torch::kDouble), factor = torch::tensor(0.25, torch::kDouble);
        auto z = -torch::ones({R, C}, torch::kDouble);
        if (own) {
          z.masked_fill_(torch::arange(R).unsqueeze(1) + row0 == torch::arange(C).unsqueeze(0) + col0, 1.0);
        }
        auto xl = (x + bias).detach().requires_grad_(true);
        auto loss_rows = -torch::log_sigmoid(z * xl).sum(1);
        loss_rows.sum().backward();
        auto want_grad = xl.grad() * 0.25;
        panels::SiglipArgs<double, double> a;
        auto grad = torch::full({R, C}, 777.0, torch::kDouble);
        auto row_loss = torch::full({R}, 777.0, torch::kDouble), row_grad = torch::full({R}, 777.0, torch::kDouble);
        const auto g = panels::strip_grid(R, C, sms);
        auto ws = torch::full({std::max<int64_t>(1, panels::strip_workspace(g, R, 0))}, 12345.0, torch::kDouble);
        a.logits = ptr<double>(x), a.rows = R, a.cols = C, a.ld = C + 2, a.bias = ptr<double>(bias);
        a.row0 = row0, a.col0 = col0, a.own = own, a.factor = ptr<double>(factor);
        a.grad = ptr<double>(grad), a.ld_grad = std::max<int64_t>(C, 1);
        a.row_loss = ptr<double>(row_loss), a.row_grad = ptr<double>(row_grad), a.ws = ptr<double>(ws);
        panels::emulate_siglip_panel(a, sms);
        EXPECT_LE(max_diff(row_loss, loss_rows.detach()), 1e-11);
        EXPECT_LE(max_diff(grad, want_grad), 1e-14);
        EXPECT_LE(max_diff(row_grad, want_grad.sum(1)), 1e-12);
      }
    }
  }
}

}  // namespace
