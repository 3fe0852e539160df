// The panel kernels on tensors (see engine/panel_kernels.h): the arguments
// and workspace of each call, the same whichever table runs it, and the
// choice of table by device.
#include "engine/panel_kernels.h"

#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <atomic>

#include "util/cuda_side.h"

namespace contrax::detail {

namespace {

struct Emulated {
  std::atomic<const PanelKernels*> kernels{nullptr};
  std::atomic<int> sm_count{1};
};
Emulated& emulated() {
  static Emulated e;
  return e;
}

void check_launch(const PanelDevice& d, int err, const char* kernel) {
  TORCH_CHECK(err == 0, "contrax: the CUDA kernel ", kernel, " failed to launch: ", d.kernels->error_string(err));
}

// The table's entry for each argument type.
int run(const PanelDevice& d, const panels::LseArgs<float>& a) { return d.kernels->lse_f(a, d.sm_count, d.stream); }
int run(const PanelDevice& d, const panels::LseArgs<double>& a) { return d.kernels->lse_d(a, d.sm_count, d.stream); }
int run(const PanelDevice& d, const panels::GradArgs<float, float>& a) { return d.kernels->grad_f(a, d.stream); }
int run(const PanelDevice& d, const panels::GradArgs<double, double>& a) { return d.kernels->grad_d(a, d.stream); }
int run(const PanelDevice& d, const panels::GradArgs<float, panels::Bf16>& a) { return d.kernels->grad_bf16(a, d.stream); }
int run(const PanelDevice& d, const panels::GradArgs<float, panels::Fp16>& a) { return d.kernels->grad_fp16(a, d.stream); }
int run(const PanelDevice& d, const panels::SiglipArgs<float, float>& a) {
  return d.kernels->siglip_f(a, d.sm_count, d.stream);
}
int run(const PanelDevice& d, const panels::SiglipArgs<float, panels::Bf16>& a) {
  return d.kernels->siglip_bf16(a, d.sm_count, d.stream);
}
int run(const PanelDevice& d, const panels::SiglipArgs<float, panels::Fp16>& a) {
  return d.kernels->siglip_fp16(a, d.sm_count, d.stream);
}
int run(const PanelDevice& d, const panels::SiglipArgs<double, double>& a) {
  return d.kernels->siglip_d(a, d.sm_count, d.stream);
}

// SigLIP's arguments with the gradient written as `Out` (null: none).
template <typename T, typename Out>
void siglip_into(const PanelDevice& d, const torch::Tensor& t, const torch::Tensor& bias, int64_t row0, int64_t col0,
                 bool own, const torch::Tensor& grad, const torch::Tensor& loss, const torch::Tensor& grad_sum) {
  const int64_t R = t.size(0), C = t.size(1);
  const auto g = panels::strip_grid(R, C, d.sm_count);
  auto ws = torch::empty({std::max<int64_t>(1, panels::strip_workspace(g, R, 0))}, t.options());
  panels::SiglipArgs<T, Out> a;
  a.logits = t.data_ptr<T>(), a.rows = R, a.cols = C, a.ld = std::max<int64_t>(t.stride(0), 1);
  a.bias = bias.defined() ? bias.data_ptr<T>() : nullptr;
  a.row0 = row0, a.col0 = col0, a.own = own;
  a.grad = grad.defined() ? static_cast<Out*>(grad.data_ptr()) : nullptr;
  a.ld_grad = grad.defined() ? std::max<int64_t>(grad.stride(0), 1) : 0;
  a.row_loss = loss.data_ptr<T>();
  a.row_grad = grad_sum.defined() ? grad_sum.data_ptr<T>() : nullptr;
  a.ws = ws.data_ptr<T>();
  check_launch(d, run(d, a), "siglip_panel");
}

template <typename T>
T* data_or_null(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

int64_t lead_stride(const torch::Tensor& t) { return std::max<int64_t>(t.stride(0), 1); }

}  // namespace

std::optional<PanelDevice> panel_device(const torch::TensorOptions& options) {
  if (options.device().is_cpu()) {
    const PanelKernels* k = emulated().kernels.load(std::memory_order_relaxed);
    if (k == nullptr) return std::nullopt;
    return PanelDevice{k, emulated().sm_count.load(std::memory_order_relaxed), nullptr};
  }
  if (options.device().is_cuda()) {
    static const auto cuda = reinterpret_cast<CudaPanelDeviceFn>(cuda_side_function("panel_device"));
    if (cuda != nullptr) return cuda(options.device());
  }
  return std::nullopt;
}

void set_emulated_panel_kernels(const PanelKernels* kernels, int sm_count) {
  TORCH_CHECK(sm_count >= 1, "set_emulated_panel_kernels(): argument 'sm_count' must be >= 1, but got ", sm_count);
  emulated().sm_count.store(sm_count);
  emulated().kernels.store(kernels);
}

bool emulated_panel_kernels_installed() { return emulated().kernels.load() != nullptr; }

torch::Tensor panel_tile_lse(const PanelDevice& dev, const torch::Tensor& t, bool rows, const torch::Tensor& col_m,
                             const torch::Tensor& col_s, const panels::Masks* masks, const torch::Tensor& row_out,
                             const PositiveSums* sums) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1));
  TORCH_INTERNAL_ASSERT(!col_m.defined() || (col_m.is_contiguous() && col_s.is_contiguous() &&
                                             col_m.numel() == t.size(1) && col_s.numel() == t.size(1)));
  const c10::DeviceGuard guard(t.device());
  const int64_t R = t.size(0), C = t.size(1);
  TORCH_INTERNAL_ASSERT(!row_out.defined() || (row_out.is_contiguous() && row_out.numel() == t.size(0) &&
                                                row_out.scalar_type() == t.scalar_type()));
  TORCH_INTERNAL_ASSERT(!sums || (masks && masks->multi && sums->row.numel() == R && sums->row_n.numel() == R &&
                                    (!sums->col.defined() || (sums->col.numel() == C && sums->col_n.numel() == C))));
  torch::Tensor row = !rows ? torch::Tensor() : row_out.defined() ? row_out : torch::empty({R}, t.options());
  if (!rows && !col_m.defined() && !sums) return row;
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "panel_tile_lse", [&] {
    const auto g = panels::strip_grid(R, C, dev.sm_count);
    auto ws = torch::empty({std::max<int64_t>(1, panels::strip_workspace(g, R, C, sums != nullptr))}, t.options());
    panels::LseArgs<scalar_t> a;
    a.logits = t.data_ptr<scalar_t>(), a.rows = R, a.cols = C, a.ld = lead_stride(t);
    if (masks) a.masks = *masks;
    a.row_lse = data_or_null<scalar_t>(row), a.col_m = data_or_null<scalar_t>(col_m);
    a.col_s = data_or_null<scalar_t>(col_s);
    if (sums) {
      a.pos_row = data_or_null<scalar_t>(sums->row), a.n_row = data_or_null<scalar_t>(sums->row_n);
      a.pos_col = data_or_null<scalar_t>(sums->col), a.n_col = data_or_null<scalar_t>(sums->col_n);
    }
    a.ws = ws.data_ptr<scalar_t>();
    check_launch(dev, run(dev, a), "lse_panel");
  });
  return row;
}

