// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/image/models.h.
#pragma once
#pragma GCC warning "contrax/train/models.h is deprecated: include contrax/train/image/models.h"
#include "contrax/train/image/models.h"
