// Deprecated (kept for one release): the training headers are grouped by
// concern now; include contrax/train/retrieval/wordnet.h.
#pragma once
#pragma GCC warning "contrax/train/wordnet.h is deprecated: include contrax/train/retrieval/wordnet.h"
#include "contrax/train/retrieval/wordnet.h"
