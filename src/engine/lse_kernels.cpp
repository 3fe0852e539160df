// Tensor-level front of the fused element-wise kernels (see engine/lse_kernels.h
// and src/engine/kernels/lse_simd.h): instruction-set dispatch, the split over
// intra-op threads, the CUDA panel kernels' switch and the ATen fallback.
#include "engine/lse_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>
#include <vector>

#include "engine/cuda_kernels_built.h"  // generated: CONTRAX_CUDA_KERNELS_BUILT
#include "engine/kernels/lse_simd_api.h"
#include "engine/panel_kernels.h"
#include "util/env.h"

// With LibTorch's OpenMP backend, at::parallel_for is a `#pragma omp
// parallel` inlined here: without -fopenmp it runs every split on one thread
// (CMakeLists.txt links OpenMP into every layer).
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "src/engine/lse_kernels.cpp needs -fopenmp: at::parallel_for would run its splits on one thread"
#endif

namespace contrax::detail {

namespace {

// The instruction sets in order of preference; CMakeLists.txt compiles the
// AVX2 and AVX-512 tables on x86-64 only.
constexpr const char* kIsas[] = {"avx512", "avx2", "baseline"};

bool cpu_runs(const std::string& isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == "baseline";
}

const kernels::Table& table_of(const std::string& isa) {
#if defined(__x86_64__)
  if (isa == "avx512") return kernels::avx512::table();
  if (isa == "avx2") return kernels::avx2::table();
#endif
  return kernels::base::table();
}

// The instruction set in use, as {name, table}: the widest the CPU runs,
// switchable for tests (set_fused_kernels_isa).
struct Active {
  std::atomic<const kernels::Table*> table;
  std::atomic<const char*> name;
};

Active& active() {
  static Active a = [] {
    for (const char* isa : kIsas) {
      if (cpu_runs(isa)) return Active{{&table_of(isa)}, {isa}};
    }
    return Active{{&table_of("baseline")}, {"baseline"}};
  }();
  return a;
}

template <typename T>
const kernels::Kernels<T>& kernels_for() {
  return active().table.load(std::memory_order_relaxed)->of<T>();
}

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{env_on("CONTRAX_FUSED_KERNELS")};
  return on;
}

std::atomic<bool>& cuda_flag() {
  static std::atomic<bool> on{env_set("CONTRAX_FUSED_KERNELS")};
  return on;
}

std::atomic<bool>& bounded_flag() {
  static std::atomic<bool> on{env_on("CONTRAX_BOUNDED_SHIFT")};
  return on;
}

// The CPU kernels: not while the CPU stands in for CUDA (emulated panel
// kernels installed), where CUDA's kernels and ATen forms run instead.
bool fused_applies(const torch::Tensor& t) {
  return enabled_flag().load(std::memory_order_relaxed) && t.device().is_cpu() &&
         !emulated_panel_kernels_installed() && t.dim() == 2 &&
         (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kDouble) &&
         (t.size(1) <= 1 || t.stride(0) >= t.size(1)) && (t.size(1) <= 1 || t.stride(1) == 1);
}

bool cuda_fused_options(const torch::TensorOptions& options) { return cuda_fused_device(options).has_value(); }

// Tiles sent to the CUDA panel kernels (cuda_panel_calls).
std::atomic<int64_t>& cuda_calls() {
  static std::atomic<int64_t> n{0};
  return n;
}

// ... and whether the tile `t` does: 2-D, unit column stride, rows apart.
bool cuda_fused_applies(const torch::Tensor& t) {
  return cuda_fused_options(t.options()) && t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1) &&
         (t.size(0) <= 1 || t.stride(0) >= t.size(1));
}

// Vectors the kernels read or write: contiguous, t's dtype and device.
torch::Tensor vec(const torch::Tensor& v, const torch::Tensor& like) {
  if (!v.defined()) return v;
  return v.to(like.options()).contiguous();
}

