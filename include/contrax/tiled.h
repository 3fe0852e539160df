// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/losses/tiled.h.
#pragma once
#pragma GCC warning "contrax/tiled.h is deprecated: include contrax/losses/tiled.h"
#include "contrax/losses/tiled.h"
