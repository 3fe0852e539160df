// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/common/checkpoint.h.
#pragma once
#pragma GCC warning "contrax/train/checkpoint.h is deprecated: include contrax/train/common/checkpoint.h"
#include "contrax/train/common/checkpoint.h"