// T* of an optional tensor (null when undefined).
template <typename T>
T* ptr(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

int64_t row_stride(const torch::Tensor& t) { return std::max<int64_t>(t.stride(0), 1); }

// Rows are independent: `fn(r0, r1)` on row ranges of at least ~64k elements,
// split over the intra-op threads.
template <typename Fn>
void for_row_ranges(const torch::Tensor& t, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, t.size(1)));
  at::parallel_for(0, t.size(0), grain, fn);
}

// A pass that accumulates per column (column statistics, column sums) is
// split by columns instead: each part owns its columns' state and visits every
// row, so its per-row results are partial and the caller combines them. The
// number of parts (0: do not split; one thread or a small tile).
int64_t column_parts(const torch::Tensor& t) {
  const int64_t R = t.size(0), C = t.size(1), threads = at::get_num_threads();
  if (threads <= 1 || R * C < (int64_t{1} << 17) || C < 256) return 0;
  return std::min<int64_t>(threads, C / 128);
}

// fn(p, c0, c) for each of `parts` column ranges [c0, c0 + c), in parallel.
template <typename Fn>
void for_column_parts(int64_t C, int64_t parts, Fn fn) {
  const int64_t width = (C + parts - 1) / parts;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * width, c = std::min(width, C - c0);
      if (c > 0) fn(p, c0, c);
    }
  });
}

// The prefix passes' column split (their column sums shared, each part's
// row sums partial, then summed): fn(c0, c, row_gx, row_g) over the column
// ranges [c0, c0 + c), in parallel.
template <typename T, typename Fn>
PrefixSums column_split_sums(const torch::Tensor& x, Fn fn) {
  const int64_t R = x.size(0), parts = std::max<int64_t>(column_parts(x), 1);
  auto pgx = torch::zeros({parts, R}, x.options()), pg = torch::zeros({parts, R}, x.options());  // [parts, R]
  for_column_parts(x.size(1), parts, [&](int64_t p, int64_t c0, int64_t c) { fn(c0, c, ptr<T>(pgx[p]), ptr<T>(pg[p])); });
  return {pgx.sum(0), pg.sum(0)};
}

// One fused pass pair over a tile: row log-sum-exps returned when `rows`;
// column state [cm, cs, csh] (running, offset to the tile's first column)
// updated when non-null.
template <typename T>
torch::Tensor fused_tile(const torch::Tensor& t, bool rows, T* cm, T* cs, T* csh) {
  const int64_t R = t.size(0), C = t.size(1), ld = row_stride(t);
  const T* x = t.data_ptr<T>();
  const auto& k = kernels_for<T>();
  if (R == 0 || C == 0) return rows ? torch::full({R}, -kInf, t.options()) : torch::Tensor();
  const int64_t parts = cm ? column_parts(t) : 0;
  if (parts > 0) {
    // Each part's row statistics, (shift, sum) per row, combined as log-sum-exps.
    torch::Tensor pm, ps;  // [parts, R]
    if (rows) pm = torch::full({parts, R}, -kInf, t.options()), ps = torch::zeros({parts, R}, t.options());
    for_column_parts(C, parts, [&](int64_t p, int64_t c0, int64_t c) {
      k.stats(x + c0, R, c, ld, rows ? ptr<T>(pm[p]) : nullptr, rows ? ptr<T>(ps[p]) : nullptr, cm + c0, cs + c0,
              csh + c0);
    });
    return rows ? (pm + ps.log()).logsumexp(0) : torch::Tensor();
  }
  torch::Tensor rm, rs;  // [R]
  if (rows) rm = torch::empty({R}, t.options()), rs = torch::empty({R}, t.options());
  if (cm) {
    k.stats(x, R, C, ld, ptr<T>(rm), ptr<T>(rs), cm, cs, csh);
  } else {
    for_row_ranges(t, [&](int64_t r0, int64_t r1) {
      k.stats(x + r0 * ld, r1 - r0, C, ld, ptr<T>(rm) + r0, ptr<T>(rs) + r0, nullptr, nullptr, nullptr);
    });
  }
  return rows ? rm + rs.log_() : torch::Tensor();
}

