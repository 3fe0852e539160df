// Warm-up + cosine learning-rate schedule (pure function of the step).
#include "contrax/train/common/schedule.h"

#include <cmath>

namespace contrax::train {

double warmup_cosine_lr(int64_t step, const WarmupCosineOptions& o) {
  TORCH_CHECK(step >= 0, "warmup_cosine_lr(): argument 'step' must be >= 0, but got ", step);
  TORCH_CHECK(o.total_steps() >= 1, "warmup_cosine_lr(): option 'total_steps' must be >= 1, but got ",
              o.total_steps());
  TORCH_CHECK(o.warmup_steps() >= 0 && o.warmup_steps() <= o.total_steps(),
              "warmup_cosine_lr(): option 'warmup_steps' must be in [0, total_steps=", o.total_steps(),
              "], but got ", o.warmup_steps());
  if (step < o.warmup_steps()) {
    return o.base_lr() * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps());
  }
  const int64_t decay_steps = o.total_steps() - o.warmup_steps();
  if (decay_steps == 0) return o.base_lr();
  const double t = std::min(1.0, static_cast<double>(step - o.warmup_steps()) / static_cast<double>(decay_steps));
  return o.final_lr() + (o.base_lr() - o.final_lr()) * 0.5 * (1.0 + std::cos(M_PI * t));
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  TORCH_CHECK(lr >= 0, "set_learning_rate(): argument 'lr' must be >= 0, but got ", lr);
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

}  // namespace contrax::train
