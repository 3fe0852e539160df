// Contrax umbrella header: exact distributed contrastive learning on LibTorch.
// Every public header of the core library (contrax::contrax). The trainer of
// `contrax train` is a separate library with its own headers under
// contrax/train/ (contrax::train), not part of this umbrella.
#pragma once

#include "contrax/build_info.h"
#include "contrax/collectives.h"
#include "contrax/communicator.h"
#include "contrax/data_parallel.h"
#include "contrax/failure.h"
#include "contrax/grad_cache.h"
#include "contrax/grouped.h"
#include "contrax/launcher.h"
#include "contrax/losses.h"
#include "contrax/memory.h"
#include "contrax/tasks.h"
#include "contrax/plan.h"
#include "contrax/reference.h"
#include "contrax/siglip.h"
#include "contrax/slurm.h"
#include "contrax/tiled.h"
#include "contrax/verify.h"
#include "contrax/vocabulary.h"
#include "contrax/workspace.h"
