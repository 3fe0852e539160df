// Deprecated (kept for one release): include contrax/comm/detail/c10d.h.
#pragma once
#pragma GCC warning "contrax/detail/c10d.h is deprecated: include contrax/comm/detail/c10d.h"
#include "contrax/comm/detail/c10d.h"
