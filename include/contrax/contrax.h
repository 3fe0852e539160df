// Contrax umbrella header: exact distributed contrastive learning on LibTorch.
// Every public header of the core library (contrax::contrax). The trainer of
// `contrax train` is a separate library with its own headers under
// contrax/train/ (contrax::train), not part of this umbrella.
#pragma once

#include "contrax/check/build_info.h"
#include "contrax/check/plan.h"
#include "contrax/check/verify.h"
#include "contrax/comm/collectives.h"
#include "contrax/comm/communicator.h"
#include "contrax/comm/failure.h"
#include "contrax/comm/slurm.h"
#include "contrax/engine/workspace.h"
#include "contrax/launch/launcher.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/maxsim.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"
#include "contrax/losses/tiled.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "contrax/util/memory.h"
#include "contrax/util/tasks.h"
#include "contrax/util/vocabulary.h"
