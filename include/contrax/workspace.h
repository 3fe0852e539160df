// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/engine/workspace.h.
#pragma once
#pragma GCC warning "contrax/workspace.h is deprecated: include contrax/engine/workspace.h"
#include "contrax/engine/workspace.h"
