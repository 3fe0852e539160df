// The CUDA panel kernels' own device code (src/engine/kernels/cuda_*_panel.cuh)
// run on the CPU by the SIMT emulator (support/emulated_panels.h): every kernel
// in fp64 and fp32 (fp32 logits with bf16, fp16 and fp32 outputs where the
// kernels write the GEMM operand's dtype), against ATen in the same dtype and
// against an fp64 reference, on shapes that are not multiples of the blocks
// (empty, 1 row, 1 column, a strip, a split and a tile plus one, row strides
// wider than the panel) and device sizes of 1, 4 and 132 multiprocessors
// (which change the column splits), under both of the emulator's schedules.
// Each panel lies in a buffer padded with NaN and every output in one padded
// with a sentinel, so a tail bound off by one reads a NaN or writes where it
// must not. The masks and positives by index, and the chain lse then
// gradient against autograd.
#include "support/emulated_panels.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "support/simt.h"

namespace {

// The emulated kernels run on the calling thread; ATen's small reference
// operations on one thread too (its pool's spinning costs more than they do).
// The environment is the whole engine program's (engine_tests): loss_math's
// small ATen references run on one thread as well.
class OneThread : public ::testing::Environment {
 public:
  void SetUp() override { at::set_num_threads(1); }
};
const auto* const kOneThread = ::testing::AddGlobalTestEnvironment(new OneThread);

using contrax::simt::Schedule;
namespace panels = contrax::detail::panels;
namespace testing_ = contrax::testing;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kSentinel = 768.0;  // exact in every output dtype, bf16 included

// Shapes around the kernels' blocks (32-row strips, 256-column ranges, 8-row
// tiles) and device sizes: 1 multiprocessor (no column split), 4 and 132.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{0, 0},    {0, 5},     {5, 0},     {1, 1},
                                                          {1, 300},  {300, 1},   {33, 257},  {65, 513},
                                                          {31, 1000}, {7, 9},    {100, 70},  {40, 2100}};
const int kSms[] = {1, 4, 132};
const Schedule kSchedules[] = {Schedule::kLowestFirst, Schedule::kHighestFirst};

