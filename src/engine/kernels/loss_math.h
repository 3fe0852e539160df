// The per-element math of the loss engine, one definition for every place that
// computes it: the CPU kernels (lse_simd.h's scalar loops and its fp64 path),
// the CUDA panel kernels (cuda_*_panel.cuh), also when the SIMT emulator
// (tests/support/simt.h) runs them on the CPU. Every function is
// `__host__ __device__` under nvcc and plain `inline` C++ elsewhere,
// templated on the scalar type so that the tests run it in fp64
// (tests/engine/loss_math_test.cpp). No LibTorch and no
// standard-library call that device code lacks: only exp, log and log1p
// through the overloads below.
//
// Conventions, the same as the ATen path's (src/engine/lse_kernels.cpp):
//  * A log-sum-exp is kept as an online pair (m, s): m the largest element so
//    far, s the sum of exp(x - m). Empty or all -inf: (-inf, 0), whose
//    log-sum-exp is -inf, never NaN. A +inf element (and no NaN) gives +inf;
//    a NaN element gives NaN (as torch::logsumexp does).
//  * A masked logit is -inf: its softmax term is 0 even where the whole row is
//    masked (lse = -inf), so a fully masked row has gradient 0, not NaN.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define CONTRAX_HD __host__ __device__ __forceinline__
#else
#define CONTRAX_HD inline
#endif

