// The engine kernels for the baseline x86-64 ISA (or any other CPU).
#define CONTRAX_SIMD_NS base
#define CONTRAX_SIMD_BYTES 16
#include "engine/kernels/lse_simd.h"
