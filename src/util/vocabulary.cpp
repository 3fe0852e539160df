// The checks of the vocabulary's option sets (contrax/util/vocabulary.h),
// shared by every loss's front end and the cost model.
#include "contrax/util/vocabulary.h"

#include "util/check.h"

#include <algorithm>
#include <cmath>

namespace contrax::detail {

void check_memory_path(ArgChecker& check, const MemoryPathOptions& o) {
  // -1 was the spelling of path kMaterialised until the release that
  // deprecated it; the message says what replaced it.
  check.require(o.tile_size() >= 0, "argument 'tile_size' must be >= 0 (the tile side; 0 chooses it from tile_bytes",
                o.tile_size() == -1 ? "; the materialised path is path kMaterialised" : "", "), but got ",
                o.tile_size());
  check.require(o.tile_bytes() > 0, "argument 'tile_bytes' must be positive, but got ", o.tile_bytes());
  check.require(o.max_logits_bytes() > 0, "argument 'max_logits_bytes' must be positive, but got ",
                o.max_logits_bytes());
  check.require(!o.ring() || o.path() != MemoryPath::kMaterialised,
                "'ring' needs the tiled path, but the path is materialised ('path' is kMaterialised)");
}

void check_matryoshka(ArgChecker& check, const MatryoshkaOptions& o, int64_t width) {
  const auto& dims = o.dims();
  const auto& weights = o.weights();
  for (size_t i = 0; i < dims.size(); ++i) {
    check.require(dims[i] >= 1 && dims[i] <= width, "argument 'matryoshka_dims' must hold widths in [1, ", width,
                  "] (the features' width), but got ", dims[i]);
    check.require(std::count(dims.begin(), dims.end(), dims[i]) == 1,
                  "argument 'matryoshka_dims' must not repeat a width, but ", dims[i], " appears more than once");
  }
  check.require(weights.empty() || !dims.empty(), "argument 'matryoshka_weights' needs 'matryoshka_dims'");
  check.require(weights.empty() || weights.size() == dims.size(), "argument 'matryoshka_weights' must hold one ",
                "weight per entry of 'matryoshka_dims' (", dims.size(), ") or none, but got ", weights.size());
  for (double w : weights) {
    check.require(std::isfinite(w), "argument 'matryoshka_weights' must hold finite numbers, but got ", w);
  }
}

std::vector<Prefix> matryoshka_prefixes(const MatryoshkaOptions& o, int64_t width) {
  std::vector<Prefix> prefixes;
  for (size_t i = 0; i < o.dims().size(); ++i) {
    prefixes.push_back({o.dims()[i], o.weights().empty() ? 1.0 : o.weights()[i]});
  }
  if (prefixes.empty()) return prefixes;
  std::sort(prefixes.begin(), prefixes.end(), [](const Prefix& x, const Prefix& y) { return x.dim < y.dim; });
  if (prefixes.back().dim != width) prefixes.push_back({width, 1.0});
  return prefixes;
}

}  // namespace contrax::detail