// A -inf maximum (every entry -inf, or none) becomes the shift 0, so the
// exponentials give 0 and the log-sum-exp -inf instead of NaN; NaN and +inf
// maxima stay (they propagate, as torch::logsumexp's). One pass, not a
// comparison and a masked fill.
void fully_masked_shift_(torch::Tensor& m) {
  m.nan_to_num_(std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), 0.0);
}

// The ATen forms (CUDA, half precision, odd strides): one [R, C] temporary.
torch::Tensor aten_rows_lse(const torch::Tensor& x) {
  if (x.size(1) == 0) return torch::full({x.size(0)}, -kInf, x.options());
  auto m = x.amax(1);  // [R]
  fully_masked_shift_(m);
  return (x - m.unsqueeze(1)).exp_().sum(1).log_().add_(m);
}

torch::Tensor aten_cols_lse(const torch::Tensor& x) {
  if (x.size(0) == 0) return torch::full({x.size(1)}, -kInf, x.options());
  auto m = x.amax(0);  // [C]
  fully_masked_shift_(m);
  return (x - m.unsqueeze(0)).exp_().sum(0).log_().add_(m);
}

}  // namespace

bool panel_kernels_take(const torch::Tensor& t) { return cuda_fused_applies(t); }

TileLse tile_lse(const torch::Tensor& t, bool rows, bool cols, const panels::Masks* masks,
                 const torch::Tensor& row_out, const PositiveSums* sums) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2, "tile_lse: expected a 2-D tile, got ", t.sizes());
  TORCH_INTERNAL_ASSERT(!masks || cuda_fused_applies(t), "tile_lse: masks by index are the panel kernels'");
  TileLse out;
  if (cols) {
    ColumnLse acc(t.size(1), t.options());
    out.row = acc.add(t, 0, rows, masks, row_out, sums);
    out.col = acc.lse();
  } else if (rows && fused_applies(t)) {
    AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "tile_lse",
                               [&] { out.row = fused_tile<scalar_t>(t, true, nullptr, nullptr, nullptr); });
  } else if (rows && cuda_fused_applies(t)) {
    ++cuda_calls();
    out.row = panel_tile_lse(*cuda_fused_device(t.options()), t, true, {}, {}, masks, row_out, sums);
  } else if (rows) {
    out.row = aten_rows_lse(t);
  }
  return out;
}

ColumnLse::ColumnLse(int64_t n_cols, const torch::TensorOptions& options)
    : fused_(enabled_flag().load(std::memory_order_relaxed) && options.device().is_cpu() &&
             !emulated_panel_kernels_installed() &&
             (options.dtype() == torch::kFloat || options.dtype() == torch::kDouble)),
      cuda_(cuda_fused_options(options)) {
  if (cuda_ || fused_) {
    // Running pairs (max, sum of exp(x - max)) per column; the CPU kernels sum
    // under a shift of their own.
    max_ = torch::full({n_cols}, -kInf, options);
    sum_ = torch::zeros({n_cols}, options);
    if (fused_) shift_ = torch::zeros({n_cols}, options);
  } else {
    lse_ = torch::full({n_cols}, -kInf, options);
  }
}

torch::Tensor ColumnLse::add(const torch::Tensor& tile, int64_t c0, bool rows, const panels::Masks* masks,
                             const torch::Tensor& row_out, const PositiveSums* sums) {
  TORCH_INTERNAL_ASSERT(!masks || (cuda_ && cuda_fused_applies(tile)), "ColumnLse: masks by index are the panel kernels'");
  TORCH_INTERNAL_ASSERT(tile.dim() == 2 && c0 >= 0 && c0 + tile.size(1) <= (fused_ || cuda_ ? max_ : lse_).size(0));
  if (cuda_) {
    TORCH_INTERNAL_ASSERT(tile.scalar_type() == max_.scalar_type() && tile.device() == max_.device());
    const auto t = cuda_fused_applies(tile) ? tile : tile.contiguous();
    const int64_t C = t.size(1);
    ++cuda_calls();
    return panel_tile_lse(*cuda_fused_device(t.options()), t, rows, max_.narrow(0, c0, C), sum_.narrow(0, c0, C),
                          masks, rows ? row_out : torch::Tensor(), sums);
  }
  if (!fused_) {
    auto lc = lse_.narrow(0, c0, tile.size(1));
    at::logaddexp_out(lc, lc, aten_cols_lse(tile));  // merged in place: one pass
    return rows ? aten_rows_lse(tile) : torch::Tensor();
  }
  TORCH_INTERNAL_ASSERT(tile.scalar_type() == max_.scalar_type() && tile.device().is_cpu());
  // A tile with a column stride (a transposed view) is copied once: the
  // kernels walk rows.
  const auto t = fused_applies(tile) ? tile : tile.contiguous();
  torch::Tensor row;
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "ColumnLse::add", [&] {
    row = fused_tile<scalar_t>(t, rows, ptr<scalar_t>(max_) + c0, ptr<scalar_t>(sum_) + c0,
                               ptr<scalar_t>(shift_) + c0);
  });
  return row;
}

