// LMTIER_HD: marks small arithmetic helpers that host (C++) and device (CUDA) code share, so the
// CPU and GPU implementations compute with one copy of the bit logic.
#pragma once

#if defined(__CUDACC__)
#define LMTIER_HD __host__ __device__ __forceinline__
#else
#define LMTIER_HD inline
#endif
