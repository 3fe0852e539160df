// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/losses/siglip.h.
#pragma once
#pragma GCC warning "contrax/siglip.h is deprecated: include contrax/losses/siglip.h"
#include "contrax/losses/siglip.h"
