// The retrieval recipe of `contrax train` (two towers on WordNet), defined in
// train_retrieval.cpp.
#pragma once

#include <memory>

#include "train/train_recipe.h"

namespace contrax::cli {

/// The two-tower WordNet retrieval recipe.
std::unique_ptr<TrainRecipe> make_retrieval_recipe();

}  // namespace contrax::cli