// The largest |a - b| / (|b| + floor), equal infinities and both-NaN counting as equal.
double max_err(const torch::Tensor& a, const torch::Tensor& b, double floor = 1.0) {
  auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  auto same = (x == y) | (torch::isnan(x) & torch::isnan(y));
  auto d = ((x - y).abs() / (y.abs() + floor)).masked_fill(same, 0.0);
  return d.numel() ? d.max().item<double>() : 0.0;
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// The dtype of a kernel's element type (the API's Bf16 / Fp16 included).
template <typename T>
torch::ScalarType dtype_of() {
  if constexpr (std::is_same_v<T, panels::Bf16>) {
    return torch::kBFloat16;
  } else if constexpr (std::is_same_v<T, panels::Fp16>) {
    return torch::kHalf;
  } else {
    return c10::CppTypeToScalarType<T>::value;
  }
}

// `x` ([R, C]) copied into the middle of a NaN-filled [R + 2, C + 3] buffer:
// a view with row stride C + 3 and NaN on every side of it.
torch::Tensor padded(const torch::Tensor& x) {
  auto buf = torch::full({x.size(0) + 2, x.size(1) + 3}, NAN, x.options());
  auto view = buf.narrow(0, 1, x.size(0)).narrow(1, 1, x.size(1));
  view.copy_(x);
  return view;
}

// An output of n entries in a sentinel-filled buffer of n + 8, and a check
// that nothing outside it was written.
struct Guarded {
  torch::Tensor buf, view;
  Guarded(int64_t n, torch::ScalarType t) : buf(torch::full({n + 8}, kSentinel, t)), view(buf.narrow(0, 4, n)) {}
  bool intact() const {
    auto edges = torch::cat({buf.narrow(0, 0, 4), buf.narrow(0, buf.size(0) - 4, 4)}).to(torch::kDouble);
    return (edges == kSentinel).all().item<bool>();
  }
};

// Row log-sum-exps of `x` ([R, C], any row stride) and the running column
// pairs (m, s) after it, through the emulated kernels in x's dtype.
// With `sums` (multi-positive masks), the positive sums are added into its
// tensors (row, row_n: [R]; col, col_n: [C] or undefined).
struct LseOut {
  torch::Tensor row, col_m, col_s;
  torch::Tensor col() const { return col_m + col_s.log(); }
};
template <typename T>
LseOut emulate_lse(const torch::Tensor& x, int sms, const panels::Masks& masks = {}, const torch::Tensor& bias = {},
                   torch::Tensor col_m = {}, torch::Tensor col_s = {},
                   const contrax::detail::PositiveSums* sums = nullptr) {
  const int64_t R = x.size(0), C = x.size(1);
  const torch::ScalarType dt = dtype_of<T>();
  Guarded row(R, dt);
  LseOut out;
  out.col_m = col_m.defined() ? col_m : torch::full({C}, -kInf, dt);
  out.col_s = col_s.defined() ? col_s : torch::zeros({C}, dt);
  const auto g = panels::strip_grid(R, C, sms);
  auto ws = torch::full({std::max<int64_t>(1, panels::strip_workspace(g, R, C, sums != nullptr))}, 12345.0, dt);
  panels::LseArgs<T> a;
  a.logits = ptr<T>(x), a.rows = R, a.cols = C, a.ld = std::max<int64_t>(x.stride(0), 1);
  a.bias = ptr<T>(bias), a.masks = masks;
  a.row_lse = ptr<T>(row.view), a.col_m = ptr<T>(out.col_m), a.col_s = ptr<T>(out.col_s);
  if (sums) {
    a.pos_row = ptr<T>(sums->row), a.n_row = ptr<T>(sums->row_n);
    a.pos_col = ptr<T>(sums->col), a.n_col = ptr<T>(sums->col_n);
  }
  a.ws = ptr<T>(ws);
  EXPECT_EQ(testing_::emulated_lse_panel(a, sms), 0);
  EXPECT_TRUE(row.intact()) << "a row log-sum-exp written out of bounds";
  out.row = row.view;
  return out;
}

template <typename T>
void lse_matches_aten(double tol32) {
  torch::manual_seed(1);
  const double tol = std::is_same_v<T, double> ? 1e-12 : tol32;
  for (auto s : kSchedules) {
    contrax::simt::set_schedule(s);
    for (auto [R, C] : kShapes) {
      for (int sms : kSms) {
        SCOPED_TRACE(testing::Message() << R << " x " << C << ", " << sms << " SMs, schedule " << static_cast<int>(s));
        auto ref = torch::randn({R, C}, torch::kDouble) * 10;  // the fp64 reference's logits
        auto x = padded(ref.to(dtype_of<T>()));
        LseOut got = emulate_lse<T>(x, sms);
        auto want_row = R ? ref.logsumexp(1) : torch::empty({0}, torch::kDouble);
        auto want_col = R ? ref.logsumexp(0) : torch::full({C}, -kInf, torch::kDouble);
        EXPECT_LE(max_err(got.row, want_row), tol);
        EXPECT_LE(max_err(got.col(), want_col), tol);
        if (R) {  // ATen in the kernel's own dtype
          EXPECT_LE(max_err(got.row, x.logsumexp(1)), tol);
          EXPECT_LE(max_err(got.col(), x.logsumexp(0)), tol);
        }
        if (C == 0) EXPECT_TRUE((got.row == -kInf).all().item<bool>());
      }
    }
  }
  contrax::simt::set_schedule(Schedule::kLowestFirst);
}

TEST(SimtKernels, LseRowsAndColumnsMatchAtenAndFp64OnOddShapes) {
  lse_matches_aten<double>(0);
  lse_matches_aten<float>(2e-6);
}

// Two row panels of one matrix, the second merged into the first's column
// pairs, as the engine walks a block; the second panel a strided view (row
// stride wider than its columns) at temperature-0.01 scale.
TEST(SimtKernels, ColumnPairsMergeAcrossPanelsAndStridedViews) {
  torch::manual_seed(2);
  auto big = torch::randn({70, 400}, torch::kDouble) * 100;
  auto x = big.narrow(1, 3, 301);  // [70, 301], row stride 400
  for (int sms : kSms) {
    auto top = emulate_lse<double>(x.narrow(0, 0, 33).contiguous(), sms);
    auto bottom = emulate_lse<double>(x.narrow(0, 33, 37), sms, {}, {}, top.col_m, top.col_s);
    EXPECT_LE(max_err(bottom.col(), x.logsumexp(0)), 1e-12);
    EXPECT_LE(max_err(bottom.row, x.narrow(0, 33, 37).logsumexp(1)), 1e-12);
  }
}

// The diagonal, equal labels (not on the designated positive) and the bias by
// index, against the same logits masked in ATen; a fully masked row gives
// -inf, and non-finite entries propagate.
template <typename T>
void masks_by_index(double tol) {
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
  const torch::ScalarType dt = dtype_of<T>();
  for (int sms : kSms) {
    LseOut got = emulate_lse<T>(padded(x.to(dt)), sms, m, bias.to(dt));
    EXPECT_LE(max_err(got.row, want.logsumexp(1)), tol);
    EXPECT_LE(max_err(got.col(), want.logsumexp(0)), tol);
    EXPECT_TRUE(std::isnan(got.row[6].item<double>()));
    EXPECT_EQ(got.row[9].item<double>(), kInf);
  }
  // Labels: every entry of row 2 shares its label with every column, and no
  // positive lies in the panel: the row is wholly masked (-inf, no NaN).
  panels::Masks all;
  auto rl2 = torch::zeros({R}, torch::kLong), cl2 = torch::ones({C}, torch::kLong);
  rl2[2] = 1;
  all.row_labels = ptr<int64_t>(rl2), all.col_labels = ptr<int64_t>(cl2);
  LseOut got = emulate_lse<T>(x.narrow(0, 0, 5).to(dt).contiguous(), 4, all);
  EXPECT_EQ(got.row[2].item<double>(), -kInf);
  auto want2 = x.narrow(0, 0, 5).clone();
  want2[2].fill_(-kInf);
  EXPECT_LE(max_err(got.row, want2.logsumexp(1)), tol);
}

TEST(SimtKernels, MasksBiasAndNonFiniteEntriesByIndex) {
  masks_by_index<double>(1e-12);
  masks_by_index<float>(2e-6);
}

// The gradient panel: the emulated kernel's G against the ATen form, and the
// whole chain (lse kernel, then gradient kernel) against autograd of the
// weighted symmetric InfoNCE loss in fp64.
template <typename T, typename Out>
torch::Tensor emulate_grad(const torch::Tensor& x, const torch::Tensor& lr, const torch::Tensor& wr,
                           const torch::Tensor& lc, const torch::Tensor& wc, const torch::Tensor& factor,
                           const panels::Masks& m, torch::Tensor out = {},
                           const contrax::detail::PositiveCounts& counts = {}) {
  const torch::ScalarType out_dtype = dtype_of<Out>();
  const int64_t R = x.size(0), C = x.size(1);
  torch::Tensor buf;
  if (!out.defined()) {  // a sentinel border of one row and two columns
    buf = torch::full({R + 2, C + 4}, kSentinel, out_dtype);
    out = buf.narrow(0, 1, R).narrow(1, 2, C);
  }
  panels::GradArgs<T, Out> a;
  a.logits = ptr<T>(x), a.rows = R, a.cols = C, a.ld = std::max<int64_t>(x.stride(0), 1);
  a.masks = m;
  a.lse_row = ptr<T>(lr), a.w_row = ptr<T>(wr), a.lse_col = ptr<T>(lc), a.w_col = ptr<T>(wc);
  a.factor = ptr<T>(factor);
  a.out = reinterpret_cast<Out*>(out.data_ptr()), a.ld_out = std::max<int64_t>(out.stride(0), 1);
  a.inv_n_row = ptr<T>(counts.inv_n_row), a.inv_n_col = ptr<T>(counts.inv_n_col);
  EXPECT_EQ(testing_::emulated_grad_panel(a), 0);
  if (buf.defined()) {
    auto border = buf.clone();
    border.narrow(0, 1, R).narrow(1, 2, C).fill_(kSentinel);
    EXPECT_TRUE((border.to(torch::kDouble) == kSentinel).all().item<bool>()) << "a gradient written out of bounds";
  }
  return out;
}

// One dtype pair: logits of T, output Out; `tol` relative to the fp64
// reference (the output's rounding), `aten_tol` to ATen's form in T.
template <typename T, typename Out>
void gradient_matches(double tol, double aten_tol) {
  torch::manual_seed(4);
  const torch::ScalarType dt = dtype_of<T>();
  for (auto [R, C] : kShapes) {
    SCOPED_TRACE(testing::Message() << R << " x " << C);
    auto ref = torch::randn({R, C}, torch::kDouble) * 5;
    // The true log-sum-exps (entries in [0, 1]), shifted a little so that
    // the row and column terms are told apart from a plain softmax.
    auto lr = ref.logsumexp(1) + 0.25, lc = ref.logsumexp(0) - 0.5;
    auto wr = torch::rand({R}, torch::kDouble), wc = torch::rand({C}, torch::kDouble);
    auto c = torch::tensor(0.3, torch::kDouble);
    panels::Masks m;
    m.positives = true, m.row0 = 2, m.col0 = 1, m.pos_offset = 0, m.group = 1;  // positives at c = r + 1
    auto Y = (torch::arange(C).unsqueeze(0) + 1 == torch::arange(R).unsqueeze(1) + 2).to(torch::kDouble);
    for (int form = 0; form < 4; ++form) {
      const bool sym = form & 1, weights = form & 2;
      // The same formula in fp64 (the reference) and in T (ATen's form).
      auto formula = [&](torch::ScalarType t) {
        auto X = ref.to(t);
        torch::Tensor g = (X - lr.to(t).unsqueeze(1)).exp() - Y.to(t);
        if (weights) g = g * wr.to(t).unsqueeze(1);
        if (sym) {
          auto col = (X - lc.to(t).unsqueeze(0)).exp() - Y.to(t);
          g = g + (weights ? col * wc.to(t).unsqueeze(0) : col);
        }
        return g * c.to(t);
      };
      auto on = [&](const torch::Tensor& v) { return v.to(dt); };
      auto got = emulate_grad<T, Out>(padded(ref.to(dt)), on(lr), weights ? on(wr) : torch::Tensor(),
                                      sym ? on(lc) : torch::Tensor(), weights && sym ? on(wc) : torch::Tensor(),
                                      on(c), m);
      EXPECT_LE(max_err(got, formula(torch::kDouble)), tol) << "form " << form;
      EXPECT_LE(max_err(got, formula(dt).to(got.scalar_type())), aten_tol) << "form " << form;
    }
  }
}

TEST(SimtKernels, GradientMatchesAtenAndFp64InEveryOutputDtype) {
  gradient_matches<double, double>(1e-13, 1e-13);
  gradient_matches<float, float>(1e-5, 2e-6);
  // bf16 / fp16 outputs: the fp32 value rounded once (to nearest): within
  // half an ulp of the output dtype of the exact value (plus fp32's error),
  // and ATen's fp32 form rounded the same way differs by at most one ulp.
  gradient_matches<float, panels::Bf16>(1.0 / 256, 1.0 / 128);
  gradient_matches<float, panels::Fp16>(1.0 / 2048, 1.0 / 1024);
}

TEST(SimtKernels, LseThenGradientIsTheAutogradOfSymmetricInfoNce) {
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
    auto st = emulate_lse<double>(x, 4);
    panels::Masks m;
    m.positives = true;
    auto half = torch::tensor(0.5, torch::kDouble);
    // In place: the output is the logits buffer itself, as the engine uses it.
    auto buf = x.clone();
    emulate_grad<double, double>(buf, st.row, w, st.col(), w, half, m, buf);
    EXPECT_LE(max_err(buf, S.grad()), 1e-12);
  }
}

