// The cost model of maxsim_loss's memory paths, for plan_loss
// (contrax/check/plan.h; src/check/plan.cpp). Internal to the check layer.
#pragma once

#include <cstdint>

#include "contrax/check/plan.h"

namespace contrax::detail {

/// Fills each path's cost of maxsim_loss (PlanOptions' loss "maxsim") for the
/// rank with `b` queries, and returns the GEMMs of the dense einsum form
/// (PyLate's, colpali-engine's) in the same units.
int64_t maxsim_costs(const PlanOptions& o, int64_t b, PathCost& mat, PathCost& tiled, PathCost& ring);

}  // namespace contrax::detail
