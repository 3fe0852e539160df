// A LibTorch-free check of the CUDA panel kernels under the SIMT emulator,
// for the mutation test (tests/engine/kernel_mutation_test.sh): it compiles in
// seconds against any copy of src/engine/kernels/ (the include path decides
// which), runs every kernel (log-sum-exp strips and their finishing pass,
// gradient tiles, SigLIP; multi-positive labels' sums and gradient) in fp64 and fp32 on shapes with tails, at 1, 4 and
// 132 multiprocessors and under both schedules, and compares each output with
// a textbook computation in long double. Panels lie in NaN-padded buffers and
// outputs in sentinel-padded ones, so a read or write one past a bound
// shows. Exit status 0 when everything agrees, 1 otherwise (the first few
// disagreements printed). The same kernels are checked against ATen, with
// masks and half-precision outputs, in tests/engine/simt_kernels_test.cpp.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "support/simt.h"
// clang-format off: the kernels after the emulator
#include "engine/kernels/cuda_grad_panel.cuh"
#include "engine/kernels/cuda_lse_panel.cuh"
#include "engine/kernels/cuda_siglip_panel.cuh"
// clang-format on

namespace {

namespace panels = contrax::detail::panels;
using Real = long double;

int failures = 0;

// Prints the disagreement; after ten, there is no need to look further.
void fail(const char* what, long r, long c, double got, double want) {
  std::printf("FAIL %s at (%ld, %ld): got %.17g, want %.17g\n", what, r, c, got, want);
  if (++failures == 10) {
    std::printf("10 disagreements: stopping\n");
    std::exit(1);
  }
}

template <typename T>
bool close(T got, Real want, double tol) {
  if (std::isnan(static_cast<double>(want))) return std::isnan(got);
  if (std::isinf(static_cast<double>(want))) return got == static_cast<T>(want);
  return std::fabs(static_cast<Real>(got) - want) <= tol * (1 + std::fabs(want));
}

// A [rows x cols] panel inside a NaN border (one row above and below, two
// columns either side); `at(r, c)` its entries, `ld` its row stride.
template <typename T>
struct Panel {
  long rows, cols, ld;
  std::vector<T> buf;
  Panel(long r, long c, std::mt19937& rng, double scale) : rows(r), cols(c), ld(c + 4), buf((r + 2) * (c + 4)) {
    std::normal_distribution<double> n(0.0, scale);
    for (auto& x : buf) x = std::numeric_limits<T>::quiet_NaN();
    for (long i = 0; i < r; ++i) {
      for (long j = 0; j < c; ++j) at(i, j) = static_cast<T>(n(rng));
    }
  }
  T* data() { return buf.data() + ld + 2; }
  T& at(long r, long c) { return data()[r * ld + c]; }
};

// n outputs inside a sentinel border of 4 either side.
template <typename T>
struct Out {
  std::vector<T> buf;
  explicit Out(long n) : buf(n + 8, T(768)) {}
  T* data() { return buf.data() + 4; }
  bool intact() const {
    for (int k = 0; k < 4; ++k) {
      if (buf[k] != T(768) || buf[buf.size() - 1 - k] != T(768)) return false;
    }
    return true;
  }
};

Real lse_of(const std::vector<Real>& v) {
  Real m = -std::numeric_limits<Real>::infinity(), s = 0;
  for (Real x : v) m = std::max(m, x);
  if (std::isinf(static_cast<double>(m))) return m;
  for (Real x : v) s += std::exp(x - m);
  return m + std::log(s);
}

template <typename T>
void check_lse(long R, long C, int sms, double tol, std::mt19937& rng) {
  Panel<T> p(R, C, rng, 10.0);
  Out<T> row(R);
  std::vector<T> cm(C, -std::numeric_limits<T>::infinity()), cs(C, T(0));
  const auto g = panels::strip_grid(R, C, sms);
  std::vector<T> ws(std::max<long>(1, panels::strip_workspace(g, R, C)), T(12345));
  panels::LseArgs<T> a;
  a.logits = p.data(), a.rows = R, a.cols = C, a.ld = p.ld;
  a.row_lse = row.data(), a.col_m = cm.data(), a.col_s = cs.data(), a.ws = ws.data();
  panels::lse_launches(a, sms, contrax::simt::Launch{});
  if (!row.intact()) fail("lse: row written out of bounds", R, C, 0, 0);
  for (long r = 0; r < R; ++r) {
    std::vector<Real> v;
    for (long c = 0; c < C; ++c) v.push_back(p.at(r, c));
    if (!close(row.data()[r], lse_of(v), tol)) fail("lse row", r, C, row.data()[r], static_cast<double>(lse_of(v)));
  }
  for (long c = 0; c < C; ++c) {
    std::vector<Real> v;
    for (long r = 0; r < R; ++r) v.push_back(p.at(r, c));
    const T got = cm[c] + std::log(cs[c]);
    if (!close(got, lse_of(v), tol)) fail("lse column", R, c, got, static_cast<double>(lse_of(v)));
  }
}

template <typename T>
void check_grad(long R, long C, double tol, std::mt19937& rng) {
  Panel<T> p(R, C, rng, 3.0);
  std::vector<T> lr(R), lc(C), wr(R), wc(C);
  for (long r = 0; r < R; ++r) lr[r] = T(2.5 + 0.01 * r), wr[r] = T(0.5 + 0.001 * r);
  for (long c = 0; c < C; ++c) lc[c] = T(3.0 - 0.002 * c), wc[c] = T(1.5 - 0.0005 * c);
  const T factor = T(0.3);
  Out<T> out((R + 1) * (C + 1));  // [R x C] with row stride C + 1, in the sentinel border
  panels::GradArgs<T, T> a;
  a.logits = p.data(), a.rows = R, a.cols = C, a.ld = p.ld;
  a.masks.positives = true;  // positives on the diagonal
  a.lse_row = lr.data(), a.w_row = wr.data(), a.lse_col = lc.data(), a.w_col = wc.data(), a.factor = &factor;
  a.out = out.data(), a.ld_out = C + 1;
  panels::grad_launches(a, contrax::simt::Launch{});
  if (!out.intact()) fail("grad: written out of bounds", R, C, 0, 0);
  for (long r = 0; r < R; ++r) {
    for (long c = 0; c < C + 1; ++c) {
      const T got = out.data()[r * (C + 1) + c];
      if (c == C) {  // the stride's gap: never written
        if (got != T(768)) fail("grad: written past the last column", r, c, got, 768);
        continue;
      }
      const Real x = p.at(r, c), y = r == c ? 1 : 0;
      const Real want = Real(factor) * (wr[r] * (std::exp(x - Real(lr[r])) - y) + wc[c] * (std::exp(x - Real(lc[c])) - y));
      if (!close(got, want, tol)) fail("grad", r, c, got, static_cast<double>(want));
    }
  }
}

// Multi-positive labels by index: the rows' and columns' sums of P_ij x_ij
// and P_ij (added into running ones starting at 1), then the gradient with
// the -Y terms w_i P_ij / n_i + w_j P_ij / m_j (the lse and weights as
// check_grad's, 1/n and 1/m arbitrary).
template <typename T>
void check_multi(long R, long C, int sms, double tol, std::mt19937& rng) {
  Panel<T> p(R, C, rng, 3.0);
  std::vector<int64_t> rl(R), cl(C);
  for (auto& l : rl) l = static_cast<int64_t>(rng() % 3);
  for (auto& l : cl) l = static_cast<int64_t>(rng() % 3);
  panels::Masks m;
  m.multi = true, m.row0 = 1, m.row_labels = rl.data(), m.col_labels = cl.data();  // designated: c = r + 1
  const auto P = [&](long r, long c) { return rl[r] == cl[c] || c == r + 1; };
  std::vector<T> pr(R, T(1)), nr(R, T(1)), pc(C, T(1)), nc(C, T(1));
  const auto g = panels::strip_grid(R, C, sms);
  std::vector<T> ws(std::max<long>(1, panels::strip_workspace(g, R, C, true)), T(12345));
  panels::LseArgs<T> a;
  a.logits = p.data(), a.rows = R, a.cols = C, a.ld = p.ld, a.masks = m;
  a.pos_row = pr.data(), a.n_row = nr.data(), a.pos_col = pc.data(), a.n_col = nc.data(), a.ws = ws.data();
  panels::lse_launches(a, sms, contrax::simt::Launch{});
  std::vector<Real> wpr(R, 1), wnr(R, 1), wpc(C, 1), wnc(C, 1);
  for (long r = 0; r < R; ++r) {
    for (long c = 0; c < C; ++c) {
      if (P(r, c)) wpr[r] += p.at(r, c), wnr[r] += 1, wpc[c] += p.at(r, c), wnc[c] += 1;
    }
  }
  for (long r = 0; r < R; ++r) {
    if (!close(pr[r], wpr[r], tol) || nr[r] != T(wnr[r])) fail("multi row sums", r, C, pr[r], wpr[r]);
  }
  for (long c = 0; c < C; ++c) {
    if (!close(pc[c], wpc[c], tol) || nc[c] != T(wnc[c])) fail("multi column sums", R, c, pc[c], wpc[c]);
  }
  std::vector<T> lr(R, T(2.5)), wr(R, T(0.75)), ir(R, T(0.4)), lc(C, T(3.0)), wc(C, T(1.25)), ic(C, T(0.3));
  Out<T> out(R * C);
  panels::GradArgs<T, T> ga;
  ga.logits = p.data(), ga.rows = R, ga.cols = C, ga.ld = p.ld, ga.masks = m;
  ga.lse_row = lr.data(), ga.w_row = wr.data(), ga.lse_col = lc.data(), ga.w_col = wc.data();
  ga.inv_n_row = ir.data(), ga.inv_n_col = ic.data(), ga.out = out.data(), ga.ld_out = C;
  panels::grad_launches(ga, contrax::simt::Launch{});
  if (!out.intact()) fail("multi grad: written out of bounds", R, C, 0, 0);
  for (long r = 0; r < R; ++r) {
    for (long c = 0; c < C; ++c) {
      const Real x = p.at(r, c), y = P(r, c) ? 1 : 0;
      const Real want = Real(0.75) * (std::exp(x - Real(2.5)) - y * Real(T(0.4))) +
                        Real(1.25) * (std::exp(x - Real(3.0)) - y * Real(T(0.3)));
      if (!close(out.data()[r * C + c], want, tol)) fail("multi grad", r, c, out.data()[r * C + c], want);
    }
  }
}

template <typename T>
void check_siglip(long R, long C, int sms, double tol, std::mt19937& rng) {
  Panel<T> p(R, C, rng, 6.0);
  const T bias = T(-1.5), factor = T(0.25);
  Out<T> loss(R), grad_sum(R), grad((R + 1) * (C + 1));
  const auto g = panels::strip_grid(R, C, sms);
  std::vector<T> ws(std::max<long>(1, panels::strip_workspace(g, R, 0)), T(12345));
  panels::SiglipArgs<T, T> a;
  a.logits = p.data(), a.rows = R, a.cols = C, a.ld = p.ld, a.bias = &bias, a.own = true, a.factor = &factor;
  a.grad = grad.data(), a.ld_grad = C + 1, a.row_loss = loss.data(), a.row_grad = grad_sum.data(), a.ws = ws.data();
  panels::siglip_launches(a, sms, contrax::simt::Launch{});
  if (!loss.intact() || !grad_sum.intact() || !grad.intact()) fail("siglip: written out of bounds", R, C, 0, 0);
  for (long r = 0; r < R; ++r) {
    Real l = 0, gs = 0;
    for (long c = 0; c < C; ++c) {
      const Real x = Real(p.at(r, c)) + bias, z = r == c ? 1 : -1;
      const Real gx = Real(factor) * (-z / (1 + std::exp(z * x)));
      l += std::log1p(std::exp(-z * x));
      gs += gx;
      if (!close(grad.data()[r * (C + 1) + c], gx, tol)) fail("siglip grad", r, c, grad.data()[r * (C + 1) + c], gx);
    }
    if (grad.data()[r * (C + 1) + C] != T(768)) fail("siglip: written past the last column", r, C, 0, 0);
    if (!close(loss.data()[r], l, tol)) fail("siglip loss", r, C, loss.data()[r], static_cast<double>(l));
    if (!close(grad_sum.data()[r], gs, tol)) fail("siglip grad sum", r, C, grad_sum.data()[r], gs);
  }
}

template <typename T>
void check_all(double tol) {
  std::mt19937 rng(7);
  // Tails of every block: strips of 32 rows, ranges of 256 columns (and the
  // splits that 4 and 132 multiprocessors make), tiles of 8 x 256.
  const long shapes[][2] = {{1, 1}, {7, 9}, {33, 257}, {40, 600}, {65, 300}, {9, 1100}, {300, 3}};
  for (auto s : {contrax::simt::Schedule::kLowestFirst, contrax::simt::Schedule::kHighestFirst}) {
    contrax::simt::set_schedule(s);
    for (const auto& sh : shapes) {
      for (int sms : {1, 4, 132}) {
        check_lse<T>(sh[0], sh[1], sms, tol, rng);
        check_siglip<T>(sh[0], sh[1], sms, tol, rng);
        check_multi<T>(sh[0], sh[1], sms, tol, rng);
      }
      check_grad<T>(sh[0], sh[1], tol, rng);
    }
  }
}

}  // namespace

int main() {
  try {
    check_all<double>(1e-12);
    check_all<float>(2e-5);
  } catch (const contrax::simt::Fault& e) {
    std::printf("FAIL: the emulator found a fault: %s\n", e.what());
    return 1;
  }
  if (failures > 0) {
    std::printf("%d disagreements\n", failures);
    return 1;
  }
  std::printf("every kernel agrees with the reference\n");
  return 0;
}