torch::Tensor ColumnLse::lse() const {
  if (cuda_) return max_ + sum_.log();  // -inf + log(0) = -inf for an empty column
  return fused_ ? shift_ + sum_.log() : lse_.clone();
}

void softmax_grad_into(const torch::Tensor& t, const torch::Tensor& lse_row, const torch::Tensor& w_row,
                       const torch::Tensor& lse_col, const torch::Tensor& w_col, const panels::Masks* masks,
                       const torch::Tensor& factor, const torch::Tensor& out, const PositiveCounts& counts) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && lse_row.numel() == t.size(0) && cuda_fused_applies(t));
  ++cuda_calls();
  if (t.numel() == 0) return;
  auto src = t;
  panel_softmax_grad_(*cuda_fused_device(t.options()), src, vec(lse_row, t), vec(w_row, t), vec(lse_col, t),
                      vec(w_col, t), masks, factor, out, {vec(counts.inv_n_row, t), vec(counts.inv_n_col, t)});
}

void softmax_grad_(torch::Tensor& t, const torch::Tensor& lse_row, const torch::Tensor& w_row,
                   const torch::Tensor& lse_col, const torch::Tensor& w_col, const panels::Masks* masks,
                   const PositiveCounts& counts) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && lse_row.numel() == t.size(0));
  // A tile left unmasked for the kernels must reach them (the switch turned
  // off between a forward and its backward would be a wrong gradient).
  TORCH_CHECK(!masks || cuda_fused_applies(t), "contrax: the fused CUDA kernels were switched off between a loss's "
              "forward and its backward; switch them (CONTRAX_FUSED_KERNELS) only between steps");
  TORCH_INTERNAL_ASSERT(!lse_col.defined() || lse_col.numel() == t.size(1));
  if (cuda_fused_applies(t)) {
    ++cuda_calls();
    if (t.numel() > 0) {
      panel_softmax_grad_(*cuda_fused_device(t.options()), t, vec(lse_row, t), vec(w_row, t), vec(lse_col, t),
                          vec(w_col, t), masks, {}, {}, {vec(counts.inv_n_row, t), vec(counts.inv_n_col, t)});
    }
    return;
  }
  if (!fused_applies(t)) {
    torch::Tensor col;
    if (lse_col.defined()) {
      col = (t - lse_col.unsqueeze(0)).exp_();
      if (w_col.defined()) col.mul_(w_col.unsqueeze(0));
    }
    t.sub_(lse_row.unsqueeze(1)).exp_();
    if (w_row.defined()) t.mul_(w_row.unsqueeze(1));
    if (col.defined()) t.add_(col);
    return;
  }
  if (t.numel() == 0) return;
  auto lr = vec(lse_row, t), wr = vec(w_row, t), lc = vec(lse_col, t), wc = vec(w_col, t);
  const int64_t C = t.size(1), ld = row_stride(t);
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "softmax_grad_", [&] {
    const auto& k = kernels_for<scalar_t>();
    scalar_t* x = t.data_ptr<scalar_t>();
    const scalar_t* pwr = ptr<scalar_t>(wr);
    for_row_ranges(t, [&](int64_t r0, int64_t r1) {
      k.grad(x + r0 * ld, r1 - r0, C, ld, ptr<scalar_t>(lr) + r0, pwr ? pwr + r0 : nullptr, ptr<scalar_t>(lc),
             ptr<scalar_t>(wc));
    });
  });
}

