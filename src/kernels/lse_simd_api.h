// The raw interface of the engine's element-wise kernels (see lse_simd.h), one
// table per instruction set. Single-threaded on one tile; src/lse_kernels.cpp
// splits work across threads and wraps them for tensors.
#pragma once

#include <cstdint>

namespace contrax::detail::kernels {

struct Table {
  // Over the [R, C] tile x (row stride ld). Rows (row_max non-null): row i's
  // shift m_i (its max, or 0 when that is -inf) to row_max[i] and
  // sum_j exp(x_ij - m_i) to row_sum[i]. Columns (col_max non-null): running
  // statistics carried across calls, which the caller starts at col_max = -inf,
  // col_sum = 0, col_shift = 0: col_max[j] the maximum so far, col_sum[j] the
  // sum of exp(x_ij - col_shift[j]) so far. log-sum-exp = shift + log(sum).
  void (*stats_f)(const float* x, int64_t R, int64_t C, int64_t ld, float* row_max, float* row_sum, float* col_max,
                  float* col_sum, float* col_shift);
  void (*stats_d)(const double* x, int64_t R, int64_t C, int64_t ld, double* row_max, double* row_sum, double* col_max,
                  double* col_sum, double* col_shift);
  // In place: x_ij <- w_row_i exp(x_ij - lse_row_i) [+ w_col_j exp(x_ij - lse_col_j)];
  // a null weight is 1, a null lse_col drops the column term.
  void (*grad_f)(float* x, int64_t R, int64_t C, int64_t ld, const float* lse_row, const float* w_row,
                 const float* lse_col, const float* w_col);
  void (*grad_d)(double* x, int64_t R, int64_t C, int64_t ld, const double* lse_row, const double* w_row,
                 const double* lse_col, const double* w_col);
  // In place: x_ij <- exp(x_ij - shift), row_sum[i] = sum_j of the new x_ij,
  // and, when col_sum is non-null, col_sum[j] += sum_i of them (softmax
  // numerators under a known upper bound `shift`, both directions).
  void (*exp_rows_f)(float* x, int64_t R, int64_t C, int64_t ld, float shift, float* row_sum, float* col_sum);
  void (*exp_rows_d)(double* x, int64_t R, int64_t C, int64_t ld, double shift, double* row_sum, double* col_sum);
  // In place: x_ij <- x_ij (a_i + b_j).
  void (*scale_f)(float* x, int64_t R, int64_t C, int64_t ld, const float* a, const float* b);
  void (*scale_d)(double* x, int64_t R, int64_t C, int64_t ld, const double* a, const double* b);
  // y = exp(x) elementwise through the vector exp (for its accuracy test).
  void (*exp_f)(const float* x, float* y, int64_t n);
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
