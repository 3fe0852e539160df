// The LibTorch side of the CUDA panel kernels (see engine/cuda_panels.h):
// every launch on PyTorch's current stream of the tensor's device, every
// scalar a device pointer, the workspace from the caching allocator, so that
// nothing here waits for the device.
#include "engine/cuda_panels.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "engine/kernels/cuda_panels_api.h"

namespace contrax::detail {

namespace {

void check_launch(int err, const char* kernel) {
  TORCH_CHECK(err == 0, "contrax: the CUDA kernel ", kernel, " failed to launch: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The multiprocessors of the current device: only the grid's size depends on
// it (ATen caches the properties; no device call per launch).
int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream().stream(); }

template <typename T>
T* ptr(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

int64_t row_stride(const torch::Tensor& t) { return std::max<int64_t>(t.stride(0), 1); }

}  // namespace

torch::Tensor cuda_tile_lse(const torch::Tensor& t, bool rows, const torch::Tensor& col_m, const torch::Tensor& col_s) {
  TORCH_INTERNAL_ASSERT(t.is_cuda() && t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1));
  TORCH_INTERNAL_ASSERT(!col_m.defined() || (col_m.is_contiguous() && col_s.is_contiguous() &&
                                             col_m.numel() == t.size(1) && col_s.numel() == t.size(1)));
  const c10::cuda::CUDAGuard guard(t.device());
  const int64_t R = t.size(0), C = t.size(1);
  torch::Tensor row = rows ? torch::empty({R}, t.options()) : torch::Tensor();
  if (!rows && !col_m.defined()) return row;
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "cuda_tile_lse", [&] {
    const int sms = sm_count();
    const auto g = panels::strip_grid(R, C, sms);
    auto ws = torch::empty({std::max<int64_t>(1, panels::strip_workspace(g, R, C))}, t.options());
    panels::LseArgs<scalar_t> a;
    a.logits = t.data_ptr<scalar_t>(), a.rows = R, a.cols = C, a.ld = row_stride(t);
    a.row_lse = ptr<scalar_t>(row), a.col_m = ptr<scalar_t>(col_m), a.col_s = ptr<scalar_t>(col_s);
    a.ws = ws.data_ptr<scalar_t>();
    check_launch(panels::lse_panel(a, sms, stream()), "lse_panel");
  });
  return row;
}

void cuda_softmax_grad_(torch::Tensor& t, const torch::Tensor& lse_row, const torch::Tensor& w_row,
                        const torch::Tensor& lse_col, const torch::Tensor& w_col) {
  TORCH_INTERNAL_ASSERT(t.is_cuda() && t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1));
  const c10::cuda::CUDAGuard guard(t.device());
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "cuda_softmax_grad_", [&] {
    panels::GradArgs<scalar_t, scalar_t> a;
    a.logits = t.data_ptr<scalar_t>(), a.rows = t.size(0), a.cols = t.size(1), a.ld = row_stride(t);
    a.lse_row = ptr<scalar_t>(lse_row), a.w_row = ptr<scalar_t>(w_row);
    a.lse_col = ptr<scalar_t>(lse_col), a.w_col = ptr<scalar_t>(w_col);
    a.out = t.data_ptr<scalar_t>(), a.ld_out = a.ld;  // in place: each entry read and written by one thread
    check_launch(panels::grad_panel(a, stream()), "grad_panel");
  });
}

}  // namespace contrax::detail
