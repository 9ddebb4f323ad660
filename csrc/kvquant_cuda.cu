// lmtier — CUDA KV quantize / dequantize, bit-exact with kvquant_cpu.cpp and the torch reference
// lmtier/codec/quant.py (rules, layouts, status: kvquant.h).
//
// Mapping: one CTA = one (layer, plane, head) x a tile of kTileTokens tokens of one chunk (grid.x =
// L*2*H*tiles, grid.y walks the chunks); 8 warps, one warp per (token, head) row of D values, lane
// k holding the E = D/32 consecutive values k*E .. k*E+E-1. The FWHT runs in the reference's stage
// order: the local stages h = 1 .. E/2 inside the lane, then h = E, 2E, .., D/2 across lanes with
// __shfl_xor_sync (lane mask h/E); each output is one __fadd_rn / __fsub_rn. The row's symbols go
// to shared memory as [token][d] and leave transposed, [d][token] rows of the tile (4-byte stores
// when T % 4 == 0), so the symbol stream order [L, 2, H, D, T] is written coalesced over tokens.
//
// Exactness: built with -fmad=false (CMakeLists.txt) and no fast-math; divisions are __fdiv_rn,
// rounding rintf (half to even), multiplies __fmul_rn (exact products anyway: FMA could not change
// a result, but none can form). One kernel launch per call, plus one cudaMemsetAsync of the status.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "lmtier/common.h"
#include "lmtier/half_bits.cuh"
#include "lmtier/kvquant.h"

namespace lmtier {
namespace kvq {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = kTileTokens / kWarps;
constexpr unsigned kFull = 0xFFFFFFFFu;
// Chunk address not 16-byte aligned (the wrapper checks first).
constexpr int32_t kErrMisaligned = 8;

struct QmaxParam {
  uint8_t v[2 * kMaxLayers];  // [L][2]
};

__device__ __forceinline__ bool finite_bits(float v) {
  return (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u;
}

// E consecutive uint16 at p (aligned to 2*E bytes).
template <int E>
__device__ __forceinline__ void load_row(const uint16_t* p, uint16_t (&v)[E]) {
  if constexpr (E == 8) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const uint32_t a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = static_cast<uint16_t>(a[i] & 0xFFFF);
      v[2 * i + 1] = static_cast<uint16_t>(a[i] >> 16);
    }
  } else if constexpr (E == 4) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    v[0] = static_cast<uint16_t>(w.x & 0xFFFF);
    v[1] = static_cast<uint16_t>(w.x >> 16);
    v[2] = static_cast<uint16_t>(w.y & 0xFFFF);
    v[3] = static_cast<uint16_t>(w.y >> 16);
  } else if constexpr (E == 2) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    v[0] = static_cast<uint16_t>(w & 0xFFFF);
    v[1] = static_cast<uint16_t>(w >> 16);
  } else {
    v[0] = *p;
  }
}

template <int E>
__device__ __forceinline__ void store_row(uint16_t* p, const uint16_t (&v)[E]) {
  if constexpr (E == 8) {
    uint4 w;
    w.x = v[0] | (static_cast<uint32_t>(v[1]) << 16);
    w.y = v[2] | (static_cast<uint32_t>(v[3]) << 16);
    w.z = v[4] | (static_cast<uint32_t>(v[5]) << 16);
    w.w = v[6] | (static_cast<uint32_t>(v[7]) << 16);
    *reinterpret_cast<uint4*>(p) = w;
  } else if constexpr (E == 4) {
    uint2 w;
    w.x = v[0] | (static_cast<uint32_t>(v[1]) << 16);
    w.y = v[2] | (static_cast<uint32_t>(v[3]) << 16);
    *reinterpret_cast<uint2*>(p) = w;
  } else if constexpr (E == 2) {
    *reinterpret_cast<uint32_t*>(p) = v[0] | (static_cast<uint32_t>(v[1]) << 16);
  } else {
    *p = v[0];
  }
}

// Unnormalized FWHT of a warp-held row (lane holds elements lane*E + j), reference stage order.
template <int E>
__device__ __forceinline__ void fwht_warp(float (&y)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if ((j & h) == 0) {
        const float a = y[j], b = y[j + h];
        y[j] = __fadd_rn(a, b);
        y[j + h] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {  // stage h = m * E
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const float o = __shfl_xor_sync(kFull, y[j], m);
      y[j] = upper ? __fsub_rn(o, y[j]) : __fadd_rn(y[j], o);
    }
  }
}

