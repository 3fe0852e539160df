// Matryoshka's prefixes of the CLIP / InfoNCE / grouped block in one shared
// pass over the width (the Scorer's way for that block where it applies,
// engine/scorer.h). Internal to the engine (src/engine/), not installed.
//
// Notation: raw features y (queries [b, d], every rank's keys [N, d]), prefix
// widths m_1 < ... < m_P = d, weights w_p, inverse prefix norms
// iq_p,i = 1 / ||y_i[:m_p]||, ik_p,j likewise, scale s, bias c. The raw
// products of prefix p are X_p = y_q[:, :m_p] y_k[:, :m_p]^T, and its logits
//   S_p,ij = s iq_p,i ik_p,j X_p,ij + c,
// which are the block's logits on the L2-normalised prefixes. The loss is
// sum_p w_p L_p, L_p the block of engine/block.h on S_p.
//
// Forward. X_p = X_(p-1) + y_q[:, m_(p-1):m_p] y_k[:, m_(p-1):m_p]^T: one
// [b x N] buffer accumulates the slices, and each prefix's statistics (row
// and column log-sum-exps, the designated entries) are taken from it, panel
// by panel, before the next slice is added. The buffer keeps X_P for the
// backward: one GEMM's worth of width forward, and one [b x N] buffer held,
// whatever P. (Narrow slices make slower GEMMs than the whole width: the
// cost is in docs/scorers.md.)
//
// Backward. With G_p the block's gradient of L_p with respect to S_p (times
// the reduction's factor c and w_p: engine/block.h), the chain rule through
// S_p = s iq ik X_p + c gives
//   dX_p = H_p := G_p (s iq_p,i ik_p,j)           (elementwise)
//   d iq_p,i = s sum_j G_p,ij ik_p,j X_p,ij,   d ik_p,j = s sum_i G_p,ij iq_p,i X_p,ij,
//   ds = sum_p sum_ij G_p,ij iq_p,i ik_p,j X_p,ij,   dc = sum_p sum_ij G_p,ij,
// and, X_p depending on the first m_p columns only,
//   dy_q[:, :m_p] += H_p y_k[:, :m_p],   dy_k[:, :m_p] += H_p^T y_q[:, :m_p].
// Since slice k's columns [m_(k-1), m_k) lie in every prefix p >= k, their
// gradient is dy_q[:, slice k] = H_(>=k) y_k[:, slice k] (likewise dy_k),
// with H_(>=k) = sum_(p >= k) H_p. So the backward walks row panels; in
// each, the narrower prefixes' products are recomputed as the forward built
// them (X_1, then each the previous plus its slice's product, into P - 1
// panels: m_(P-1) columns of GEMM), and the prefixes are walked from the
// widest down, the buffer's rows accumulating H_(>=p): X_P (kept) is turned
// into H_P in place, each narrower X_p into H_p (the sums above taken in the
// same pass) and added in; after prefix p the rows hold H_(>=p), and two
// GEMMs over slice p's columns alone give dq there and dk's share of those
// rows. The GEMMs come to 3 + m_(P-1) / d products of the whole width (the
// forward's one, the backward's two, the recomputation), against
// 3 sum_p m_p / d for a loop over prefixes; the memory to one buffer and P
// panels instead of P buffers. Where the logits are bounded
// (|S_p| <= s + |c| =: M, every softmax's exact shift, as in the
// materialised block) and no labels apply, no logits are written: the
// forward's statistics and the backward's G_p come from the products in one
// pass each, one exponential per entry (scaled_exp_sums,
// bounded_raw_products_grad). Timings: docs/benchmarks.md.
// The inverse norms' gradients reach y through autograd
// (the norms are computed outside this function).
#pragma once

#include <torch/torch.h>

#include <vector>

#include "engine/block.h"
#include "engine/prologue.h"
#include "util/check.h"

namespace contrax::detail {

/// Whether the shared pass takes the prefixes of a block over `features`
/// (before the prologue: a CPU tensor whose compute and operand dtypes are
/// the same; the route is checked again by prefix_pass_takes).
bool prefix_pass_candidate(const torch::Tensor& features);
/// The same for features of `dtype` on `device` (the plan's question).
bool prefix_pass_candidate(const c10::Device& device, c10::ScalarType dtype);

/// Whether the shared pass takes this prologue's block: a candidate on the
/// materialised route (the tiled and ring routes walk each prefix themselves).
bool prefix_pass_takes(const Prologue& p, const torch::Tensor& features);

/// Rows of the shared pass's logits panel (a prefix's logits, then their
/// gradient, where labels or unbounded logits need them written):
/// buffer_panel_rows (about 8 MiB on the CPU) and at most a sixteenth of the
/// rows, so that it holds at most 1/16 of the buffer.
int64_t prefix_panel_rows(c10::DeviceType device, c10::ScalarType dtype, int64_t b, int64_t N, int64_t d);
/// Rows of the backward's row panels (each of the P - 1 recomputed narrower
/// prefixes holds one), given the logits panel's `R` and the prefixes' count
/// P: R, at most b (256 at b = 4,096), and fewer beyond four prefixes, so
/// that the P - 1 panels hold at most 3 R rows together. The slices' GEMMs
/// over panels of 256 and of 1,024 rows took about the same time on the CPU
/// measured (torch.mm over the slices of 64/128/256/768 at B = 4,096, 2
/// threads: 150.6 and 150.3 ms for dq, 165.0 and 157.8 for dk).
int64_t prefix_recompute_rows(int64_t R, int64_t b, int64_t P);

/// sum_p w_p clip_block_loss(q[:, :m_p] / ||.||, k_all[:, :m_p] / ||.||, ...)
/// (engine/engine.h), the rows normalised as `prepare` does, in one shared
/// pass; q, k_all unnormalised in the compute dtype.
torch::Tensor prefix_clip_block(const torch::Tensor& q /* [b, d] */, const torch::Tensor& k_all /* [N, d] */,
                                const torch::Tensor& scale, const torch::Tensor& bias, const EngineLayout& layout,
                                const BlockSpec& spec, const std::vector<Prefix>& prefixes);

}  // namespace contrax::detail
