// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/image/trainer.h.
#pragma once
#pragma GCC warning "contrax/train/trainer.h is deprecated: include contrax/train/image/trainer.h"
#include "contrax/train/image/trainer.h"
