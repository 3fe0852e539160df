// Contrax umbrella header: exact distributed contrastive learning on LibTorch.
#pragma once

#include "contrax/collectives.h"
#include "contrax/communicator.h"
#include "contrax/launcher.h"
#include "contrax/losses.h"
#include "contrax/memory.h"
#include "contrax/reference.h"
