// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/check/plan.h.
#pragma once
#pragma GCC warning "contrax/plan.h is deprecated: include contrax/check/plan.h"
#include "contrax/check/plan.h"
