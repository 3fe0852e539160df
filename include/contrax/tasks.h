// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/util/tasks.h.
#pragma once
#pragma GCC warning "contrax/tasks.h is deprecated: include contrax/util/tasks.h"
#include "contrax/util/tasks.h"
