// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/common/metrics.h.
#pragma once
#pragma GCC warning "contrax/train/metrics.h is deprecated: include contrax/train/common/metrics.h"
#include "contrax/train/common/metrics.h"
