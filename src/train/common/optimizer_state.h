// An optimizer's options and state as checkpoint records (internal to the
// trainer, not installed). LibTorch's own Optimizer::save writes a
// TorchScript archive, whose reader runs code; this writes each parameter
// group's options as plain values and each parameter's state tensors as
// records of the checkpoint's safetensors file, for the optimizers LibTorch
// ships whose state is per parameter: Adam, AdamW, SGD, Adagrad, RMSprop.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <string>

#include "train/common/safetensors.h"

namespace contrax::train::detail {

/// "Adam", "AdamW", "SGD", "Adagrad" or "RMSprop"; throws naming the
/// optimizer `name` (as registered with a Checkpoint) for any other kind.
std::string optimizer_kind(torch::optim::Optimizer& optimizer, const std::string& name);

/// Adds `optimizer`'s state tensors to `out` as records
/// "<prefix><group>.<index>.<field>" and returns the rest (its kind, each
/// group's options and parameter count, each parameter's scalar state).
nlohmann::json save_optimizer(torch::optim::Optimizer& optimizer, const std::string& prefix, SafetensorsWriter& out);

/// Restores `optimizer` from what save_optimizer wrote. Everything is
/// checked first (the kind, the groups and their sizes, every record's
/// presence, dtype and shape against its parameter); a mismatch throws a
/// message naming the group, the parameter and the field, and leaves the
/// optimizer as it was.
void load_optimizer(torch::optim::Optimizer& optimizer, const nlohmann::json& saved, const std::string& prefix,
                    const SafetensorsReader& in);

/// A double as C99 hex ("0x1.8p+1"): exact in both directions, NaN and
/// infinities included, which JSON numbers are not.
std::string exact_double(double v);
/// Parses exact_double's text; throws naming `what` when it is not one.
double parse_exact_double(const std::string& text, const std::string& what);

}  // namespace contrax::train::detail
