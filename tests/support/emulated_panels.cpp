// The CUDA panel kernels compiled for the SIMT emulator (see
// emulated_panels.h): support/simt.h first, then the kernels' own headers,
// unchanged; half-precision outputs as c10's types, whose rounding from
// float (to nearest, ties to even) is CUDA's.
#include "support/emulated_panels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "contrax/engine/workspace.h"
#include "engine/lse_kernels.h"
#include "engine/panels.h"
// After every LibTorch header: the emulator's CUDA names are macros.
#include "support/simt.h"
// clang-format off: the kernels after the emulator
#include "engine/kernels/cuda_grad_panel.cuh"
#include "engine/kernels/cuda_lse_panel.cuh"
#include "engine/kernels/cuda_siglip_panel.cuh"
// clang-format on

namespace contrax::testing {

namespace {

const contrax::simt::Launch kLaunch{};

const char* fault_words(int) { return "the SIMT emulator faults by exception, never by code"; }

// The engine's table entries: the stream has no meaning here.
template <typename A>
int lse_entry(const A& a, int sm_count, cudaStream_t) {
  return emulated_lse_panel(a, sm_count);
}
template <typename A>
int grad_entry(const A& a, cudaStream_t) {
  return emulated_grad_panel(a);
}
template <typename A>
int siglip_entry(const A& a, int sm_count, cudaStream_t) {
  return emulated_siglip_panel(a, sm_count);
}

}  // namespace

int emulated_lse_panel(const panels::LseArgs<float>& a, int sm_count) {
  return panels::lse_launches(a, sm_count, kLaunch);
}
int emulated_lse_panel(const panels::LseArgs<double>& a, int sm_count) {
  return panels::lse_launches(a, sm_count, kLaunch);
}
int emulated_grad_panel(const panels::GradArgs<float, float>& a) { return panels::grad_launches(a, kLaunch); }
int emulated_grad_panel(const panels::GradArgs<float, panels::Bf16>& a) {
  return panels::grad_launches(panels::with_output<c10::BFloat16>(a), kLaunch);
}
int emulated_grad_panel(const panels::GradArgs<float, panels::Fp16>& a) {
  return panels::grad_launches(panels::with_output<c10::Half>(a), kLaunch);
}
int emulated_grad_panel(const panels::GradArgs<double, double>& a) { return panels::grad_launches(a, kLaunch); }
int emulated_siglip_panel(const panels::SiglipArgs<float, float>& a, int sm_count) {
  return panels::siglip_launches(a, sm_count, kLaunch);
}
int emulated_siglip_panel(const panels::SiglipArgs<float, panels::Bf16>& a, int sm_count) {
  return panels::siglip_launches(panels::with_output<c10::BFloat16>(a), sm_count, kLaunch);
}
int emulated_siglip_panel(const panels::SiglipArgs<float, panels::Fp16>& a, int sm_count) {
  return panels::siglip_launches(panels::with_output<c10::Half>(a), sm_count, kLaunch);
}
int emulated_siglip_panel(const panels::SiglipArgs<double, double>& a, int sm_count) {
  return panels::siglip_launches(a, sm_count, kLaunch);
}

int64_t emulated_launches() { return contrax::simt::launches(); }

const detail::PanelKernels& emulated_panel_kernels() {
  using namespace panels;
  static const detail::PanelKernels table{&lse_entry<LseArgs<float>>,
                                          &lse_entry<LseArgs<double>>,
                                          &grad_entry<GradArgs<float, float>>,
                                          &grad_entry<GradArgs<float, Bf16>>,
                                          &grad_entry<GradArgs<float, Fp16>>,
                                          &grad_entry<GradArgs<double, double>>,
                                          &siglip_entry<SiglipArgs<float, float>>,
                                          &siglip_entry<SiglipArgs<float, Bf16>>,
                                          &siglip_entry<SiglipArgs<float, Fp16>>,
                                          &siglip_entry<SiglipArgs<double, double>>,
                                          &fault_words};
  return table;
}

EmulatedCudaWalk::EmulatedCudaWalk(int sm_count, int64_t budget)
    : cuda_was_on_(detail::cuda_fused_kernels_enabled()) {
  detail::set_panels_everywhere(true);
  contrax::set_loss_panel_bytes(budget);
  detail::set_cuda_fused_kernels_enabled(true);
  detail::set_emulated_panel_kernels(&emulated_panel_kernels(), sm_count);
}

EmulatedCudaWalk::~EmulatedCudaWalk() {
  detail::set_emulated_panel_kernels(nullptr, 1);
  detail::set_cuda_fused_kernels_enabled(cuda_was_on_);
  contrax::set_loss_panel_bytes(0);
  detail::set_panels_everywhere(false);
}

}  // namespace contrax::testing
