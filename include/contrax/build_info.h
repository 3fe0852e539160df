// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/check/build_info.h.
#pragma once
#pragma GCC warning "contrax/build_info.h is deprecated: include contrax/check/build_info.h"
#include "contrax/check/build_info.h"