torch::Tensor exp_rows_(torch::Tensor& t, double shift, const torch::Tensor& col_sum) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2);
  TORCH_INTERNAL_ASSERT(!col_sum.defined() || (col_sum.numel() == t.size(1) && col_sum.is_contiguous()));
  if (!fused_applies(t)) {
    t.sub_(shift).exp_();
    if (col_sum.defined()) col_sum.add_(t.sum(0));
    return t.sum(1);
  }
  const int64_t R = t.size(0), C = t.size(1), ld = row_stride(t);
  auto sums = torch::zeros({R}, t.options());  // [R]
  if (R == 0 || C == 0) return sums;
  const int64_t parts = col_sum.defined() ? column_parts(t) : 0;
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "exp_rows_", [&] {
    const auto& k = kernels_for<scalar_t>();
    scalar_t* x = t.data_ptr<scalar_t>();
    const auto s = static_cast<scalar_t>(shift);
    if (parts > 0) {
      // The column sums are shared: split by columns, each part's row sums partial.
      auto ps = torch::zeros({parts, R}, t.options());  // [parts, R]
      for_column_parts(C, parts, [&](int64_t p, int64_t c0, int64_t c) {
        k.exp_rows(x + c0, R, c, ld, s, ptr<scalar_t>(ps[p]), ptr<scalar_t>(col_sum) + c0);
      });
      sums = ps.sum(0);
    } else if (col_sum.defined()) {
      k.exp_rows(x, R, C, ld, s, ptr<scalar_t>(sums), ptr<scalar_t>(col_sum));
    } else {
      for_row_ranges(t, [&](int64_t r0, int64_t r1) {
        k.exp_rows(x + r0 * ld, r1 - r0, C, ld, s, ptr<scalar_t>(sums) + r0, nullptr);
      });
    }
  });
  return sums;
}

void scale_rows_plus_cols_(torch::Tensor& t, const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && a.numel() == t.size(0) && b.numel() == t.size(1));
  if (!fused_applies(t)) {
    t.mul_(a.unsqueeze(1) + b.unsqueeze(0));
    return;
  }
  if (t.numel() == 0) return;
  auto av = vec(a, t), bv = vec(b, t);
  const int64_t C = t.size(1), ld = row_stride(t);
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "scale_rows_plus_cols_", [&] {
    const auto& k = kernels_for<scalar_t>();
    scalar_t* x = t.data_ptr<scalar_t>();
    for_row_ranges(t, [&](int64_t r0, int64_t r1) {
      k.scale(x + r0 * ld, r1 - r0, C, ld, ptr<scalar_t>(av) + r0, ptr<scalar_t>(bv));
    });
  });
}

void scaled_logits_out(torch::Tensor& t, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                       double c) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && t.sizes() == x.sizes() && a.numel() == t.size(0) && b.numel() == t.size(1));
  if (!fused_applies(t) || !fused_applies(x)) {
    at::mul_out(t, x, a.unsqueeze(1)).mul_(b.unsqueeze(0));
    if (c != 0.0) t.add_(c);
    return;
  }
  if (t.numel() == 0) return;
  auto av = vec(a, t), bv = vec(b, t);
  const int64_t C = t.size(1), ldt = row_stride(t), ldx = row_stride(x);
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "scaled_logits_out", [&] {
    const auto& k = kernels_for<scalar_t>();
    for_row_ranges(t, [&](int64_t r0, int64_t r1) {
      k.scaled(x.data_ptr<scalar_t>() + r0 * ldx, ldx, r1 - r0, C, ptr<scalar_t>(av) + r0, ptr<scalar_t>(bv),
               static_cast<scalar_t>(c), t.data_ptr<scalar_t>() + r0 * ldt, ldt);
    });
  });
}

