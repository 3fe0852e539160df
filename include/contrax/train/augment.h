// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/image/augment.h.
#pragma once
#pragma GCC warning "contrax/train/augment.h is deprecated: include contrax/train/image/augment.h"
#include "contrax/train/image/augment.h"
