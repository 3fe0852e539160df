// The recipes of `contrax train` by name: the list `--recipe` offers and the
// factory that makes one (train_image.h, train_retrieval.h).
#include "train/train_recipe.h"

#include <algorithm>

#include "train/train_image.h"
#include "train/train_retrieval.h"

namespace contrax::cli {

const std::vector<std::string>& train_recipe_names() {
  static const std::vector<std::string> names = {"simclr", "moco-v3", "retrieval"};
  return names;
}

bool is_train_recipe(const std::string& name) {
  const auto& names = train_recipe_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::unique_ptr<TrainRecipe> make_train_recipe(const std::string& name, const std::string& variant) {
  return name == "retrieval" ? make_retrieval_recipe() : make_image_recipe(name, variant);
}

}  // namespace contrax::cli
