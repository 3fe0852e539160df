// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/common/sampler.h.
#pragma once
#pragma GCC warning "contrax/train/sampler.h is deprecated: include contrax/train/common/sampler.h"
#include "contrax/train/common/sampler.h"