// Tile in shared memory: [kTileTokens][D + 4] bytes ([token][d]); rows of the global plane are
// [d][T] with the tile's tokens at t0 .. t0 + nt - 1.
template <int D>
__device__ __forceinline__ void tile_to_global(const uint8_t (*s)[D + 4], uint8_t* dst, int T,
                                               int nt, bool vec) {
  if (vec) {  // T % 4 == 0 and dst 4-byte aligned, so every (d, 4k) word is aligned
    constexpr int kWords = kTileTokens / 4;
    for (int w = threadIdx.x; w < D * kWords; w += kThreads) {
      const int d = w / kWords, k = w % kWords;
      if (4 * k < nt) {
        const uint32_t v = s[4 * k][d] | (static_cast<uint32_t>(s[4 * k + 1][d]) << 8) |
                           (static_cast<uint32_t>(s[4 * k + 2][d]) << 16) |
                           (static_cast<uint32_t>(s[4 * k + 3][d]) << 24);
        *reinterpret_cast<uint32_t*>(dst + static_cast<uint64_t>(d) * T + 4 * k) = v;
      }
    }
  } else {
    for (int w = threadIdx.x; w < D * kTileTokens; w += kThreads) {
      const int d = w / kTileTokens, t = w % kTileTokens;
      if (t < nt) dst[static_cast<uint64_t>(d) * T + t] = s[t][d];
    }
  }
}

template <int D>
__device__ __forceinline__ void global_to_tile(const uint8_t* src, uint8_t (*s)[D + 4], int T,
                                               int nt, bool vec) {
  if (vec) {
    constexpr int kWords = kTileTokens / 4;
    for (int w = threadIdx.x; w < D * kWords; w += kThreads) {
      const int d = w / kWords, k = w % kWords;
      if (4 * k < nt) {
        const uint32_t v =
            *reinterpret_cast<const uint32_t*>(src + static_cast<uint64_t>(d) * T + 4 * k);
        s[4 * k][d] = static_cast<uint8_t>(v);
        s[4 * k + 1][d] = static_cast<uint8_t>(v >> 8);
        s[4 * k + 2][d] = static_cast<uint8_t>(v >> 16);
        s[4 * k + 3][d] = static_cast<uint8_t>(v >> 24);
      }
    }
  } else {
    for (int w = threadIdx.x; w < D * kTileTokens; w += kThreads) {
      const int d = w / kTileTokens, t = w % kTileTokens;
      if (t < nt) s[t][d] = src[static_cast<uint64_t>(d) * T + t];
    }
  }
}

struct TileCoords {
  int lp, hd, t0, nt;
  uint64_t lph;
};

__device__ __forceinline__ TileCoords tile_coords(const KvqGeometry& g, int tiles) {
  TileCoords c;
  const int tile = static_cast<int>(blockIdx.x % tiles);
  c.lph = blockIdx.x / tiles;
  c.hd = static_cast<int>(c.lph % g.num_heads);
  c.lp = static_cast<int>(c.lph / g.num_heads);
  c.t0 = tile * kTileTokens;
  c.nt = min(kTileTokens, g.num_tokens - c.t0);
  return c;
}