torch::Tensor scaled_exp_sums(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b, double c,
                              double shift, const torch::Tensor& col_sum) {
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && a.numel() == x.size(0) && b.numel() == x.size(1));
  TORCH_INTERNAL_ASSERT(!col_sum.defined() || (col_sum.numel() == x.size(1) && col_sum.is_contiguous()));
  if (!fused_applies(x)) {
    auto e = x * a.unsqueeze(1) * b.unsqueeze(0);
    e.add_(c).sub_(shift).exp_();
    if (col_sum.defined()) col_sum.add_(e.sum(0));
    return e.sum(1);
  }
  const int64_t R = x.size(0), C = x.size(1), ldx = row_stride(x);
  auto sums = torch::zeros({R}, x.options());  // [R]
  if (R == 0 || C == 0) return sums;
  auto av = vec(a, x), bv = vec(b, x);
  const int64_t parts = col_sum.defined() ? column_parts(x) : 0;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scaled_exp_sums", [&] {
    const auto& k = kernels_for<scalar_t>();
    const scalar_t* px = x.data_ptr<scalar_t>();
    const auto cs = static_cast<scalar_t>(c), sh = static_cast<scalar_t>(shift);
    scalar_t *pa = ptr<scalar_t>(av), *pb = ptr<scalar_t>(bv), *pc = ptr<scalar_t>(col_sum);
    if (parts > 0) {
      // The column sums are shared: split by columns, each part's row sums partial.
      auto ps = torch::zeros({parts, R}, x.options());  // [parts, R]
      for_column_parts(C, parts, [&](int64_t p, int64_t c0, int64_t cn) {
        k.scaled_exp(px + c0, ldx, R, cn, pa, pb + c0, cs, sh, ptr<scalar_t>(ps[p]), pc + c0);
      });
      sums = ps.sum(0);
    } else if (col_sum.defined()) {
      k.scaled_exp(px, ldx, R, C, pa, pb, cs, sh, ptr<scalar_t>(sums), pc);
    } else {
      for_row_ranges(x, [&](int64_t r0, int64_t r1) {
        k.scaled_exp(px + r0 * ldx, ldx, r1 - r0, C, pa + r0, pb, cs, sh, ptr<scalar_t>(sums) + r0, nullptr);
      });
    }
  });
  return sums;
}

PrefixSums raw_products_grad_(torch::Tensor& x, const torch::Tensor& g, const torch::Tensor& a,
                              const torch::Tensor& b, const torch::Tensor& k, torch::Tensor& col_gx) {
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && g.sizes() == x.sizes() && col_gx.numel() == x.size(1) &&
                        col_gx.is_contiguous());
  const int64_t R = x.size(0), C = x.size(1);
  if (!fused_applies(x) || !fused_applies(g)) {
    auto gx = g * x;  // [R, C]
    col_gx.add_((gx * a.unsqueeze(1)).sum(0));
    PrefixSums out{(gx * b.unsqueeze(0)).sum(1), g.sum(1)};
    at::mul_out(x, g, (k * a).unsqueeze(1)).mul_(b.unsqueeze(0));
    return out;
  }
  PrefixSums out{torch::zeros({R}, x.options()), torch::zeros({R}, x.options())};
  if (R == 0 || C == 0) return out;
  auto av = vec(a, x), bv = vec(b, x);
  const int64_t ldx = row_stride(x), ldg = row_stride(g);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "raw_products_grad_", [&] {
    const auto& kt = kernels_for<scalar_t>();
    const auto kv = k.item<scalar_t>();
    out = column_split_sums<scalar_t>(x, [&](int64_t c0, int64_t c, scalar_t* row_gx, scalar_t* row_g) {
      kt.raw_grad(x.data_ptr<scalar_t>() + c0, ldx, g.data_ptr<scalar_t>() + c0, ldg, R, c, ptr<scalar_t>(av),
                  ptr<scalar_t>(bv) + c0, kv, row_gx, row_g, ptr<scalar_t>(col_gx) + c0);
    });
  });
  return out;
}

