// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/losses/grouped.h.
#pragma once
#pragma GCC warning "contrax/grouped.h is deprecated: include contrax/losses/grouped.h"
#include "contrax/losses/grouped.h"
