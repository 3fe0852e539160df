// The engine's precision policy and its GEMMs (see engine/precision.h).
#include "engine/precision.h"

#include <atomic>
#include <type_traits>
#include <utility>

#include "util/env.h"

namespace contrax::detail {

namespace {

std::atomic<bool>& everywhere_flag() {
  static std::atomic<bool> on{env_set("CONTRAX_REDUCED_OPERANDS")};
  return on;
}

bool reduced(c10::ScalarType t) { return t == c10::kHalf || t == c10::kBFloat16; }

// Whether this LibTorch has mm's out_dtype overload (aten::mm.dtype_out: fp16
// or bf16 operands, fp32 result, on CUDA): detected from its headers, not
// assumed from a version number.
template <typename T, typename = void>
struct HasMixedMm : std::false_type {};
template <typename T>
struct HasMixedMm<T, std::void_t<decltype(at::mm_out(std::declval<T&>(), std::declval<const T&>(),
                                                     std::declval<const T&>(), c10::ScalarType::Float))>>
    : std::true_type {};

// out = a @ b by the mixed-dtype kernel (a and b reduced, out fp32); false
// where there is none (not on CUDA, or a LibTorch without it).
template <typename T>
bool mixed_mm_out(T& out, const T& a, const T& b) {
  if constexpr (HasMixedMm<T>::value) {
    if (!out.is_cuda()) return false;
    at::mm_out(out, a, b, out.scalar_type());
    return true;
  } else {
    return false;
  }
}

// acc += a @ b by the mixed-dtype kernel (a and b reduced, acc fp32, cuBLAS
// accumulating into acc with beta 1); false where there is none. Older
// LibTorch kernels of addmm.dtype_out require the added tensor in the
// operands' dtype: the first refusal is remembered, and the caller falls back.
template <typename T, typename = void>
struct HasMixedAddmm : std::false_type {};
template <typename T>
struct HasMixedAddmm<T, std::void_t<decltype(at::addmm_out(std::declval<T&>(), std::declval<const T&>(),
                                                           std::declval<const T&>(), std::declval<const T&>(),
                                                           c10::ScalarType::Float))>> : std::true_type {};

template <typename T>
bool mixed_addmm_(T& acc, const T& a, const T& b) {
  if constexpr (HasMixedAddmm<T>::value) {
    static std::atomic<bool> refused{false};
    if (!acc.is_cuda() || refused.load(std::memory_order_relaxed)) return false;
    try {
      at::addmm_out(acc, acc, a, b, acc.scalar_type());
      return true;
    } catch (const c10::Error&) {
      refused.store(true);
      return false;
    }
  } else {
    return false;
  }
}

}  // namespace

c10::ScalarType compute_dtype(c10::ScalarType t) { return reduced(t) ? c10::kFloat : t; }

c10::ScalarType operand_dtype(c10::ScalarType t, const torch::Device& device) {
  return reduced(t) && (device.is_cuda() || reduced_operands_everywhere()) ? t : compute_dtype(t);
}

bool reduced_operands_everywhere() { return everywhere_flag().load(std::memory_order_relaxed); }
void set_reduced_operands_everywhere(bool on) { everywhere_flag().store(on); }

bool mixed_gemm_available() { return HasMixedMm<torch::Tensor>::value && HasMixedAddmm<torch::Tensor>::value; }

torch::TensorOptions compute_options(const torch::Tensor& operand) {
  return operand.options().dtype(compute_dtype(operand.scalar_type()));
}

void gemm_out(torch::Tensor out, const torch::Tensor& a, const torch::Tensor& b) {
  const auto o = out.scalar_type();
  if (a.scalar_type() == o && b.scalar_type() == o) {
    torch::mm_out(out, a, b);
    return;
  }
  // Both operands in the reduced dtype (the one of the two that is not the
  // result's), then one product of the rounded operands with fp32
  // accumulation: the mixed kernel, or both widened.
  const auto op = a.scalar_type() != o ? a.scalar_type() : b.scalar_type();
  const auto ar = a.to(op), br = b.to(op);
  if (mixed_mm_out(out, ar, br)) return;
  torch::mm_out(out, ar.to(o), br.to(o));
}

torch::Tensor gemm(const torch::Tensor& a, const torch::Tensor& b, c10::ScalarType out) {
  auto r = torch::empty({a.size(0), b.size(1)}, a.options().dtype(out));  // [m, n]
  gemm_out(r, a, b);
  return r;
}

void gemm_add_(torch::Tensor acc, const torch::Tensor& a, const torch::Tensor& b) {
  const auto o = acc.scalar_type();
  if (a.scalar_type() == o && b.scalar_type() == o) {
    acc.addmm_(a, b);
    return;
  }
  // As gemm_out: both operands rounded to the reduced dtype, then one
  // accumulating product with an fp32 result (no [m, n] temporary), or both
  // widened where there is no such kernel.
  const auto op = a.scalar_type() != o ? a.scalar_type() : b.scalar_type();
  const auto ar = a.to(op), br = b.to(op);
  if (mixed_addmm_(acc, ar, br)) return;
  acc.addmm_(ar.to(o), br.to(o));
}

void gemm_into_(torch::Tensor acc, const torch::Tensor& a, const torch::Tensor& b, bool first) {
  if (first) return gemm_out(acc, a, b);
  gemm_add_(acc, a, b);
}

torch::Tensor scaled_operand(const torch::Tensor& g, const torch::Tensor& factor, c10::ScalarType op) {
  if (op == g.scalar_type()) return factor.defined() ? g.mul_(factor) : g;
  auto out = torch::empty(g.sizes(), g.options().dtype(op));  // [R, C], contiguous
  if (factor.defined()) {
    at::mul_out(out, g, factor);  // computed in g's dtype, rounded once on the store
  } else {
    out.copy_(g);
  }
  return out;
}

}  // namespace contrax::detail