PrefixSums bounded_raw_products_grad(const torch::Tensor& x, torch::Tensor& h, const torch::Tensor& a,
                                     const torch::Tensor& b, double c, double shift, const torch::Tensor& u,
                                     const torch::Tensor& v, const torch::Tensor& k, bool add,
                                     torch::Tensor& col_gx) {
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && h.sizes() == x.sizes() && a.numel() == x.size(0) && b.numel() == x.size(1) &&
                        u.numel() == x.size(0) && v.numel() == x.size(1) && col_gx.numel() == x.size(1) &&
                        col_gx.is_contiguous());
  const int64_t R = x.size(0), C = x.size(1);
  if (!fused_applies(x) || !fused_applies(h)) {
    auto g = x * a.unsqueeze(1) * b.unsqueeze(0);
    g.add_(c).sub_(shift).exp_().mul_(u.unsqueeze(1) + v.unsqueeze(0));
    auto gx = g * x;  // [R, C]
    col_gx.add_((gx * a.unsqueeze(1)).sum(0));
    PrefixSums out{(gx * b.unsqueeze(0)).sum(1), g.sum(1)};
    g.mul_((k * a).unsqueeze(1)).mul_(b.unsqueeze(0));
    add ? h.add_(g) : h.copy_(g);
    return out;
  }
  PrefixSums out{torch::zeros({R}, x.options()), torch::zeros({R}, x.options())};
  if (R == 0 || C == 0) return out;
  auto av = vec(a, x), bv = vec(b, x), uv = vec(u, x), vv = vec(v, x);
  const int64_t ldx = row_stride(x), ldh = row_stride(h);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "bounded_raw_products_grad", [&] {
    const auto& kt = kernels_for<scalar_t>();
    const auto kv = k.item<scalar_t>();
    const auto cs = static_cast<scalar_t>(c), sh = static_cast<scalar_t>(shift);
    out = column_split_sums<scalar_t>(x, [&](int64_t c0, int64_t cn, scalar_t* row_gx, scalar_t* row_g) {
      kt.bounded_raw_grad(x.data_ptr<scalar_t>() + c0, ldx, h.data_ptr<scalar_t>() + c0, ldh, R, cn, ptr<scalar_t>(av),
                          ptr<scalar_t>(bv) + c0, cs, sh, ptr<scalar_t>(uv), ptr<scalar_t>(vv) + c0, kv, add, row_gx,
                          row_g, ptr<scalar_t>(col_gx) + c0);
    });
  });
  return out;
}

bool bounded_shift_enabled() { return bounded_flag().load(std::memory_order_relaxed); }
void set_bounded_shift_enabled(bool on) { bounded_flag().store(on); }

bool fused_kernels_enabled() { return enabled_flag().load(); }
void set_fused_kernels_enabled(bool on) { enabled_flag().store(on); }

// Both switches on, a float/double tensor on a device that has the kernels
// (engine/panel_kernels.h).
std::optional<PanelDevice> cuda_fused_device(const torch::TensorOptions& options) {
  if (!enabled_flag().load(std::memory_order_relaxed) || !cuda_flag().load(std::memory_order_relaxed) ||
      !(options.dtype() == torch::kFloat || options.dtype() == torch::kDouble)) {
    return std::nullopt;
  }
  return panel_device(options);
}

void count_cuda_panel_call() { ++cuda_calls(); }

bool cuda_fused_kernels_built() { return CONTRAX_CUDA_KERNELS_BUILT != 0; }
bool cuda_fused_kernels_enabled() { return cuda_flag().load(); }
int64_t cuda_panel_calls() { return cuda_calls().load(); }
void set_cuda_fused_kernels_enabled(bool on) { cuda_flag().store(on); }

const char* fused_kernels_isa() { return active().name.load(); }

bool set_fused_kernels_isa(const std::string& isa) {
  for (const char* name : kIsas) {
    if (isa == name && cpu_runs(name)) {
      active().table.store(&table_of(name));
      active().name.store(name);
      return true;
    }
  }
  return false;
}

torch::Tensor fused_exp(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat,
              "fused_exp(): argument 'x' must be a CPU float tensor, but got ", x.toString());
  auto in = x.contiguous();
  auto out = torch::empty_like(in);
  active().table.load()->exp_f(in.data_ptr<float>(), out.data_ptr<float>(), in.numel());
  return out;
}

}  // namespace contrax::detail
