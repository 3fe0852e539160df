// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/parallel/data_parallel.h.
#pragma once
#pragma GCC warning "contrax/data_parallel.h is deprecated: include contrax/parallel/data_parallel.h"
#include "contrax/parallel/data_parallel.h"
