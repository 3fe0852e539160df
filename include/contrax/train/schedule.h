// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/common/schedule.h.
#pragma once
#pragma GCC warning "contrax/train/schedule.h is deprecated: include contrax/train/common/schedule.h"
#include "contrax/train/common/schedule.h"
