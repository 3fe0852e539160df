// The image recipes of `contrax train` (simclr, moco-v3 on Fashion-MNIST),
// defined in train_image.cpp.
#pragma once

#include <memory>
#include <string>

#include "train/train_recipe.h"

namespace contrax::cli {

/// SimCLR or MoCo v3 (`name`), with the defaults of `variant` ("default" or
/// "peer": contrax::train::peer_recipe()).
std::unique_ptr<TrainRecipe> make_image_recipe(const std::string& name, const std::string& variant);

}  // namespace contrax::cli
