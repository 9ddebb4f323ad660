// lmtier — CUDA kernels of the PCA codec levels' transform, bit-exact with the torch reference
// lmtier/codec/pca/transform.py (rules and layouts: lmtier/pca.h).
//
// Mapping: encode_pre, encode_post and decode_post run one CTA per vector row (layer group r,
// plane p, token t) of N values, threads striding over the values; the row sums and energies are
// exact int64 block reductions (any order). encode_symbols and decode_pre transpose 32 x 32 tiles
// through shared memory ([T][N] <-> [N][T]). decode_post keeps its row of float64 values in dynamic
// shared memory (N * 8 bytes) so the keys' RoPE can pair channel d with d +- D/2.
//
// Exactness: -fmad=false (CMakeLists.txt); float64 steps are __dmul_rn / __dsub_rn / __dadd_rn /
// rint (half to even) in the reference's order; int8 -> int64 combinations are exact integers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "lmtier/common.h"
#include "lmtier/half_bits.cuh"
#include "lmtier/pca.h"

namespace lmtier {
namespace pca {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xFFFFFFFFu;

// Exact int64 sum over the CTA (kThreads threads); the result is valid in thread 0.
__device__ __forceinline__ long long block_sum(long long v) {
  __shared__ long long part[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  long long s = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) s += part[w];
  return s;
}

__device__ __forceinline__ double clamp_abs(double v, double m) { return fmin(fmax(v, -m), m); }

// Element offset of value n of row (r, p, t) in the canonical chunk [L][2][T][H][D]: value n is
// layer r * G + n / (H * D) and, within its token's H * D values, value n % (H * D).
__device__ __forceinline__ int64_t chunk_offset(const PcaGeometry& g, int r, int p, int t, int n) {
  const int hd = g.H * g.D, gl = n / hd, rem = n - gl * hd;
  return (((int64_t)(r * g.G + gl) * 2 + p) * g.T + t) * hd + rem;
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    encode_pre_kernel(PcaGeometry g, const uint16_t* __restrict__ kv,
                      const double* __restrict__ cos_t, const double* __restrict__ sin_t,
                      const double* __restrict__ inv_x_scale, int8_t* __restrict__ xs,
                      int64_t* __restrict__ rowsum, int32_t* __restrict__ flags) {
  const int T = g.T, D = g.D, N = g.N(), N8 = g.N8(), half = D / 2;
  const int row = blockIdx.x, t = row % T, rp = row / T, p = rp % 2, r = rp / 2;
  const double s = inv_x_scale[rp];
  int8_t* xh = xs + ((int64_t)rp * 2 * T + t) * N8;
  int8_t* xl = xh + (int64_t)T * N8;
  long long sum = 0;
  bool over = false, bad = false;
  for (int n = threadIdx.x; n < N8; n += kThreads) {
    int v = 0;
    if (n < N) {
      const int64_t o = chunk_offset(g, r, p, t, n);
      double x = widen<DT == kBF16>(kv[o]);
      bad |= !isfinite(x);  // every value of the chunk is some row's kv[o] exactly once
      if (p == 0 && cos_t != nullptr) {  // RoPE undone: x * cos - rotate_half(x) * sin
        const int d = n % D;
        const double xp = widen<DT == kBF16>(kv[o - d + (d < half ? d + half : d - half)]);
        const double rot = d < half ? -xp : xp;
        x = __dsub_rn(__dmul_rn(x, cos_t[(int64_t)t * D + d]),
                      __dmul_rn(rot, sin_t[(int64_t)t * D + d]));
      }
      double xi = rint(__dmul_rn(x, s));
      if (fabs(xi) > kXMax) {
        over = true;
        xi = clamp_abs(xi, kXMax);
      }
      v = static_cast<int>(xi);
    }
    xh[n] = static_cast<int8_t>(v >> 8);
    xl[n] = static_cast<int8_t>((v & 255) - 128);
    sum += v;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) rowsum[row] = sum;
  if (over) atomicOr(flags + t, kFlagClamped);
  if (bad) atomicOr(flags + t, kFlagNonFinite);
}

__global__ void __launch_bounds__(kThreads)
    encode_post_kernel(PcaGeometry g, const int32_t* __restrict__ y,
                       const int64_t* __restrict__ col, const int64_t* __restrict__ rowsum,
                       const double* __restrict__ e_mu, const double* __restrict__ k,
                       int16_t* __restrict__ q, int64_t* __restrict__ energy,
                       int32_t* __restrict__ flags) {
  const int T = g.T, N = g.N(), N8 = g.N8();
  const int row = blockIdx.x, t = row % T, rp = row / T;
  const int32_t* yh = y + ((int64_t)rp * 2 * T + t) * 2 * N8;  // [xh @ eh | xh @ el]
  const int32_t* yl = yh + (int64_t)T * 2 * N8;                // [xl @ eh | xl @ el]
  const int64_t rs = 128 * rowsum[row];  // the 128 offset of the other operand's bytes
  const int64_t* c = col + (int64_t)rp * N8;
  const double* mu = e_mu + (int64_t)rp * N;
  const double* kk = k + (int64_t)rp * N;
  long long e = 0;
  bool big = false;
  for (int j = threadIdx.x; j < N; j += kThreads) {
    const int64_t acc =
        65536LL * yh[j] + 256LL * ((int64_t)yh[N8 + j] + yl[j]) + yl[N8 + j] + c[j] + rs;
    const double yy = __dmul_rn(__dsub_rn(static_cast<double>(acc), mu[j]), kk[j]);
    double qq = rint(yy);
    if (fabs(qq) > kXMax) {
      big = true;
      qq = clamp_abs(qq, kXMax);
    }
    const long long fine =
        static_cast<long long>(clamp_abs(rint(__dmul_rn(yy, 8.0)), (double)kEMax));
    e += fine * fine;
    q[(int64_t)row * N + j] = static_cast<int16_t>(qq);
  }
  e = block_sum(e);
  if (threadIdx.x == 0) energy[row] = e;
  if (big) flags[t] = 1;
}

__global__ void encode_symbols_kernel(PcaGeometry g, int t32, const int16_t* __restrict__ q,
                                      const uint8_t* __restrict__ exact,
                                      uint8_t* __restrict__ sym) {
  __shared__ uint8_t tile[32][33];  // [j][t]
  const int T = g.T, N = g.N(), rp = blockIdx.z, j0 = blockIdx.x * 32, t0 = blockIdx.y * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {  // read token t0 + i, values j0 + lane
    const int t = t0 + i, j = j0 + threadIdx.x;
    uint8_t s = 127;
    if (t < T && j < N && !exact[t]) {
      const int v = q[((int64_t)rp * T + t) * N + j];
      s = (v > 127 || v < -127) ? 255 : static_cast<uint8_t>(v + 127);
    }
    tile[threadIdx.x][i] = s;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {  // write value j0 + i, tokens t0 + lane
    const int j = j0 + i;
    if (j < N) sym[((int64_t)rp * N + j) * t32 + t0 + threadIdx.x] = tile[i][threadIdx.x];
  }
}

// S = int16_t: coefficients qt [R][2][N][T] (escapes filled in); S = uint8_t: the symbols sym
// [R][2][N][stride] themselves (value = symbol - kSymOffset; a chunk without escapes), escape
// symbols counted into esc_count.
template <typename S>
__global__ void decode_pre_kernel(PcaGeometry g, const S* __restrict__ qt, int32_t stride,
                                  int8_t* __restrict__ lo, int64_t* __restrict__ rowsum,
                                  int32_t* __restrict__ esc_count) {
  __shared__ int8_t tile[32][33];  // [j][t]
  const int T = g.T, N = g.N(), N8 = g.N8(), rp = blockIdx.z, j0 = blockIdx.x * 32,
            t0 = blockIdx.y * 32;
  int escapes = 0;
  for (int i = threadIdx.y; i < 32; i += 8) {  // read value j0 + i, tokens t0 + lane
    const int j = j0 + i, t = t0 + threadIdx.x;
    int8_t v = 0;
    if (j < N && t < T) {
      int q = qt[((int64_t)rp * N + j) * stride + t];
      if constexpr (std::is_same_v<S, uint8_t>) {
        escapes += q == kSymEscape;
        q -= kSymOffset;
      }
      v = static_cast<int8_t>(((q + 128) & 255) - 128);
    }
    tile[i][threadIdx.x] = v;
  }
  if constexpr (std::is_same_v<S, uint8_t>) {
    for (int o = 16; o > 0; o >>= 1) escapes += __shfl_xor_sync(kFull, escapes, o);
    if (threadIdx.x == 0 && escapes != 0) atomicAdd(esc_count, escapes);
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {  // write token t0 + i, values j0 + lane
    const int t = t0 + i, j = j0 + threadIdx.x;
    int v = tile[threadIdx.x][i];
    if (t < T && j < N8) lo[((int64_t)rp * T + t) * N8 + j] = static_cast<int8_t>(v);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    if (threadIdx.x == 0 && t < T && v != 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(rowsum + (int64_t)rp * T + t),
                static_cast<unsigned long long>(static_cast<long long>(v)));
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    decode_post_kernel(PcaGeometry g, const int32_t* __restrict__ y,
                       const int64_t* __restrict__ rowsum, const int32_t* __restrict__ esc_row,
                       const int32_t* __restrict__ esc_col, const int32_t* __restrict__ esc_hi,
                       const int8_t* __restrict__ dcat, const double* __restrict__ f,
                       const double* __restrict__ mu, const double* __restrict__ cos_t,
                       const double* __restrict__ sin_t, uint16_t* __restrict__ out) {
  extern __shared__ double xrow[];
  const int T = g.T, D = g.D, N = g.N(), N8 = g.N8(), half = D / 2;
  const int row = blockIdx.x, t = row % T, rp = row / T, p = rp % 2, r = rp / 2;
  const int32_t* yr = y + (int64_t)row * 2 * N8;  // [lo8 @ dh | lo8 @ dl]
  const int64_t rs = 128 * rowsum[row];           // the 128 offset of the other operand's bytes
  const int e0 = esc_row[row], e1 = esc_row[row + 1];
  const int8_t* dc = dcat + (int64_t)rp * N8 * 2 * N8;
  for (int j = threadIdx.x; j < N; j += kThreads) {
    int64_t acc = 256LL * yr[j] + yr[N8 + j] + rs;
    for (int e = e0; e < e1; ++e) {  // escaped coefficients: 256 * hi8(q) * d_int[component, j]
      const int64_t c = esc_col[e];  // dcat is transposed: [hi | lo] column j at rows j, N8 + j
      acc += 256LL * esc_hi[e] *
             (256LL * dc[(int64_t)j * N8 + c] + dc[(int64_t)(N8 + j) * N8 + c] + 128);
    }
    xrow[j] = __dadd_rn(__dmul_rn(static_cast<double>(acc), f[(int64_t)rp * N + j]),
                        mu[(int64_t)rp * N + j]);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < N; j += kThreads) {
    double x = xrow[j];
    if (p == 0 && cos_t != nullptr) {  // RoPE redone: x * cos + rotate_half(x) * sin
      const int d = j % D;
      const double xp = xrow[j - d + (d < half ? d + half : d - half)];
      const double rot = d < half ? -xp : xp;
      x = __dadd_rn(__dmul_rn(x, cos_t[(int64_t)t * D + d]),
                    __dmul_rn(rot, sin_t[(int64_t)t * D + d]));
    }
    out[chunk_offset(g, r, p, t, j)] = narrow<DT == kBF16>(__double2float_rn(x));
  }
}

cudaStream_t as_stream(void* s) { return reinterpret_cast<cudaStream_t>(s); }

dim3 tiles(const PcaGeometry& g, int cols, int rows) {
  return dim3((cols + 31) / 32, (rows + 31) / 32, g.R() * 2);
}

// One CTA per (exact token e, layer and plane lp): H * D 16-bit values copied.
__global__ void scatter_exact_kernel(PcaGeometry g, const int64_t* __restrict__ idx,
                                     int32_t n_exact, const uint16_t* __restrict__ raw,
                                     uint16_t* __restrict__ out) {
  const int64_t e = blockIdx.x, lp = blockIdx.y, t = idx[e];
  if (t < 0 || t >= g.T) return;
  const int64_t hd = int64_t{g.H} * g.D;
  const uint16_t* src = raw + (lp * n_exact + e) * hd;
  uint16_t* dst = out + (lp * g.T + t) * hd;
  for (int64_t i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

void check_geometry(const PcaGeometry& g, bool rope) {
  LMTIER_CHECK_ARG(g.L > 0 && g.T > 0 && g.H > 0 && g.D > 0 && g.G > 0 && g.L % g.G == 0,
                   "pca: geometry L=", g.L, " T=", g.T, " H=", g.H, " D=", g.D, " G=", g.G,
                   " (G must divide L, all > 0)");
  LMTIER_CHECK_ARG((int64_t)g.G * g.H * g.D <= kMaxVector,
                   "pca: N = G*H*D = ", (long long)g.G * g.H * g.D, " exceeds ", kMaxVector);
  LMTIER_CHECK_ARG(!rope || g.D % 2 == 0, "pca: RoPE needs an even head size, got ", g.D);
}

void encode_pre(int32_t dtype, const PcaGeometry& g, const void* kv, const double* cos_t,
                const double* sin_t, const double* inv_x_scale, int8_t* xs, int64_t* rowsum,
                int32_t* flags, void* stream) {
  check_geometry(g, cos_t != nullptr);
  LMTIER_CHECK_ARG(dtype == kBF16 || dtype == kFP16, "pca: dtype ", dtype,
                   " is not bf16 (0) or fp16 (1)");
  const unsigned blocks = static_cast<unsigned>(g.R() * 2 * g.T);
  auto* src = static_cast<const uint16_t*>(kv);
  if (dtype == kBF16)
    encode_pre_kernel<kBF16><<<blocks, kThreads, 0, as_stream(stream)>>>(
        g, src, cos_t, sin_t, inv_x_scale, xs, rowsum, flags);
  else
    encode_pre_kernel<kFP16><<<blocks, kThreads, 0, as_stream(stream)>>>(
        g, src, cos_t, sin_t, inv_x_scale, xs, rowsum, flags);
  LMTIER_CUDA_CHECK_LAUNCH();
}

void encode_post(const PcaGeometry& g, const int32_t* y, const int64_t* col, const int64_t* rowsum,
                 const double* e_mu, const double* k, int16_t* q, int64_t* energy, int32_t* flags,
                 void* stream) {
  check_geometry(g, false);
  encode_post_kernel<<<g.R() * 2 * g.T, kThreads, 0, as_stream(stream)>>>(g, y, col, rowsum, e_mu,
                                                                          k, q, energy, flags);
  LMTIER_CUDA_CHECK_LAUNCH();
}

void encode_symbols(const PcaGeometry& g, int32_t t32, const int16_t* q, const uint8_t* exact,
                    uint8_t* sym, void* stream) {
  check_geometry(g, false);
  LMTIER_CHECK_ARG(t32 >= g.T && t32 % 32 == 0, "pca: t32=", t32, " must be T=", g.T,
                   " rounded up to 32");
  encode_symbols_kernel<<<tiles(g, g.N(), t32), dim3(32, 8), 0, as_stream(stream)>>>(g, t32, q,
                                                                                     exact, sym);
  LMTIER_CUDA_CHECK_LAUNCH();
}

void decode_pre(const PcaGeometry& g, const int16_t* qt, int8_t* lo, int64_t* rowsum,
                void* stream) {
  check_geometry(g, false);
  LMTIER_CUDA_CHECK(
      cudaMemsetAsync(rowsum, 0, sizeof(int64_t) * g.R() * 2 * g.T, as_stream(stream)));
  decode_pre_kernel<int16_t><<<tiles(g, g.N8(), g.T), dim3(32, 8), 0, as_stream(stream)>>>(
      g, qt, g.T, lo, rowsum, nullptr);
  LMTIER_CUDA_CHECK_LAUNCH();
}

void decode_pre_symbols(const PcaGeometry& g, const uint8_t* sym, int32_t stride, int8_t* lo,
                        int64_t* rowsum, int32_t* esc_count, void* stream) {
  check_geometry(g, false);
  LMTIER_CHECK_ARG(stride >= g.T, "pca: symbol row stride ", stride, " < T = ", g.T);
  LMTIER_CUDA_CHECK(
      cudaMemsetAsync(rowsum, 0, sizeof(int64_t) * g.R() * 2 * g.T, as_stream(stream)));
  decode_pre_kernel<uint8_t><<<tiles(g, g.N8(), g.T), dim3(32, 8), 0, as_stream(stream)>>>(
      g, sym, stride, lo, rowsum, esc_count);
  LMTIER_CUDA_CHECK_LAUNCH();
}

void decode_post(int32_t dtype, const PcaGeometry& g, const int32_t* y, const int64_t* rowsum,
                 const int32_t* esc_row, const int32_t* esc_col, const int32_t* esc_hi,
                 const int8_t* dcat, const double* f, const double* mu, const double* cos_t,
                 const double* sin_t, void* out, void* stream) {
  check_geometry(g, cos_t != nullptr);
  LMTIER_CHECK_ARG(dtype == kBF16 || dtype == kFP16, "pca: dtype ", dtype,
                   " is not bf16 (0) or fp16 (1)");
  const int smem = g.N() * static_cast<int>(sizeof(double));
  const unsigned blocks = static_cast<unsigned>(g.R() * 2 * g.T);
  auto* dst = static_cast<uint16_t*>(out);
  if (dtype == kBF16) {
    LMTIER_CUDA_CHECK(cudaFuncSetAttribute(decode_post_kernel<kBF16>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    decode_post_kernel<kBF16><<<blocks, kThreads, smem, as_stream(stream)>>>(
        g, y, rowsum, esc_row, esc_col, esc_hi, dcat, f, mu, cos_t, sin_t, dst);
  } else {
    LMTIER_CUDA_CHECK(cudaFuncSetAttribute(decode_post_kernel<kFP16>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    decode_post_kernel<kFP16><<<blocks, kThreads, smem, as_stream(stream)>>>(
        g, y, rowsum, esc_row, esc_col, esc_hi, dcat, f, mu, cos_t, sin_t, dst);
  }
  LMTIER_CUDA_CHECK_LAUNCH();
}

void scatter_exact_tokens(const PcaGeometry& g, const int64_t* idx, int32_t n_exact,
                          const void* raw, void* out, void* stream) {
  LMTIER_CHECK_ARG(n_exact >= 0 && n_exact <= g.T, "pca: ", n_exact, " exact tokens of T = ", g.T);
  if (n_exact == 0) return;
  const dim3 grid(static_cast<unsigned>(n_exact), static_cast<unsigned>(2 * g.L));
  scatter_exact_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(
      g, idx, n_exact, static_cast<const uint16_t*>(raw), static_cast<uint16_t*>(out));
  LMTIER_CUDA_CHECK_LAUNCH();
}

}  // namespace pca
}  // namespace lmtier
