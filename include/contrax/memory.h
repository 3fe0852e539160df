// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/util/memory.h.
#pragma once
#pragma GCC warning "contrax/memory.h is deprecated: include contrax/util/memory.h"
#include "contrax/util/memory.h"
