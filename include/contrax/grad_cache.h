// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/parallel/grad_cache.h.
#pragma once
#pragma GCC warning "contrax/grad_cache.h is deprecated: include contrax/parallel/grad_cache.h"
#include "contrax/parallel/grad_cache.h"
