// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/launch/launcher.h.
#pragma once
#pragma GCC warning "contrax/launcher.h is deprecated: include contrax/launch/launcher.h"
#include "contrax/launch/launcher.h"
