// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/losses/losses.h.
#pragma once
#pragma GCC warning "contrax/losses.h is deprecated: include contrax/losses/losses.h"
#include "contrax/losses/losses.h"