TEST(SimtKernels, GradientOfMaskedEntriesAndFullyMaskedRowsIsZero) {
  auto x = torch::randn({9, 40}, torch::kDouble);
  panels::Masks m;
  m.diag = true, m.diag_offset = 0;
  auto rl = torch::zeros({9}, torch::kLong), cl = torch::zeros({40}, torch::kLong);
  rl[3] = 5;  // row 3 differs from every column: the only row not wholly masked
  m.row_labels = ptr<int64_t>(rl), m.col_labels = ptr<int64_t>(cl);
  auto st = emulate_lse<double>(x, 1, m);
  EXPECT_EQ(st.row[0].item<double>(), -kInf);
  auto g = emulate_grad<double, double>(x, st.row, {}, {}, {}, {}, m);
  EXPECT_FALSE(torch::isnan(g).any().item<bool>());
  auto others = torch::cat({g.narrow(0, 0, 3), g.narrow(0, 4, 5)});
  EXPECT_EQ(others.abs().max().item<double>(), 0.0);
  // Row 3 without its masked diagonal entry: a softmax, summing to 1.
  EXPECT_EQ(g[3][3].item<double>(), 0.0);
  EXPECT_NEAR(g[3].sum().item<double>(), 1.0, 1e-12);
}

// Multi-positive labels by index (Masks::multi): P_ij = equal labels or the
// designated positive, nothing masked by the labels. The
// log-sum-exp kernels add each row's and column's sum of P_ij x_ij and count
// of P_ij into running sums (started non-zero here, as a second tile finds
// them), and the gradient kernel subtracts w_i P_ij / n_i (+ w_j P_ij / m_j),
// against the fp64 reference on every shape and device size.
template <typename T>
void multi_positive_matches(double tol) {
  torch::manual_seed(8);
  const torch::ScalarType dt = dtype_of<T>();
  const int64_t row0 = 3, col0 = 5, pos_offset = 2, group = 2;
  for (auto [R, C] : kShapes) {
    for (int sms : kSms) {
      SCOPED_TRACE(testing::Message() << R << " x " << C << ", " << sms << " SMs");
      contrax::simt::set_schedule(sms == 4 ? Schedule::kHighestFirst : Schedule::kLowestFirst);
      auto ref = torch::randn({R, C}, torch::kDouble) * 4;
      auto bias = torch::tensor(0.75, torch::kDouble);
      auto rl = torch::randint(0, 3, {R}, torch::kLong), cl = torch::randint(0, 3, {C}, torch::kLong);
      panels::Masks m;
      m.row0 = row0, m.col0 = col0, m.multi = true, m.pos_offset = pos_offset, m.group = group;
      rl.masked_fill_(torch::arange(R) % 7 == 6, 100);  // rows whose labels no column shares
      m.row_labels = ptr<int64_t>(rl), m.col_labels = ptr<int64_t>(cl);
      auto i = torch::arange(R).unsqueeze(1) + row0, j = torch::arange(C).unsqueeze(0) + col0;
      auto P = (rl.unsqueeze(1) == cl.unsqueeze(0)) | (j == (i + pos_offset) * group);
      auto X = ref + bias;  // the reference's logits
      auto Pd = P.to(torch::kDouble);
      // Running sums: a previous tile's, non-zero.
      auto start_r = torch::rand({R}, torch::kDouble), start_c = torch::rand({C}, torch::kDouble);
      contrax::detail::PositiveSums sums{start_r.to(dt).clone(), start_r.to(dt) + 1, start_c.to(dt).clone(),
                                        start_c.to(dt) + 2};
      LseOut got = emulate_lse<T>(padded(ref.to(dt)), sms, m, bias.to(dt), {}, {}, &sums);
      auto XP = X.masked_fill(~P, 0.0);
      EXPECT_LE(max_err(sums.row, start_r + XP.sum(1)), tol);
      EXPECT_LE(max_err(sums.row_n, start_r + 1 + Pd.sum(1)), tol);
      EXPECT_LE(max_err(sums.col, start_c + XP.sum(0)), tol);
      EXPECT_LE(max_err(sums.col_n, start_c + 2 + Pd.sum(0)), tol);
      // The labels mask nothing: the log-sum-exps are the plain ones.
      if (R) EXPECT_LE(max_err(got.row, X.logsumexp(1)), tol);
      if (R) EXPECT_LE(max_err(got.col(), X.logsumexp(0)), tol);
      // The gradient, both forms, against the fp64 formula.
      auto lr = (R ? X.logsumexp(1) : torch::zeros({0}, torch::kDouble)) + 0.25;
      auto lc = (R ? X.logsumexp(0) : torch::zeros({C}, torch::kDouble)) - 0.5;
      auto wr = torch::rand({R}, torch::kDouble), wc = torch::rand({C}, torch::kDouble);
      auto inr = torch::rand({R}, torch::kDouble) + 0.1, inc = torch::rand({C}, torch::kDouble) + 0.1;
      auto c = torch::tensor(0.3, torch::kDouble);
      auto on = [&](const torch::Tensor& v) { return v.to(dt); };
      for (bool sym : {false, true}) {
        auto want = (X - lr.unsqueeze(1)).exp() * wr.unsqueeze(1) - Pd * (wr * inr).unsqueeze(1);
        if (sym) want = want + (X - lc.unsqueeze(0)).exp() * wc.unsqueeze(0) - Pd * (wc * inc).unsqueeze(0);
        contrax::detail::PositiveCounts counts{on(inr), sym ? on(inc) : torch::Tensor()};
        auto g = emulate_grad<T, T>(padded(X.to(dt)), on(lr), on(wr), sym ? on(lc) : torch::Tensor(),
                                    sym ? on(wc) : torch::Tensor(), on(c), m, {}, counts);
        EXPECT_LE(max_err(g, want * 0.3), tol) << "symmetric " << sym;
      }
    }
  }
  contrax::simt::set_schedule(Schedule::kLowestFirst);
}

