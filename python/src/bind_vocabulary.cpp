// The vocabulary's enums (contrax/util/vocabulary.h) as Python spells them:
// strings, parsed here for every loss binding; a bad one is an argument error
// (ValueError) naming the loss that was called.
#include <c10/util/Exception.h>

#include "bind.h"

namespace contrax::python {

Reduction reduction_of(const std::string& s, const char* caller) {
  if (s == "mean") return Reduction::kMean;
  if (s == "sum") return Reduction::kSum;
  if (s == "none") return Reduction::kNone;
  TORCH_CHECK(false, caller, "(): argument 'reduction' must be 'mean', 'sum' or 'none', but got '", s, "'");
}

MemoryPath path_of(const std::string& s, const char* caller) {
  if (s == "auto") return MemoryPath::kAuto;
  if (s == "materialised" || s == "materialized") return MemoryPath::kMaterialised;
  if (s == "tiled") return MemoryPath::kTiled;
  TORCH_CHECK(false, caller, "(): argument 'path' must be 'auto', 'materialised' or 'tiled', but got '", s, "'");
}

LabelMode label_mode_of(const std::string& s, const char* caller) {
  if (s == "multi_positive") return LabelMode::kMultiPositive;
  if (s == "mask_duplicates") return LabelMode::kMaskDuplicates;
  TORCH_CHECK(false, caller, "(): argument 'label_mode' must be 'multi_positive' or 'mask_duplicates', but got '", s,
              "'");
}

}  // namespace contrax::python
