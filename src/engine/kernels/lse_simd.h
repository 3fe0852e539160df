// The element-wise passes of the loss engine on raw rows: per-row and
// per-column (max, sum of exponentials) of a logits tile, and the in-place
// turn of a tile into softmax gradients. This header is the implementation;
// it is compiled once per instruction set (lse_simd_base.cpp, _avx2.cpp,
// _avx512.cpp, each with its own -m flags and CONTRAX_SIMD_NS) and the
// dispatcher in src/engine/lse_kernels.cpp picks the widest the CPU runs. No LibTorch
// header here: a precompiled LibTorch header built for the baseline ISA cannot
// be mixed into an AVX-512 translation unit.
//
// Why a kernel at all: ATen spends one pass over the tile per operation (max,
// subtract, exp, sum, log; then subtract, exp, add in backward), and at B = 8192
// those passes cost a quarter of the three GEMMs. Here the forward is two
// passes over a tile (max, then exponentials) and the backward one.
//
// float: a vectorised exp (Cephes' range reduction and degree-6 polynomial,
// about 1 ulp); double, and the float loops' tails: element by element through
// the per-element math that the CUDA kernels share (loss_math.h: exp, the
// shift of a -inf maximum, the softmax gradient element), so that the fp64
// path, on which the tests' references rest, has one definition everywhere.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifndef CONTRAX_SIMD_NS
#error "define CONTRAX_SIMD_NS (the instruction set's namespace) before including lse_simd.h"
#endif
#ifndef CONTRAX_SIMD_BYTES
#error "define CONTRAX_SIMD_BYTES (the vector width in bytes) before including lse_simd.h"
#endif

#include "engine/kernels/loss_math.h"
#include "engine/kernels/lse_simd_api.h"

