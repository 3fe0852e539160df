// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/comm/collectives.h.
#pragma once
#pragma GCC warning "contrax/collectives.h is deprecated: include contrax/comm/collectives.h"
#include "contrax/comm/collectives.h"
