// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/image/idx.h.
#pragma once
#pragma GCC warning "contrax/train/idx.h is deprecated: include contrax/train/image/idx.h"
#include "contrax/train/image/idx.h"
