// The raw interface of the engine's element-wise kernels (see lse_simd.h), one
// table per instruction set. Single-threaded on one tile; src/engine/lse_kernels.cpp
// splits work across threads and wraps them for tensors.
#pragma once

#include <cstdint>
#include <type_traits>

namespace contrax::detail::kernels {

// The kernels for one element type T (float: vectorised; double: scalar).
template <typename T>
struct Kernels {
  // Over the [R, C] tile x (row stride ld). Rows (row_max non-null): row i's
  // shift m_i (its max, or 0 when that is -inf) to row_max[i] and
  // sum_j exp(x_ij - m_i) to row_sum[i]. Columns (col_max non-null): running
  // statistics carried across calls, which the caller starts at col_max = -inf,
  // col_sum = 0, col_shift = 0: col_max[j] the maximum so far, col_sum[j] the
  // sum of exp(x_ij - col_shift[j]) so far. log-sum-exp = shift + log(sum).
  void (*stats)(const T* x, int64_t R, int64_t C, int64_t ld, T* row_max, T* row_sum, T* col_max, T* col_sum,
                T* col_shift);
  // In place: x_ij <- w_row_i exp(x_ij - lse_row_i) [+ w_col_j exp(x_ij - lse_col_j)];
  // a null weight is 1, a null lse_col drops the column term.
  void (*grad)(T* x, int64_t R, int64_t C, int64_t ld, const T* lse_row, const T* w_row, const T* lse_col,
               const T* w_col);
  // In place: x_ij <- exp(x_ij - shift), row_sum[i] = sum_j of the new x_ij,
  // and, when col_sum is non-null, col_sum[j] += sum_i of them (softmax
  // numerators under a known upper bound `shift`, both directions).
  void (*exp_rows)(T* x, int64_t R, int64_t C, int64_t ld, T shift, T* row_sum, T* col_sum);
  // In place: x_ij <- x_ij (a_i + b_j).
  void (*scale)(T* x, int64_t R, int64_t C, int64_t ld, const T* a, const T* b);
  // Matryoshka's shared pass (src/engine/prefix_block.cpp) over the raw
  // products x of one prefix (row stride ldx), whose logits are
  // t_ij = a_i b_j x_ij + c. scaled: t (row stride ldt) <- those logits.
  void (*scaled)(const T* x, int64_t ldx, int64_t R, int64_t C, const T* a, const T* b, T c, T* t, int64_t ldt);
  // scaled_exp: under a bound `shift` on every t_ij, row_sum[i] =
  // sum_j exp(t_ij - shift) and, where col_sum is non-null, col_sum[j] +=
  // sum_i of them; t itself is not written.
  void (*scaled_exp)(const T* x, int64_t ldx, int64_t R, int64_t C, const T* a, const T* b, T c, T shift,
                     T* row_sum, T* col_sum);
  // With g the tile's gradient (row stride ldg), in place over x:
  // x_ij <- k a_i b_j g_ij (the raw products' gradient), after
  // row_gx[i] = sum_j g_ij b_j x_ij, row_g[i] = sum_j g_ij and
  // col_gx[j] += sum_i g_ij a_i x_ij are taken from the old x.
  void (*raw_grad)(T* x, int64_t ldx, const T* g, int64_t ldg, int64_t R, int64_t C, const T* a, const T* b, T k,
                   T* row_gx, T* row_g, T* col_gx);
  // The two above in one pass under a bound: g_ij = exp(t_ij - shift)
  // (u_i + v_j) (scaled's gradient, no -Y terms) taken from x, its sums as
  // raw_grad's, and h_ij (row stride ldh; x itself allowed when !add)
  // <- [h_ij +] k a_i b_j g_ij; x is only read.
  void (*bounded_raw_grad)(const T* x, int64_t ldx, T* h, int64_t ldh, int64_t R, int64_t C, const T* a,
                           const T* b, T c, T shift, const T* u, const T* v, T k, bool add, T* row_gx, T* row_g,
                           T* col_gx);
};

struct Table {
  Kernels<float> f;
  Kernels<double> d;
  // y = exp(x) elementwise through the vector exp (for its accuracy test).
  void (*exp_f)(const float* x, float* y, int64_t n);

  template <typename T>
  const Kernels<T>& of() const {
    if constexpr (std::is_same_v<T, float>) {
      return f;
    } else {
      return d;
    }
  }
};

namespace base {
const Table& table();
}
namespace avx2 {
const Table& table();
}
namespace avx512 {
const Table& table();
}

}  // namespace contrax::detail::kernels