namespace contrax::detail::math {

// ---- the elementary functions, per type (float on a GPU: the full-precision
// expf/logf, not the __expf intrinsic, so CPU and GPU agree to an ulp)

CONTRAX_HD float exp_of(float x) { return expf(x); }
CONTRAX_HD double exp_of(double x) { return exp(x); }
CONTRAX_HD float log_of(float x) { return logf(x); }
CONTRAX_HD double log_of(double x) { return log(x); }
CONTRAX_HD float log1p_of(float x) { return log1pf(x); }
CONTRAX_HD double log1p_of(double x) { return log1p(x); }

template <typename T>
CONTRAX_HD T inf() {
  return static_cast<T>(INFINITY);
}

// ---- online log-sum-exp

/// A running log-sum-exp: lse = m + log(s).
template <typename T>
struct MaxSum {
  T m, s;
};

template <typename T>
CONTRAX_HD MaxSum<T> empty_pair() {
  return {-inf<T>(), T(0)};
}

/// The shift of a maximum: a -inf maximum (an empty or fully masked row)
/// shifts by 0, so that exp(x - shift) is 0 rather than NaN. The CPU kernels'
/// two-pass form (maxima, then sums) uses it.
template <typename T>
CONTRAX_HD T shift_of(T m) {
  return m == -inf<T>() ? T(0) : m;
}

/// Adds element x to the pair. A larger x rescales the sum (exp(old - new));
/// x equal to the maximum adds exp(0) = 1 except for -inf (nothing) and +inf
/// (1, where x - m would be NaN); a NaN x falls through to exp(NaN) = NaN.
template <typename T>
CONTRAX_HD void add(MaxSum<T>& p, T x) {
  if (x > p.m) {
    p.s = p.s * exp_of(p.m - x) + T(1);  // exp(-inf) = 0 for the first element
    p.m = x;
  } else if (x == p.m) {
    if (x != -inf<T>()) p.s += T(1);
  } else {
    p.s += exp_of(x - p.m);
  }
}

/// The pair of two disjoint sets of elements. The factor of the smaller
/// maximum is 1 where both are equal (both -inf or both +inf included), so
/// that no inf - inf appears; a NaN sum stays NaN (NaN * 0 = NaN).
template <typename T>
CONTRAX_HD MaxSum<T> merge(MaxSum<T> a, MaxSum<T> b) {
  if (b.m > a.m) {
    const MaxSum<T> t = a;
    a = b;
    b = t;
  }
  const T f = b.m == a.m ? T(1) : exp_of(b.m - a.m);
  return {a.m, a.s + b.s * f};
}

/// The log-sum-exp of a pair: -inf for an empty one, +inf where m is +inf.
template <typename T>
CONTRAX_HD T finish(MaxSum<T> p) {
  if (p.m == inf<T>() && p.s == p.s) return p.m;
  return p.m + log_of(p.s);
}

// ---- CLIP / InfoNCE / NT-Xent / MoCo v3 / grouped: the gradient element

/// exp(x - lse): a softmax entry of logit x in a row or column of log-sum-exp
/// lse; 0 for a masked (-inf) logit, whatever lse is.
template <typename T>
CONTRAX_HD T softmax_term(T x, T lse) {
  return x == -inf<T>() ? T(0) : exp_of(x - lse);
}

/// Whether global entry (i, j) lies on the diagonal (i, i + offset) (as
/// engine/tiles.h's tile_diagonal): the masked self-pairs of NT-Xent and of
/// BlockSpec::masked, by index instead of by a mask buffer.
CONTRAX_HD bool on_diagonal(int64_t i, int64_t j, int64_t offset) { return j == i + offset; }

/// Whether global column j is the designated positive of local row i on a
/// rank whose rows start at global row `offset`, with g key columns per row:
/// pos(i) = (offset + i) g (engine/block.h).
CONTRAX_HD bool is_positive(int64_t i, int64_t j, int64_t offset, int64_t g) { return j == (offset + i) * g; }

/// The gradient of sum_u w_u l_u with respect to one logit x_ij (derived in
/// engine/block.h), before the common factor c:
///   w_row (exp(x - lse_row) - y_row) [+ w_col (exp(x - lse_col) - y_col)]
/// with the targets y_row = Y_ij, y_col = Yc_ij (multi-positive labels: P_ij
/// / n_i and P_ij / m_j); `symmetric` adds the column term. A masked entry
/// (-inf, never a positive) gives 0.
template <typename T>
CONTRAX_HD T contrastive_grad_y(T x, T lse_row, T w_row, T y_row, bool symmetric, T lse_col, T w_col, T y_col) {
  T g = w_row * (softmax_term(x, lse_row) - y_row);
  if (symmetric) g += w_col * (softmax_term(x, lse_col) - y_col);
  return g;
}

/// The same with y_row = y_col = 1 on the designated positive, else 0.
template <typename T>
CONTRAX_HD T contrastive_grad(T x, T lse_row, T w_row, bool symmetric, T lse_col, T w_col, bool positive) {
  const T y = positive ? T(1) : T(0);
  return contrastive_grad_y(x, lse_row, w_row, y, symmetric, lse_col, w_col, y);
}

// ---- SigLIP: the pairwise sigmoid element

/// softplus(y) = log(1 + e^y) = max(y, 0) + log1p(e^-|y|): no overflow for
/// large |y| (the loss of a pair with y = -z x, z = +1 on positives).
template <typename T>
CONTRAX_HD T softplus(T y) {
  const T a = y < T(0) ? -y : y;  // |y|; NaN stays NaN
  return (y > T(0) ? y : T(0)) + log1p_of(exp_of(-a));
}

/// sigmoid(y) = 1 / (1 + e^-y), through e^-|y| <= 1 so that neither branch
/// overflows: e^y / (1 + e^y) for y < 0.
template <typename T>
CONTRAX_HD T sigmoid(T y) {
  if (y >= T(0)) return T(1) / (T(1) + exp_of(-y));
  const T e = exp_of(y);
  return e / (T(1) + e);  // y NaN: NaN
}

/// One SigLIP pair: logit x (scale and bias applied), label z = +1 on a
/// positive and -1 otherwise.
template <typename T>
struct SigmoidPair {
  T loss;  // softplus(-z x) = -log sigmoid(z x)
  T grad;  // d loss / d x = -z sigmoid(-z x)
};

template <typename T>
CONTRAX_HD SigmoidPair<T> siglip_pair(T x, bool positive) {
  const T y = positive ? -x : x;  // y = -z x
  const T s = sigmoid(y);
  return {softplus(y), positive ? -s : s};
}

}  // namespace contrax::detail::math