TEST(SimtKernels, MultiPositiveLabelsByIndexMatchFp64OnOddShapes) {
  multi_positive_matches<double>(1e-12);
  multi_positive_matches<float>(2e-5);
}

// SigLIP: the rows' loss sums, the gradient panel and its row sums against
// ATen's -log sigmoid(z x) and autograd, with the bias, the positives of an
// own block off the panel's diagonal (row0 != col0) and a factor.
template <typename T, typename Out>
void siglip_matches(double loss_tol, double grad_tol) {
  torch::manual_seed(6);
  const torch::ScalarType dt = dtype_of<T>();
  const torch::ScalarType out_dtype = dtype_of<Out>();
  for (auto s : kSchedules) {
    contrax::simt::set_schedule(s);
    for (auto [R, C] : kShapes) {
      for (int sms : kSms) {
        for (bool own : {false, true}) {
          SCOPED_TRACE(testing::Message() << R << " x " << C << ", " << sms << " SMs, own " << own);
          const int64_t row0 = 3, col0 = 1;
          auto ref = torch::randn({R, C}, torch::kDouble) * 8;
          auto x = padded(ref.to(dt));
          auto bias = torch::tensor(-2.0, torch::kDouble), factor = torch::tensor(0.25, torch::kDouble);
          auto z = -torch::ones({R, C}, torch::kDouble);
          if (own) z.masked_fill_(torch::arange(R).unsqueeze(1) + row0 == torch::arange(C).unsqueeze(0) + col0, 1.0);
          auto xl = (x.to(torch::kDouble) + bias).detach().requires_grad_(true);
          auto loss_rows = -torch::log_sigmoid(z * xl).sum(1);
          loss_rows.sum().backward();
          auto want_grad = xl.grad() * 0.25;
          torch::Tensor grad_buf = torch::full({R + 2, C + 4}, kSentinel, out_dtype);
          torch::Tensor grad = grad_buf.narrow(0, 1, R).narrow(1, 2, C);
          Guarded row_loss(R, dt), row_grad(R, dt);
          const auto g = panels::strip_grid(R, C, sms);
          auto ws = torch::full({std::max<int64_t>(1, panels::strip_workspace(g, R, 0))}, 12345.0, dt);
          auto bias_t = bias.to(dt), factor_t = factor.to(dt);
          panels::SiglipArgs<T, Out> a;
          a.logits = ptr<T>(x), a.rows = R, a.cols = C, a.ld = x.stride(0), a.bias = ptr<T>(bias_t);
          a.row0 = row0, a.col0 = col0, a.own = own, a.factor = ptr<T>(factor_t);
          a.grad = reinterpret_cast<Out*>(grad.data_ptr()), a.ld_grad = grad.stride(0);
          a.row_loss = ptr<T>(row_loss.view), a.row_grad = ptr<T>(row_grad.view), a.ws = ptr<T>(ws);
          EXPECT_EQ(testing_::emulated_siglip_panel(a, sms), 0);
          EXPECT_TRUE(row_loss.intact() && row_grad.intact());
          torch::Tensor border = grad_buf.clone();
          border.narrow(0, 1, R).narrow(1, 2, C).fill_(kSentinel);
          EXPECT_TRUE((border.to(torch::kDouble) == kSentinel).all().item<bool>()) << "gradient out of bounds";
          EXPECT_LE(max_err(row_loss.view, loss_rows.detach()), loss_tol);
          EXPECT_LE(max_err(grad, want_grad), grad_tol);
          EXPECT_LE(max_err(row_grad.view, want_grad.sum(1)), loss_tol);
        }
      }
    }
  }
  contrax::simt::set_schedule(Schedule::kLowestFirst);
}

TEST(SimtKernels, SiglipPanelMatchesAtenAndFp64OnOddShapes) {
  siglip_matches<double, double>(1e-11, 1e-14);
  siglip_matches<float, float>(2e-5, 1e-6);
  siglip_matches<float, panels::Bf16>(2e-5, 1.0 / 256);
  siglip_matches<float, panels::Fp16>(2e-5, 1.0 / 2048);
}

// A launch of every kernel per call as the host API promises: none for an
// empty panel, the strips and the finishing pass otherwise.
TEST(SimtKernels, LaunchesPerCall) {
  auto x = torch::randn({40, 300}, torch::kDouble);
  int64_t before = contrax::simt::launches();
  emulate_lse<double>(x, 4);
  EXPECT_EQ(contrax::simt::launches() - before, 2);
  before = contrax::simt::launches();
  emulate_lse<double>(torch::empty({0, 0}, torch::kDouble), 4);
  emulate_grad<double, double>(torch::empty({0, 7}, torch::kDouble), torch::empty({0}, torch::kDouble), {}, {}, {},
                               {}, {});
  EXPECT_EQ(contrax::simt::launches() - before, 0);
}

}  // namespace
