// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/util/vocabulary.h.
#pragma once
#pragma GCC warning "contrax/vocabulary.h is deprecated: include contrax/util/vocabulary.h"
#include "contrax/util/vocabulary.h"
