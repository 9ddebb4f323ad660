// fp16 / bf16 values held as their uint16 bits, to and from fp32 on the device (CUDA only).
// The CPU kernels convert on the host (kvquant_cpu.cpp; the PCA codec in PyTorch); the conversions
// are exact widening and round-to-nearest-even narrowing, so both give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace lmtier {

// The fp32 value of the bf16 (BF16) or fp16 bits h; exact.
template <bool BF16>
__device__ __forceinline__ float widen(uint16_t h) {
  if constexpr (BF16) return __uint_as_float(static_cast<uint32_t>(h) << 16);
  return __half2float(__ushort_as_half(h));
}

// The bf16 (BF16) or fp16 bits of v rounded to nearest, ties to even.
template <bool BF16>
__device__ __forceinline__ uint16_t narrow(float v) {
  if constexpr (BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return __half_as_ushort(__float2half_rn(v));
}

}  // namespace lmtier
