// Tensor-level front of the engine's fused element-wise kernels
// (src/kernels/lse_simd.h): instruction-set dispatch, the split over intra-op
// threads, and the ATen fallback for tiles the kernels do not take.
#include "contrax/detail/lse_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/lse_simd_api.h"

namespace contrax::detail {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool cpu_runs(const std::string& isa) {
#if defined(__x86_64__)  // CMakeLists.txt compiles the AVX2 and AVX-512 tables on x86-64
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == "baseline";
}

const kernels::Table* table_of(const std::string& isa) {
#if defined(__x86_64__)
  if (isa == "avx512") return &kernels::avx512::table();
  if (isa == "avx2") return &kernels::avx2::table();
#endif
  return isa == "baseline" ? &kernels::base::table() : nullptr;
}

// The widest instruction set the CPU runs, as {name, table}; switchable for
// tests (set_fused_kernels_isa).
struct Active {
  std::atomic<const kernels::Table*> table;
  std::atomic<const char*> name;
};

Active& active() {
  static Active a = [] {
    for (const char* isa : {"avx512", "avx2"}) {
      if (cpu_runs(isa)) return Active{{table_of(isa)}, {isa}};
    }
    return Active{{table_of("baseline")}, {"baseline"}};
  }();
  return a;
}

const kernels::Table& table() { return *active().table.load(std::memory_order_relaxed); }

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("CONTRAX_FUSED_KERNELS");
    return !(v && std::strcmp(v, "0") == 0);
  }()};
  return on;
}

bool fused_applies(const torch::Tensor& t) {
  return enabled_flag().load(std::memory_order_relaxed) && t.device().is_cpu() && t.dim() == 2 &&
         (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kDouble) &&
         (t.size(1) <= 1 || t.stride(0) >= t.size(1)) && (t.size(1) <= 1 || t.stride(1) == 1);
}

// Vectors the kernels read or write: contiguous, t's dtype, CPU.
torch::Tensor vec(const torch::Tensor& v, const torch::Tensor& like) {
  if (!v.defined()) return v;
  return v.to(like.options()).contiguous();
}

// Units of work for at::parallel_for: at least ~64k elements each, so that a
// small tile stays on one thread.
int64_t grain_rows(int64_t C) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, C)); }

template <typename T>
void call_stats(const T* x, int64_t R, int64_t C, int64_t ld, T* rm, T* rs, T* cm, T* cs, T* csh) {
  if constexpr (std::is_same_v<T, float>) {
    table().stats_f(x, R, C, ld, rm, rs, cm, cs, csh);
  } else {
    table().stats_d(x, R, C, ld, rm, rs, cm, cs, csh);
  }
}

// One fused pass pair over a tile: row log-sum-exps returned when `rows`;
// column state [cm, cs, csh] (running, offset to the tile's first column)
// updated when non-null.
template <typename T>
torch::Tensor fused_tile(const torch::Tensor& t, bool rows, T* cm, T* cs, T* csh) {
  const int64_t R = t.size(0), C = t.size(1), ld = std::max<int64_t>(t.stride(0), 1);
  const T* x = t.data_ptr<T>();
  const auto opt = t.options();
  const bool cols = cm != nullptr;
  if (R == 0 || C == 0) return rows ? torch::full({R}, -kInf, opt) : torch::Tensor();
  torch::Tensor rm, rs;
  if (rows) rm = torch::empty({R}, opt), rs = torch::empty({R}, opt);
  const int64_t threads = at::get_num_threads();
  if (!cols) {
    // Rows are independent: split them.
    at::parallel_for(0, R, grain_rows(C), [&](int64_t r0, int64_t r1) {
      call_stats<T>(x + r0 * ld, r1 - r0, C, ld, rm.data_ptr<T>() + r0, rs.data_ptr<T>() + r0, nullptr, nullptr,
                    nullptr);
    });
  } else if (threads <= 1 || R * C < (int64_t{1} << 17) || C < 256) {
    call_stats<T>(x, R, C, ld, rows ? rm.data_ptr<T>() : nullptr, rows ? rs.data_ptr<T>() : nullptr, cm, cs, csh);
  } else {
    // Columns split across threads (each owns its columns' running state);
    // each part's row statistics are partial and combined afterwards.
    const int64_t parts = std::min<int64_t>(threads, C / 128);
    const int64_t width = (C + parts - 1) / parts;
    torch::Tensor prm, prs;
    if (rows) prm = torch::full({parts, R}, -kInf, opt), prs = torch::zeros({parts, R}, opt);
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t c0 = p * width, c = std::min(width, C - c0);
        if (c <= 0) continue;
        call_stats<T>(x + c0, R, c, ld, rows ? prm[p].data_ptr<T>() : nullptr, rows ? prs[p].data_ptr<T>() : nullptr,
                      cm + c0, cs + c0, csh + c0);
      }
    });
    // A part's (shift, sum) pairs -> log-sum-exps, combined over the parts.
    return rows ? (prm + prs.log()).logsumexp(0) : torch::Tensor();
  }
  return rows ? rm + rs.log_() : torch::Tensor();
}
template <typename T>
void fused_grad(torch::Tensor& t, const torch::Tensor& lse_row, const torch::Tensor& w_row,
                const torch::Tensor& lse_col, const torch::Tensor& w_col) {
  const int64_t R = t.size(0), C = t.size(1), ld = std::max<int64_t>(t.stride(0), 1);
  if (R == 0 || C == 0) return;
  auto lr = vec(lse_row, t), wr = vec(w_row, t), lc = vec(lse_col, t), wc = vec(w_col, t);
  T* x = t.data_ptr<T>();
  const T* plr = lr.data_ptr<T>();
  const T* pwr = wr.defined() ? wr.data_ptr<T>() : nullptr;
  const T* plc = lc.defined() ? lc.data_ptr<T>() : nullptr;
  const T* pwc = wc.defined() ? wc.data_ptr<T>() : nullptr;
  const auto& k = table();
  at::parallel_for(0, R, grain_rows(C), [&](int64_t r0, int64_t r1) {
    if constexpr (std::is_same_v<T, float>) {
      k.grad_f(x + r0 * ld, r1 - r0, C, ld, plr + r0, pwr ? pwr + r0 : nullptr, plc, pwc);
    } else {
      k.grad_d(x + r0 * ld, r1 - r0, C, ld, plr + r0, pwr ? pwr + r0 : nullptr, plc, pwc);
    }
  });
}

