// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/image/eval.h.
#pragma once
#pragma GCC warning "contrax/train/eval.h is deprecated: include contrax/train/image/eval.h"
#include "contrax/train/image/eval.h"
