// The engine kernels for AVX2 + FMA (compiled with -mavx2 -mfma; used only where the CPU has both).
#define CONTRAX_SIMD_NS avx2
#define CONTRAX_SIMD_BYTES 32
#include "engine/kernels/lse_simd.h"