void panel_softmax_grad_(const PanelDevice& dev, torch::Tensor& t, const torch::Tensor& lse_row,
                         const torch::Tensor& w_row, const torch::Tensor& lse_col, const torch::Tensor& w_col,
                         const panels::Masks* masks, const torch::Tensor& factor, const torch::Tensor& out,
                         const PositiveCounts& counts) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1));
  TORCH_INTERNAL_ASSERT(!out.defined() || (out.sizes() == t.sizes() && (out.size(1) <= 1 || out.stride(1) == 1)));
  const c10::DeviceGuard guard(t.device());
  const auto c = factor.defined() ? factor.to(t.options()).contiguous() : factor;
  const auto dst = out.defined() ? out : t;  // in place: each entry read and written by one thread
  TORCH_INTERNAL_ASSERT(!(masks && masks->multi) || (counts.inv_n_row.numel() == t.size(0) &&
                                                     (!lse_col.defined() || counts.inv_n_col.numel() == t.size(1))));
  const auto launch = [&](auto logits_tag, auto out_tag) {
    using T = decltype(logits_tag);
    using Out = decltype(out_tag);
    panels::GradArgs<T, Out> a;
    a.logits = t.data_ptr<T>(), a.rows = t.size(0), a.cols = t.size(1), a.ld = lead_stride(t);
    if (masks) a.masks = *masks;
    a.lse_row = data_or_null<T>(lse_row), a.w_row = data_or_null<T>(w_row);
    a.lse_col = data_or_null<T>(lse_col), a.w_col = data_or_null<T>(w_col);
    a.factor = data_or_null<T>(c);
    a.out = static_cast<Out*>(dst.data_ptr()), a.ld_out = lead_stride(dst);
    a.inv_n_row = data_or_null<T>(counts.inv_n_row), a.inv_n_col = data_or_null<T>(counts.inv_n_col);
    check_launch(dev, run(dev, a), "grad_panel");
  };
  const auto in = t.scalar_type(), to = dst.scalar_type();
  if (in == torch::kDouble && to == torch::kDouble) return launch(double{}, double{});
  TORCH_INTERNAL_ASSERT(in == torch::kFloat, "panel_softmax_grad_: float or double logits");
  if (to == torch::kBFloat16) return launch(float{}, panels::Bf16{});
  if (to == torch::kHalf) return launch(float{}, panels::Fp16{});
  TORCH_INTERNAL_ASSERT(to == torch::kFloat, "panel_softmax_grad_: fp32 logits write fp32, bf16 or fp16");
  launch(float{}, float{});
}