// ---- quantize ----------------------------------------------------------------------------------
template <int D, int DT, int MODE>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(KvqGeometry g, const KvqChunkDesc* __restrict__ chunks, int64_t num_chunks,
                    QmaxParam qm, int32_t* __restrict__ status, int tiles) {
  constexpr int E = D / 32;
  __shared__ __align__(16) uint8_t s_hi[kTileTokens][D + 4];
  __shared__ __align__(16) uint8_t s_lo[MODE == kModeLossless ? kTileTokens : 1][D + 4];
  __shared__ uint8_t s_code[kTileTokens];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const TileCoords tc = tile_coords(g, tiles);
  const int T = g.num_tokens, H = g.num_heads;
  const int qmax = qm.v[tc.lp];
  const float fq = static_cast<float>(qmax);
  for (int64_t c = blockIdx.y; c < num_chunks; c += gridDim.y) {
    const KvqChunkDesc cd = chunks[c];
    if (cd.chunk & 15) {
      if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(status + c, kErrMisaligned);
      continue;
    }
    const uint16_t* in = reinterpret_cast<const uint16_t*>(cd.chunk) +
                         ((static_cast<uint64_t>(tc.lp) * T + tc.t0) * H + tc.hd) * D + lane * E;
    uint16_t raw[kRowsPerWarp][E];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int t = warp * kRowsPerWarp + i;
      if (t < tc.nt) load_row<E>(in + static_cast<uint64_t>(t) * H * D, raw[i]);
    }
    int32_t st = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int t = warp * kRowsPerWarp + i;
      if (t >= tc.nt) break;  // warp-uniform
      if constexpr (MODE == kModeLossless) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
          const uint32_t u = raw[i][j];
          const uint32_t r = ((u << 1) | (u >> 15)) & 0xFFFFu;
          s_hi[t][lane * E + j] = static_cast<uint8_t>(r >> 8);
          s_lo[t][lane * E + j] = static_cast<uint8_t>(r & 0xFF);
        }
      } else {
        float y[E];
        bool bad_in = false;
#pragma unroll
        for (int j = 0; j < E; ++j) {
          y[j] = widen<DT == kBF16>(raw[i][j]);
          bad_in |= !finite_bits(y[j]);
        }
        fwht_warp<E>(y, lane);
        float a = 0.0f;
        bool fin = true;
#pragma unroll
        for (int j = 0; j < E; ++j) {
          const float v = fabsf(y[j]);
          fin &= finite_bits(v);
          a = v > a ? v : a;
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) {
          const float o = __shfl_xor_sync(kFull, a, m);
          a = o > a ? o : a;
        }
        fin = __all_sync(kFull, fin);
        if (bad_in) st |= kErrNonFinite;
        int32_t code = fin ? scale_code_ceil_bits(__float_as_uint(__fdiv_rn(a, fq))) : -1;
        if (code < 0) {
          st |= kErrScaleRange;
          code = 0;
        }
        const float s = __uint_as_float(scale_value_bits(static_cast<uint32_t>(code)));
#pragma unroll
        for (int j = 0; j < E; ++j) {
          float q = 0.0f;
          if (code != 0) q = fminf(fmaxf(rintf(__fdiv_rn(y[j], s)), -fq), fq);
          s_hi[t][lane * E + j] = static_cast<uint8_t>(static_cast<int32_t>(q) + qmax);
        }
        if (lane == 0) s_code[t] = static_cast<uint8_t>(code);
      }
    }
    if (st) atomicOr(status + c, st);
    __syncthreads();
    const uint64_t plane_off = tc.lph * D * static_cast<uint64_t>(T) + tc.t0;
    uint8_t* sym = reinterpret_cast<uint8_t*>(cd.symbols) + plane_off;
    const bool vec_sym = (T & 3) == 0 && (cd.symbols & 3) == 0;
    tile_to_global<D>(s_hi, sym, T, tc.nt, vec_sym);
    if constexpr (MODE == kModeLossless) {
      const bool vec_lo = (T & 3) == 0 && (cd.side & 3) == 0;
      tile_to_global<D>(s_lo, reinterpret_cast<uint8_t*>(cd.side) + plane_off, T, tc.nt, vec_lo);
    } else {
      uint8_t* codes = reinterpret_cast<uint8_t*>(cd.side) + tc.lph * T + tc.t0;
      if (static_cast<int>(threadIdx.x) < tc.nt) codes[threadIdx.x] = s_code[threadIdx.x];
    }
    __syncthreads();
  }
}

// ---- dequantize --------------------------------------------------------------------------------
template <int D, int DT, int MODE>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(KvqGeometry g, const KvqChunkDesc* __restrict__ chunks, int64_t num_chunks,
                      QmaxParam qm, int32_t* __restrict__ status, int tiles) {
  constexpr int E = D / 32;
  __shared__ __align__(16) uint8_t s_hi[kTileTokens][D + 4];
  __shared__ __align__(16) uint8_t s_lo[MODE == kModeLossless ? kTileTokens : 1][D + 4];
  __shared__ uint8_t s_code[kTileTokens];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const TileCoords tc = tile_coords(g, tiles);
  const int T = g.num_tokens, H = g.num_heads;
  const int qmax = qm.v[tc.lp];
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t c = blockIdx.y; c < num_chunks; c += gridDim.y) {
    const KvqChunkDesc cd = chunks[c];
    if (cd.chunk & 15) {
      if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(status + c, kErrMisaligned);
      continue;
    }
    const uint64_t plane_off = tc.lph * D * static_cast<uint64_t>(T) + tc.t0;
    const bool vec_sym = (T & 3) == 0 && (cd.symbols & 3) == 0;
    global_to_tile<D>(reinterpret_cast<const uint8_t*>(cd.symbols) + plane_off, s_hi, T, tc.nt,
                      vec_sym);
    if constexpr (MODE == kModeLossless) {
      const bool vec_lo = (T & 3) == 0 && (cd.side & 3) == 0;
      global_to_tile<D>(reinterpret_cast<const uint8_t*>(cd.side) + plane_off, s_lo, T, tc.nt,
                        vec_lo);
    } else {
      const uint8_t* codes = reinterpret_cast<const uint8_t*>(cd.side) + tc.lph * T + tc.t0;
      if (static_cast<int>(threadIdx.x) < tc.nt) s_code[threadIdx.x] = codes[threadIdx.x];
    }
    __syncthreads();
    uint16_t* out = reinterpret_cast<uint16_t*>(cd.chunk) +
                    ((static_cast<uint64_t>(tc.lp) * T + tc.t0) * H + tc.hd) * D + lane * E;
    int32_t st = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int t = warp * kRowsPerWarp + i;
      if (t >= tc.nt) break;  // warp-uniform
      uint16_t v[E];
      if constexpr (MODE == kModeLossless) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
          const uint32_t r =
              (static_cast<uint32_t>(s_hi[t][lane * E + j]) << 8) | s_lo[t][lane * E + j];
          v[j] = static_cast<uint16_t>(((r >> 1) | ((r & 1u) << 15)) & 0xFFFFu);
        }
      } else {
        const float s = __uint_as_float(scale_value_bits(s_code[t]));
        float y[E];
#pragma unroll
        for (int j = 0; j < E; ++j) {
          const int sv = s_hi[t][lane * E + j];
          if (sv > 2 * qmax) st |= kErrSymbol;
          y[j] = __fmul_rn(static_cast<float>(sv - qmax), s);
        }
        fwht_warp<E>(y, lane);
#pragma unroll
        for (int j = 0; j < E; ++j) v[j] = narrow<DT == kBF16>(__fmul_rn(y[j], inv_d));
      }
      store_row<E>(out + static_cast<uint64_t>(t) * H * D, v);
    }
    if (st) atomicOr(status + c, st);
    __syncthreads();
  }
}

