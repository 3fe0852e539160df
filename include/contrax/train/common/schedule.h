// Learning-rate schedule: linear warm-up, then cosine decay, per step.
//
// The schedule is a pure function of the step, so a resumed run only needs its
// step counter to continue on exactly the same curve.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace contrax::train {

/// Options for `warmup_cosine_lr`. Defaults: base 1e-3, no warm-up, decay to 0.
struct WarmupCosineOptions {
  /// Learning rate at the end of the warm-up, where the cosine starts.
  TORCH_ARG(double, base_lr) = 1e-3;
  /// Steps of linear warm-up: step s < warmup gets base * (s + 1) / warmup.
  TORCH_ARG(int64_t, warmup_steps) = 0;
  /// Total steps of the run (>= 1); the cosine reaches final_lr at this step.
  TORCH_ARG(int64_t, total_steps) = 1;
  /// Learning rate the cosine decays to at `total_steps`.
  TORCH_ARG(double, final_lr) = 0.0;
};

/// Learning rate at `step` (0-based): linear warm-up to `base_lr`, then
/// final + (base - final) * (1 + cos(pi * t)) / 2 with t running from 0 at the
/// end of warm-up to 1 at `total_steps` (clamped beyond).
///
///   auto o = contrax::train::WarmupCosineOptions().base_lr(0.3).warmup_steps(100).total_steps(5000);
///   double lr = contrax::train::warmup_cosine_lr(step, o);
double warmup_cosine_lr(int64_t step, const WarmupCosineOptions& options);

/// Sets the learning rate of every parameter group of `optimizer` (any
/// LibTorch optimizer: Adam, AdamW, SGD, ...).
///
///   contrax::train::set_learning_rate(adam, contrax::train::warmup_cosine_lr(step, o));
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

}  // namespace contrax::train
