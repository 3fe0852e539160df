// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/check/verify.h.
#pragma once
#pragma GCC warning "contrax/verify.h is deprecated: include contrax/check/verify.h"
#include "contrax/check/verify.h"
