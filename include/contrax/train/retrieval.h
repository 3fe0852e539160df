// Deprecated (kept for one release): the training headers are grouped by
// concern now; the retrieval recipe is contrax/train/retrieval/{towers,bm25,
// eval,trainer}.h.
#pragma once
#pragma GCC warning "contrax/train/retrieval.h is deprecated: include contrax/train/retrieval/trainer.h (and towers.h, bm25.h, eval.h)"
#include "contrax/train/retrieval/bm25.h"
#include "contrax/train/retrieval/eval.h"
#include "contrax/train/retrieval/towers.h"
#include "contrax/train/retrieval/trainer.h"