// The ATen forms (CUDA, half precision, odd strides): one [R, C] temporary.
torch::Tensor aten_rows_lse(const torch::Tensor& x) {
  if (x.size(1) == 0) return torch::full({x.size(0)}, -kInf, x.options());
  auto m = x.amax(1);  // [R]
  m.masked_fill_(m == -kInf, 0.0);
  return (x - m.unsqueeze(1)).exp_().sum(1).log_().add_(m);
}

torch::Tensor aten_cols_lse(const torch::Tensor& x) {
  if (x.size(0) == 0) return torch::full({x.size(1)}, -kInf, x.options());
  auto m = x.amax(0);  // [C]
  m.masked_fill_(m == -kInf, 0.0);
  return (x - m.unsqueeze(0)).exp_().sum(0).log_().add_(m);
}

}  // namespace

TileLse tile_lse(const torch::Tensor& t, bool rows, bool cols) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2, "tile_lse: expected a 2-D tile, got ", t.sizes());
  TileLse out;
  if (!cols) {
    if (fused_applies(t)) {
      out.row = t.scalar_type() == torch::kFloat ? fused_tile<float>(t, true, nullptr, nullptr, nullptr)
                                                 : fused_tile<double>(t, true, nullptr, nullptr, nullptr);
    } else if (rows) {
      out.row = aten_rows_lse(t);
    }
    return out;
  }
  ColumnLse acc(t.size(1), t.options());
  out.row = acc.add(t, 0, rows);
  out.col = acc.lse();
  return out;
}

ColumnLse::ColumnLse(int64_t n_cols, const torch::TensorOptions& options)
    : fused_(enabled_flag().load(std::memory_order_relaxed) && options.device().is_cpu() &&
             (options.dtype() == torch::kFloat || options.dtype() == torch::kDouble)) {
  if (fused_) {
    max_ = torch::full({n_cols}, -kInf, options);
    sum_ = torch::zeros({n_cols}, options);
    shift_ = torch::zeros({n_cols}, options);
  } else {
    lse_ = torch::full({n_cols}, -kInf, options);
  }
}

torch::Tensor ColumnLse::add(const torch::Tensor& tile, int64_t c0, bool rows) {
  TORCH_INTERNAL_ASSERT(tile.dim() == 2 && c0 >= 0 && c0 + tile.size(1) <= (fused_ ? max_ : lse_).size(0));
  if (!fused_) {
    auto lc = lse_.narrow(0, c0, tile.size(1));
    lc.copy_(torch::logaddexp(lc, aten_cols_lse(tile)));
    return rows ? aten_rows_lse(tile) : torch::Tensor();
  }
  TORCH_INTERNAL_ASSERT(tile.scalar_type() == max_.scalar_type() && tile.device().is_cpu());
  // A tile with a column stride (a transposed view) is copied once: the
  // kernels walk rows.
  const auto t = fused_applies(tile) ? tile : tile.contiguous();
  if (t.scalar_type() == torch::kFloat) {
    return fused_tile<float>(t, rows, max_.data_ptr<float>() + c0, sum_.data_ptr<float>() + c0,
                             shift_.data_ptr<float>() + c0);
  }
  return fused_tile<double>(t, rows, max_.data_ptr<double>() + c0, sum_.data_ptr<double>() + c0,
                            shift_.data_ptr<double>() + c0);
}

torch::Tensor ColumnLse::lse() const { return fused_ ? shift_ + sum_.log() : lse_.clone(); }