template <bool ENC, int D, int DT, int MODE>
void launch(const KvqGeometry& g, const KvqChunkDesc* chunks, int64_t num_chunks,
            const QmaxParam& qp, int32_t* status, cudaStream_t s) {
  const int tiles = (g.num_tokens + kTileTokens - 1) / kTileTokens;
  const uint64_t gx = 2ull * g.num_layers * g.num_heads * tiles;
  LMTIER_CHECK_ARG(gx <= 0x7FFFFFFFull, "kvquant (CUDA): geometry too large for one launch");
  const dim3 grid(static_cast<unsigned>(gx),
                  static_cast<unsigned>(num_chunks < 65535 ? num_chunks : 65535));
  if constexpr (ENC)
    quantize_kernel<D, DT, MODE>
        <<<grid, kThreads, 0, s>>>(g, chunks, num_chunks, qp, status, tiles);
  else
    dequantize_kernel<D, DT, MODE>
        <<<grid, kThreads, 0, s>>>(g, chunks, num_chunks, qp, status, tiles);
  LMTIER_CUDA_CHECK_LAUNCH();
}

template <bool ENC, int D>
void dispatch_mode(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                   int64_t num_chunks, const QmaxParam& qp, int32_t* status, cudaStream_t s) {
  if (mode == kModeLossless)
    launch<ENC, D, kBF16, kModeLossless>(g, chunks, num_chunks, qp, status, s);  // bits only
  else if (dtype == kBF16)
    launch<ENC, D, kBF16, kModeHadamardRow>(g, chunks, num_chunks, qp, status, s);
  else
    launch<ENC, D, kFP16, kModeHadamardRow>(g, chunks, num_chunks, qp, status, s);
}

template <bool ENC>
void run(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
         int64_t num_chunks, const uint8_t* qmax, int32_t* status, void* stream) {
  check_args(mode, dtype, g, num_chunks, chunks, qmax, status, /*on_cuda=*/true);
  if (num_chunks == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  LMTIER_CUDA_CHECK(cudaMemsetAsync(status, 0, sizeof(int32_t) * num_chunks, s));
  if (g.num_tokens == 0) return;
  QmaxParam qp;
  std::memset(&qp, 0, sizeof(qp));
  if (mode != kModeLossless) std::memcpy(qp.v, qmax, 2 * static_cast<size_t>(g.num_layers));
  switch (g.head_size) {
    case 32: dispatch_mode<ENC, 32>(mode, dtype, g, chunks, num_chunks, qp, status, s); break;
    case 64: dispatch_mode<ENC, 64>(mode, dtype, g, chunks, num_chunks, qp, status, s); break;
    case 128: dispatch_mode<ENC, 128>(mode, dtype, g, chunks, num_chunks, qp, status, s); break;
    case 256: dispatch_mode<ENC, 256>(mode, dtype, g, chunks, num_chunks, qp, status, s); break;
    default: LMTIER_CHECK_ARG(false, "kvquant (CUDA): unsupported head_size ", g.head_size);
  }
}

}  // namespace

void quantize_cuda(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                   int64_t num_chunks, const uint8_t* qmax, int32_t* status, void* stream) {
  run<true>(mode, dtype, g, chunks, num_chunks, qmax, status, stream);
}

void dequantize_cuda(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                     int64_t num_chunks, const uint8_t* qmax, int32_t* status, void* stream) {
  run<false>(mode, dtype, g, chunks, num_chunks, qmax, status, stream);
}

}  // namespace kvq
}  // namespace lmtier
