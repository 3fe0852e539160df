// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/losses/reference.h.
#pragma once
#pragma GCC warning "contrax/reference.h is deprecated: include contrax/losses/reference.h"
#include "contrax/losses/reference.h"
