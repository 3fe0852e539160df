// Deprecated (kept for one release): the public headers are in the folders of
// the library's layers now; include contrax/comm/communicator.h.
#pragma once
#pragma GCC warning "contrax/communicator.h is deprecated: include contrax/comm/communicator.h"
#include "contrax/comm/communicator.h"
