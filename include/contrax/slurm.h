// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/comm/slurm.h.
#pragma once
#pragma GCC warning "contrax/slurm.h is deprecated: include contrax/comm/slurm.h"
#include "contrax/comm/slurm.h"
