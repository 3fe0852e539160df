// The engine kernels for AVX-512 (compiled with -mavx512f -mavx512dq; used only where the CPU has both).
#define CONTRAX_SIMD_NS avx512
#define CONTRAX_SIMD_BYTES 64
#include "engine/kernels/lse_simd.h"
