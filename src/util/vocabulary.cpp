// The checks of the vocabulary's option sets (contrax/util/vocabulary.h),
// shared by every loss's front end and the cost model.
#include "contrax/util/vocabulary.h"

#include "util/check.h"

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

}  // namespace contrax::detail
