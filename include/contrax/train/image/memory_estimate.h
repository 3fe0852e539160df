// What one training step of the image recipes (SimCLR, MoCo v3) holds in
// host memory per rank, estimated from the options and the image size before
// anything is allocated (common/step_memory.h). The estimate is checked
// against the allocator's own count (MemoryTracker, contrax/util/memory.h) in
// tests/train/train_memory_estimate_test.cpp.
#pragma once

#include <cstdint>

#include "contrax/train/common/step_memory.h"
#include "contrax/train/image/trainer.h"

namespace contrax::train {

/// Estimates a step of `options` on images of `channels` x `height` x
/// `width` when the largest global batch has `global_rows` rows over `world`
/// ranks (the rank with the most rows). An estimate, not a bound: within 50%
/// of what the allocator counts over a step (tested).
///
///   auto m = contrax::train::estimate_step_memory(o, 1, 28, 28, 256, 2);
///   std::cout << contrax::format_bytes(m.total());
StepMemory estimate_step_memory(const TrainOptions& options, int64_t channels, int64_t height, int64_t width,
                                int64_t global_rows, int64_t world);

}  // namespace contrax::train
