// The engine's one precision policy, and the GEMMs that follow it. Internal to
// the engine (src/engine/), not installed.
//
// Features of dtype t are held in two dtypes:
//  * the compute dtype, compute_dtype(t): logits, log-sum-exps, softmax,
//    the loss and every sum of gradients. fp32 for fp16/bf16 features; fp32
//    and fp64 features compute in their own dtype.
//  * the operand dtype, operand_dtype(t, device): what the features are
//    gathered in, sent around the ring in, and multiplied in. On CUDA, fp16
//    and bf16 features stay in their own dtype: half the bytes of fp32 on the
//    wire, and tensor-core GEMMs that accumulate in fp32 and write fp32
//    (c10's mm with an out_dtype, where the LibTorch has it). Elsewhere the
//    operands are the compute dtype: the CPU has no reduced-precision GEMM
//    with an fp32 result, and its fp32 GEMM is what it is fastest at.
//
// The GEMMs below take operands of either dtype and write the compute dtype.
// Where one operand is in the compute dtype and the other reduced (a backward
// product of an fp32 gradient tile with bf16 keys), the fp32 one is rounded to
// the reduced dtype first, as autocast would. Without a mixed-dtype kernel
// (the CPU, an older LibTorch) both rounded operands are widened and multiplied
// in the compute dtype: the same function, so a CPU run with reduced operands
// (set_reduced_operands_everywhere) checks what CUDA computes.
#pragma once

#include <torch/torch.h>

namespace contrax::detail {

/// The dtype logits and their statistics are computed in, for features of
/// dtype `t`: fp32 for fp16 and bf16, `t` itself otherwise.
c10::ScalarType compute_dtype(c10::ScalarType t);

/// The dtype features of dtype `t` on `device` are gathered and multiplied in:
/// `t` for fp16/bf16 on CUDA (or anywhere, once set_reduced_operands_everywhere
/// is on), compute_dtype(t) otherwise.
c10::ScalarType operand_dtype(c10::ScalarType t, const torch::Device& device);

/// Reduced operands off CUDA too (default off; the environment variable
/// CONTRAX_REDUCED_OPERANDS=1 turns it on): what the tests use to check the
/// CUDA policy on the CPU, and a way to halve the bytes of bf16 features on
/// Gloo at the cost of widening every tile.
bool reduced_operands_everywhere();
void set_reduced_operands_everywhere(bool on);

/// Whether this LibTorch has the mixed-dtype GEMMs (fp16/bf16 operands, an
/// fp32 result, on CUDA: mm and the accumulating addmm); without them the
/// rounded operands are widened instead.
bool mixed_gemm_available();

/// The options of the compute dtype for tensors beside `operand` (its device).
torch::TensorOptions compute_options(const torch::Tensor& operand);

/// a @ b into `out` (its dtype the result's), operands of either dtype.
void gemm_out(torch::Tensor out /* [m, n] */, const torch::Tensor& a /* [m, k] */, const torch::Tensor& b /* [k, n] */);

/// a @ b in dtype `out`.
torch::Tensor gemm(const torch::Tensor& a, const torch::Tensor& b, c10::ScalarType out);

/// acc += a @ b, in acc's dtype: one accumulating GEMM (addmm), with an fp32
/// result from reduced operands where the kernel exists (CUDA), never a
/// product temporary added afterwards.
void gemm_add_(torch::Tensor acc, const torch::Tensor& a, const torch::Tensor& b);

/// acc = a @ b when `first` (acc's old contents unread: an accumulator needs
/// no zero fill before its first product), else acc += a @ b.
void gemm_into_(torch::Tensor acc, const torch::Tensor& a, const torch::Tensor& b, bool first);

/// The gradient tile or panel `g` (compute dtype) times the 0-dim `factor`
/// (undefined: 1), in the operand dtype `op` the GEMMs that consume it take:
/// one pass, the factor folded into the cast (at::mul_out into an `op`
/// tensor), so the panel is cast once, not once per GEMM. When `op` is g's
/// own dtype, `g` itself, scaled in place.
torch::Tensor scaled_operand(const torch::Tensor& g, const torch::Tensor& factor, c10::ScalarType op);

}  // namespace contrax::detail