namespace contrax::detail::kernels::CONTRAX_SIMD_NS {
namespace {

typedef float vf __attribute__((vector_size(CONTRAX_SIMD_BYTES)));
typedef int32_t vi __attribute__((vector_size(CONTRAX_SIMD_BYTES)));
constexpr int64_t kLanes = CONTRAX_SIMD_BYTES / 4;

// Streams are prefetched 2 KiB ahead: on the machines measured here the
// hardware prefetcher does not keep up with a loop that spends ~20 vector
// operations per load, and a cold [8192 x 8192] gradient pass took 140 ms
// without it, 48 ms with it (in cache: 35 ms).
constexpr int64_t kPrefetchFloats = 512;
inline void prefetch_r(const float* p) { __builtin_prefetch(p + kPrefetchFloats, 0, 3); }
inline void prefetch_w(const float* p) { __builtin_prefetch(p + kPrefetchFloats, 1, 3); }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return x - vf{}; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline float hmax(vf v) {
  float m = v[0];
  for (int64_t l = 1; l < kLanes; ++l) m = v[l] > m ? v[l] : m;
  return m;
}
inline float hsum(vf v) {
  float s = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// e^x for every lane. x = n ln2 + r with |r| <= ln2/2 (n rounded to nearest
// through the 1.5 * 2^23 trick, ln2 split in two for an exact product), e^r by
// Cephes' expf polynomial, and 2^n applied as two powers 2^(n/2) 2^(n - n/2)
// so that denormal results and the overflow to +inf come out right without a
// special case. x < -104 (below the smallest denormal) gives 0, -inf included;
// NaN stays NaN (every comparison with it is false, so no select replaces it).
inline vf vexp(vf x) {
  const float lo = -104.0f, hi = 89.0f;
  vf xc = x < lo ? splat(lo) : x;
  xc = xc > hi ? splat(hi) : xc;
  const vf round = splat(12582912.0f);  // 1.5 * 2^23
  vf n = (xc * splat(1.44269504088896341f) + round) - round;
  vf r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  vf y = p * (r * r) + r + splat(1.0f);
  vi ni = __builtin_convertvector(n, vi);
  vi n1 = ni >> 1, n2 = ni - n1;
  vi b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  vf s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  y = y * s1 * s2;
  return x < lo ? vf{} : y;
}

// The shift used for a max: a -inf max (an empty or fully masked row or
// column) shifts by 0, so its sum is 0 and its log-sum-exp -inf, not NaN.
using math::shift_of;

// Rows of one block of stats_impl: about 1 MiB of the tile, so that the
// second pass over the block reads it from cache.
template <typename T>
int64_t block_rows(int64_t C) {
  const int64_t per_row = C * static_cast<int64_t>(sizeof(T));
  return per_row >= (int64_t{1} << 20) ? 1 : (int64_t{1} << 20) / per_row;
}

// Row statistics are complete per row of the tile. Column statistics are
// running ones, carried across calls and row blocks: a block's column maxima
// raise the shift where they exceed it, the running sum is rescaled by
// exp(old - new) there (rare after the first blocks), and the block's
// exponentials are added under the new shift.
template <typename T>
void stats_impl(const T* x, int64_t R, int64_t C, int64_t ld, T* row_max, T* row_sum, T* col_max, T* col_sum,
                T* col_shift) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const bool rows = row_max != nullptr, cols = col_max != nullptr;
  std::vector<T> bmax(cols ? C : 0);  // running maxima including this block
  const int64_t step = block_rows<T>(C);
  for (int64_t b0 = 0; b0 < R; b0 += step) {
    const int64_t b1 = std::min(R, b0 + step);
    if (cols) std::copy(col_max, col_max + C, bmax.begin());
    // Pass 1: maxima.
    for (int64_t i = b0; i < b1; ++i) {
      const T* xi = x + i * ld;
      T m = kNegInf;
      int64_t j = 0;
      if constexpr (std::is_same_v<T, float>) {
        vf vm = splat(kNegInf);
        for (; j + kLanes <= C; j += kLanes) {
          prefetch_r(xi + j);
          const vf v = load(xi + j);
          vm = vmax(vm, v);
          if (cols) store(bmax.data() + j, vmax(load(bmax.data() + j), v));
        }
        m = hmax(vm);
      }
      for (; j < C; ++j) {
        m = xi[j] > m ? xi[j] : m;
        if (cols) bmax[j] = xi[j] > bmax[j] ? xi[j] : bmax[j];
      }
      if (rows) row_max[i] = shift_of(m);
    }
    if (cols) {
      for (int64_t j = 0; j < C; ++j) {
        const T s = shift_of(bmax[j]);
        if (s != col_shift[j]) {
          if (col_sum[j] != T(0)) col_sum[j] *= math::exp_of(col_shift[j] - s);
          col_shift[j] = s;
        }
        col_max[j] = bmax[j];
      }
    }
    // Pass 2: sums of exponentials, both directions from the same loads.
    for (int64_t i = b0; i < b1; ++i) {
      const T* xi = x + i * ld;
      const T mi = rows ? row_max[i] : T(0);
      T s = T(0);
      int64_t j = 0;
      if constexpr (std::is_same_v<T, float>) {
        vf vs{};
        const vf vmi = splat(mi);
        for (; j + kLanes <= C; j += kLanes) {
          prefetch_r(xi + j);
          const vf v = load(xi + j);
          if (rows) vs += vexp(v - vmi);
          if (cols) store(col_sum + j, load(col_sum + j) + vexp(v - load(col_shift + j)));
        }
        s = hsum(vs);
      }
      for (; j < C; ++j) {
        if (rows) s += math::exp_of(xi[j] - mi);
        if (cols) col_sum[j] += math::exp_of(xi[j] - col_shift[j]);
      }
      if (rows) row_sum[i] = s;
    }
  }
}

template <typename T>
void grad_impl(T* x, int64_t R, int64_t C, int64_t ld, const T* lse_row, const T* w_row, const T* lse_col,
               const T* w_col) {
  for (int64_t i = 0; i < R; ++i) {
    T* xi = x + i * ld;
    const T li = lse_row[i], wi = w_row ? w_row[i] : T(1);
    int64_t j = 0;
    if constexpr (std::is_same_v<T, float>) {
      const vf vl = splat(li), vw = splat(wi);
      if (!lse_col) {
        for (; j + kLanes <= C; j += kLanes) {
          prefetch_w(xi + j);
          store(xi + j, vw * vexp(load(xi + j) - vl));
        }
      } else if (!w_col) {
        for (; j + kLanes <= C; j += kLanes) {
          prefetch_w(xi + j);
          const vf v = load(xi + j);
          store(xi + j, vw * vexp(v - vl) + vexp(v - load(lse_col + j)));
        }
      } else {
        for (; j + kLanes <= C; j += kLanes) {
          prefetch_w(xi + j);
          const vf v = load(xi + j);
          store(xi + j, vw * vexp(v - vl) + load(w_col + j) * vexp(v - load(lse_col + j)));
        }
      }
    }
    // The element without a positive (the engine subtracts Y afterwards);
    // a masked entry gives 0 even in a fully masked row.
    for (; j < C; ++j) {
      xi[j] = math::contrastive_grad(xi[j], li, wi, lse_col != nullptr, lse_col ? lse_col[j] : T(0),
                                     w_col ? w_col[j] : T(1), false);
    }
  }
}

template <typename T>
void exp_rows_impl(T* x, int64_t R, int64_t C, int64_t ld, T shift, T* row_sum, T* col_sum) {
  for (int64_t i = 0; i < R; ++i) {
    T* xi = x + i * ld;
    T s = T(0);
    int64_t j = 0;
    if constexpr (std::is_same_v<T, float>) {
      vf vs{};
      const vf vsh = splat(shift);
      if (col_sum) {
        for (; j + kLanes <= C; j += kLanes) {
          prefetch_w(xi + j);
          const vf e = vexp(load(xi + j) - vsh);
          store(xi + j, e);
          store(col_sum + j, load(col_sum + j) + e);
          vs += e;
        }
      } else {
        for (; j + kLanes <= C; j += kLanes) {
          prefetch_w(xi + j);
          const vf e = vexp(load(xi + j) - vsh);
          store(xi + j, e);
          vs += e;
        }
      }
      s = hsum(vs);
    }
    for (; j < C; ++j) {
      xi[j] = math::exp_of(xi[j] - shift);
      s += xi[j];
      if (col_sum) col_sum[j] += xi[j];
    }
    row_sum[i] = s;
  }
}

template <typename T>
void scale_impl(T* x, int64_t R, int64_t C, int64_t ld, const T* a, const T* b) {
  for (int64_t i = 0; i < R; ++i) {
    T* xi = x + i * ld;
    int64_t j = 0;
    if constexpr (std::is_same_v<T, float>) {
      const vf va = splat(a[i]);
      for (; j + kLanes <= C; j += kLanes) {
        prefetch_w(xi + j);
        store(xi + j, load(xi + j) * (va + load(b + j)));
      }
    }
    for (; j < C; ++j) xi[j] *= a[i] + b[j];
  }
}

template <typename T>
void scaled_impl(const T* x, int64_t ldx, int64_t R, int64_t C, const T* a, const T* b, T c, T* t, int64_t ldt) {
  for (int64_t i = 0; i < R; ++i) {
    const T* xi = x + i * ldx;
    T* ti = t + i * ldt;
    int64_t j = 0;
    if constexpr (std::is_same_v<T, float>) {
      const vf va = splat(a[i]), vc = splat(c);
      for (; j + kLanes <= C; j += kLanes) {
        prefetch_r(xi + j);
        store(ti + j, va * load(b + j) * load(xi + j) + vc);
      }
    }
    for (; j < C; ++j) ti[j] = a[i] * b[j] * xi[j] + c;
  }
}

template <typename T>
void scaled_exp_impl(const T* x, int64_t ldx, int64_t R, int64_t C, const T* a, const T* b, T c, T shift,
                     T* row_sum, T* col_sum) {
  for (int64_t i = 0; i < R; ++i) {
    const T* xi = x + i * ldx;
    T s = T(0);
    int64_t j = 0;
    if constexpr (std::is_same_v<T, float>) {
      const vf va = splat(a[i]), vc = splat(c), vsh = splat(shift);
      vf vs{};
      for (; j + kLanes <= C; j += kLanes) {
        prefetch_r(xi + j);
        const vf e = vexp(va * load(b + j) * load(xi + j) + vc - vsh);
        vs += e;
        if (col_sum) store(col_sum + j, load(col_sum + j) + e);
      }
      s = hsum(vs);
    }
    for (; j < C; ++j) {
      const T e = math::exp_of(a[i] * b[j] * xi[j] + c - shift);
      s += e;
      if (col_sum) col_sum[j] += e;
    }
    row_sum[i] = s;
  }
}

// A vector of a float row, prefetching ahead; for double (whose rows go
// element by element, never through a vector) a zero vector, so that code
// generic in T compiles.
template <typename T>
vf load_lanes(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    prefetch_r(p);
    return load(p);
  } else {
    return vf{};
  }
}

// The raw products' gradient pass of raw_grad and bounded_raw_grad: each
// entry's gradient g_ij (grad_v on a vector of x and b, float only; grad_s
// on one entry), the
// sums sum_j g b x, sum_j g and col_gx_j += sum_i g a x from x, and
// h_ij <- [h_ij +] k a_i b_j g_ij (h may be x when !add).
template <typename T, typename GradV, typename GradS>
void raw_grad_rows(const T* x, int64_t ldx, T* h, int64_t ldh, int64_t R, int64_t C, const T* a, const T* b, T k,
                   bool add, T* row_gx, T* row_g, T* col_gx, GradV grad_v, GradS grad_s) {
  for (int64_t i = 0; i < R; ++i) {
    const T* xi = x + i * ldx;
    T* hi = h + i * ldh;
    T gx = T(0), gs = T(0);
    int64_t j = 0;
    if constexpr (std::is_same_v<T, float>) {
      const vf va = splat(a[i]), vka = splat(k * a[i]);
      vf vgx{}, vgs{};
      for (; j + kLanes <= C; j += kLanes) {
        prefetch_r(xi + j);
        prefetch_w(hi + j);
        const vf vb = load(b + j), vx = load(xi + j), vg = grad_v(i, j, vx, vb), gxv = vg * vx;
        store(hi + j, add ? load(hi + j) + vka * vb * vg : vka * vb * vg);
        vgx += gxv * vb;
        vgs += vg;
        store(col_gx + j, load(col_gx + j) + va * gxv);
      }
      gx = hsum(vgx), gs = hsum(vgs);
    }
    for (; j < C; ++j) {
      const T xij = xi[j], g = grad_s(i, j, xij);
      hi[j] = add ? hi[j] + k * a[i] * b[j] * g : k * a[i] * b[j] * g;
      gx += g * xij * b[j];
      gs += g;
      col_gx[j] += a[i] * g * xij;
    }
    row_gx[i] = gx;
    row_g[i] = gs;
  }
}

template <typename T>
void raw_grad_impl(T* x, int64_t ldx, const T* g, int64_t ldg, int64_t R, int64_t C, const T* a, const T* b, T k,
                   T* row_gx, T* row_g, T* col_gx) {
  raw_grad_rows(
      x, ldx, x, ldx, R, C, a, b, k, false, row_gx, row_g, col_gx,
      [&](int64_t i, int64_t j, vf, vf) { return load_lanes(g + i * ldg + j); },
      [&](int64_t i, int64_t j, T) { return g[i * ldg + j]; });
}

template <typename T>
void bounded_raw_grad_impl(const T* x, int64_t ldx, T* h, int64_t ldh, int64_t R, int64_t C, const T* a,
                           const T* b, T c, T shift, const T* u, const T* v, T k, bool add, T* row_gx, T* row_g,
                           T* col_gx) {
  raw_grad_rows(
      x, ldx, h, ldh, R, C, a, b, k, add, row_gx, row_g, col_gx,
      [&](int64_t i, int64_t j, vf vx, vf vb) {
        return vexp(splat(a[i]) * vb * vx + splat(c - shift)) * (splat(u[i]) + load_lanes(v + j));
      },
      [&](int64_t i, int64_t j, T xij) { return math::exp_of(a[i] * b[j] * xij + c - shift) * (u[i] + v[j]); });
}

void exp_f(const float* x, float* y, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store(y + j, vexp(load(x + j)));
  if (j < n) {  // the tail through the same polynomial, one padded vector
    float buf[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) buf[l] = j + l < n ? x[j + l] : 0.0f;
    const vf v = vexp(load(buf));
    for (int64_t l = 0; j + l < n; ++l) y[j + l] = v[l];
  }
}

}  // namespace

const Table& table() {
  static const Table t{{stats_impl<float>, grad_impl<float>, exp_rows_impl<float>, scale_impl<float>,
                        scaled_impl<float>, scaled_exp_impl<float>, raw_grad_impl<float>,
                        bounded_raw_grad_impl<float>},
                       {stats_impl<double>, grad_impl<double>, exp_rows_impl<double>, scale_impl<double>,
                        scaled_impl<double>, scaled_exp_impl<double>, raw_grad_impl<double>,
                        bounded_raw_grad_impl<double>},
                       exp_f};
  return t;
}

}  // namespace contrax::detail::kernels::CONTRAX_SIMD_NS