std::pair<torch::Tensor, torch::Tensor> panel_siglip(const PanelDevice& dev, const torch::Tensor& t,
                                                     const torch::Tensor& bias, int64_t row0, int64_t col0, bool own,
                                                     const torch::Tensor& grad) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1));
  TORCH_INTERNAL_ASSERT(!grad.defined() || (grad.sizes() == t.sizes() && (grad.size(1) <= 1 || grad.stride(1) == 1)));
  const c10::DeviceGuard guard(t.device());
  const auto b = bias.defined() ? bias.to(t.options()).contiguous() : bias;
  auto loss = torch::empty({t.size(0)}, t.options());
  auto sums = grad.defined() ? torch::empty({t.size(0)}, t.options()) : torch::Tensor();
  if (t.size(0) == 0) return {loss, sums};
  const auto out = grad.defined() ? grad.scalar_type() : t.scalar_type();
  if (t.scalar_type() == torch::kDouble) {
    TORCH_INTERNAL_ASSERT(out == torch::kDouble, "panel_siglip: an fp64 tile writes an fp64 gradient");
    siglip_into<double, double>(dev, t, b, row0, col0, own, grad, loss, sums);
  } else {
    TORCH_INTERNAL_ASSERT(t.scalar_type() == torch::kFloat);
    if (out == torch::kBFloat16) {
      siglip_into<float, panels::Bf16>(dev, t, b, row0, col0, own, grad, loss, sums);
    } else if (out == torch::kHalf) {
      siglip_into<float, panels::Fp16>(dev, t, b, row0, col0, own, grad, loss, sums);
    } else {
      TORCH_INTERNAL_ASSERT(out == torch::kFloat, "panel_siglip: an fp32 tile writes an fp32, bf16 or fp16 gradient");
      siglip_into<float, float>(dev, t, b, row0, col0, own, grad, loss, sums);
    }
  }
  return {loss, sums};
}

}  // namespace contrax::detail