void softmax_grad_(torch::Tensor& t, const torch::Tensor& lse_row, const torch::Tensor& w_row,
                   const torch::Tensor& lse_col, const torch::Tensor& w_col) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && lse_row.numel() == t.size(0));
  TORCH_INTERNAL_ASSERT(!lse_col.defined() || lse_col.numel() == t.size(1));
  if (fused_applies(t)) {
    if (t.scalar_type() == torch::kFloat) {
      fused_grad<float>(t, lse_row, w_row, lse_col, w_col);
    } else {
      fused_grad<double>(t, lse_row, w_row, lse_col, w_col);
    }
    return;
  }
  torch::Tensor col;
  if (lse_col.defined()) {
    col = (t - lse_col.unsqueeze(0)).exp_();
    if (w_col.defined()) col.mul_(w_col.unsqueeze(0));
  }
  t.sub_(lse_row.unsqueeze(1)).exp_();
  if (w_row.defined()) t.mul_(w_row.unsqueeze(1));
  if (col.defined()) t.add_(col);
}

torch::Tensor exp_rows_(torch::Tensor& t, double shift, const torch::Tensor& col_sum) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2);
  TORCH_INTERNAL_ASSERT(!col_sum.defined() || (col_sum.numel() == t.size(1) && col_sum.is_contiguous()));
  if (!fused_applies(t)) {
    t.sub_(shift).exp_();
    if (col_sum.defined()) col_sum.add_(t.sum(0));
    return t.sum(1);
  }
  const int64_t R = t.size(0), C = t.size(1), ld = std::max<int64_t>(t.stride(0), 1);
  auto sums = torch::zeros({R}, t.options());
  if (R == 0 || C == 0) return sums;
  const auto& k = table();
  auto run = [&](int64_t r0, int64_t r1, bool cols) {
    if (t.scalar_type() == torch::kFloat) {
      k.exp_rows_f(t.data_ptr<float>() + r0 * ld, r1 - r0, C, ld, static_cast<float>(shift),
                   sums.data_ptr<float>() + r0, cols ? col_sum.data_ptr<float>() : nullptr);
    } else {
      k.exp_rows_d(t.data_ptr<double>() + r0 * ld, r1 - r0, C, ld, shift, sums.data_ptr<double>() + r0,
                   cols ? col_sum.data_ptr<double>() : nullptr);
    }
  };
  if (col_sum.defined()) {
    run(0, R, true);  // the column sums are shared: one thread (the GEMMs around it use the others)
  } else {
    at::parallel_for(0, R, grain_rows(C), [&](int64_t r0, int64_t r1) { run(r0, r1, false); });
  }
  return sums;
}

void scale_rows_plus_cols_(torch::Tensor& t, const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && a.numel() == t.size(0) && b.numel() == t.size(1));
  if (!fused_applies(t)) {
    t.mul_(a.unsqueeze(1) + b.unsqueeze(0));
    return;
  }
  const int64_t R = t.size(0), C = t.size(1), ld = std::max<int64_t>(t.stride(0), 1);
  if (R == 0 || C == 0) return;
  auto av = vec(a, t), bv = vec(b, t);
  const auto& k = table();
  at::parallel_for(0, R, grain_rows(C), [&](int64_t r0, int64_t r1) {
    if (t.scalar_type() == torch::kFloat) {
      k.scale_f(t.data_ptr<float>() + r0 * ld, r1 - r0, C, ld, av.data_ptr<float>() + r0, bv.data_ptr<float>());
    } else {
      k.scale_d(t.data_ptr<double>() + r0 * ld, r1 - r0, C, ld, av.data_ptr<double>() + r0, bv.data_ptr<double>());
    }
  });
}

std::atomic<bool>& bounded_flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("CONTRAX_BOUNDED_SHIFT");
    return !(v && std::strcmp(v, "0") == 0);
  }()};
  return on;
}

bool bounded_shift_enabled() { return bounded_flag().load(std::memory_order_relaxed); }
void set_bounded_shift_enabled(bool on) { bounded_flag().store(on); }

bool fused_kernels_enabled() { return enabled_flag().load(); }
void set_fused_kernels_enabled(bool on) { enabled_flag().store(on); }

const char* fused_kernels_isa() { return active().name.load(); }

bool set_fused_kernels_isa(const std::string& isa) {
  if (!cpu_runs(isa) || !table_of(isa)) return false;
  for (const char* name : {"avx512", "avx2", "baseline"}) {
    if (isa == name) {
      active().table.store(table_of(isa));
      active().name.store(name);
    }
  }
  return true;
}

torch::Tensor fused_exp(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat,
              "fused_exp(): argument 'x' must be a CPU float tensor, but got ", x.toString());
  auto in = x.contiguous();
  auto out = torch::empty_like(in);
  table().exp_f(in.data_ptr<float>(), out.data_ptr<float>(), in.numel());
  return out;
}

}  // namespace contrax::detail
