// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/comm/failure.h.
#pragma once
#pragma GCC warning "contrax/failure.h is deprecated: include contrax/comm/failure.h"
#include "contrax/comm/failure.h"
