// lmtier — the escaped coefficients of a PCA record on the device (decode_record's escape path; see
// decode_escapes in lmtier/pca.h), with no wait for the host: the same lo8 bytes, row sums and
// escape CSR as lmtier/codec/pca/kernels.py builds with torch after reading the escape count.
//
//   count (one warp per run (rp, j)): escape symbols per run and per row (rp, t)
//   -> scan (one CTA): run bases, the CSR's row offsets; a total other than the record's escape
//      count clears the CSR (the caller refuses the record: decode_pre_symbols counted the escapes)
//   -> fill (one warp per run): escape k of the run (stream order: runs in order, tokens in order)
//      takes escapes[base + k]: lo8 into lo, its difference from the escape symbol's lo8 into the
//      row sum, (j, hi8) into its row of the CSR (in any order: decode_post's sum is integer).
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "lmtier/common.h"
#include "lmtier/pca.h"

namespace lmtier {
namespace pca {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kWarpThreads = 256;
constexpr unsigned kAll = 0xFFFFFFFFu;

__device__ __forceinline__ int lo8(int q) { return ((q + 128) & 255) - 128; }

__global__ void esc_count_kernel(PcaGeometry g, const uint8_t* __restrict__ sym, int32_t stride,
                                 int32_t* __restrict__ run_cnt, int32_t* __restrict__ row_cnt) {
  const int64_t runs = 2LL * g.R() * g.N();
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t run = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; run < runs;
       run += warps) {
    const int64_t rp = run / g.N();
    const uint8_t* s = sym + run * stride;
    int c = 0;
    for (int t = lane; t < g.T; t += 32) {
      if (s[t] == kSymEscape) {
        ++c;
        atomicAdd(&row_cnt[rp * g.T + t], 1);
      }
    }
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(kAll, c, o);
    if (lane == 0) run_cnt[run] = c;
  }
}

// out[k] = a[0] + .. + a[k - 1] for k in [0, n], by one CTA (out may be a); returns the total.
__device__ int32_t block_exclusive_scan(const int32_t* a, int32_t* out, int64_t n) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int32_t total;
  const int64_t per = (n + kScanThreads - 1) / kScanThreads;
  const int64_t b = threadIdx.x * per, e = min(n, b + per);
  int32_t sum = 0;
  for (int64_t k = b; k < e; ++k) sum += a[k];
  int32_t prefix = 0, all = 0;
  Scan(tmp).ExclusiveSum(sum, prefix, all);
  for (int64_t k = b; k < e; ++k) {
    const int32_t v = a[k];
    out[k] = prefix;
    prefix += v;
  }
  if (threadIdx.x == 0) {
    out[n] = all;
    total = all;
  }
  __syncthreads();
  return total;
}

__global__ void __launch_bounds__(kScanThreads)
    esc_scan_kernel(PcaGeometry g, int32_t num_escapes, int32_t* __restrict__ run_cnt,
                    const int32_t* __restrict__ row_cnt, int32_t* __restrict__ esc_row,
                    int32_t* __restrict__ bad) {
  const int64_t runs = 2LL * g.R() * g.N(), rows = 2LL * g.R() * g.T;
  const int32_t by_run = block_exclusive_scan(run_cnt, run_cnt, runs);
  __syncthreads();
  const int32_t by_row = block_exclusive_scan(row_cnt, esc_row, rows);
  if (by_run != num_escapes || by_row != num_escapes) {  // decode_post then adds no escape term
    for (int64_t k = threadIdx.x; k <= rows; k += kScanThreads) esc_row[k] = 0;
    if (threadIdx.x == 0) *bad = 1;
  }
}

__global__ void esc_fill_kernel(PcaGeometry g, const uint8_t* __restrict__ sym, int32_t stride,
                                const int16_t* __restrict__ escapes,
                                const int32_t* __restrict__ run_base,
                                const int32_t* __restrict__ esc_row, int32_t* __restrict__ row_fill,
                                const int32_t* __restrict__ bad, int8_t* __restrict__ lo,
                                int64_t* __restrict__ rowsum, int32_t* __restrict__ esc_col,
                                int32_t* __restrict__ esc_hi) {
  if (*bad) return;
  const int64_t runs = 2LL * g.R() * g.N();
  const int N = g.N(), N8 = g.N8(), T = g.T, lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t run = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; run < runs;
       run += warps) {
    const int64_t rp = run / N;
    const int j = static_cast<int>(run % N);
    const uint8_t* s = sym + run * stride;
    int32_t rank = run_base[run];
    for (int t0 = 0; t0 < T; t0 += 32) {
      const int t = t0 + lane;
      const bool esc = t < T && s[t] == kSymEscape;
      const unsigned m = __ballot_sync(kAll, esc);
      if (esc) {
        const int q = escapes[rank + __popc(m & below)];
        const int l = lo8(q), hi = (q - l) >> 8;
        const int64_t row = rp * T + t;
        lo[row * N8 + j] = static_cast<int8_t>(l);
        // decode_pre_symbols added lo8(kSymEscape - kSymOffset) = lo8(128) = -128 for it
        atomicAdd(reinterpret_cast<unsigned long long*>(rowsum + row),
                  static_cast<unsigned long long>(static_cast<long long>(l + 128)));
        const int32_t at = esc_row[row] + atomicAdd(&row_fill[row], 1);
        esc_col[at] = j;
        esc_hi[at] = hi;
      }
      rank += __popc(m);
    }
  }
}

int warp_grid(int64_t runs) {
  const int64_t blocks = (runs * 32 + kWarpThreads - 1) / kWarpThreads;
  return static_cast<int>(blocks < 65535 ? blocks : 65535);
}

}  // namespace

size_t escape_scratch_bytes(const PcaGeometry& g) {
  const size_t runs = size_t{2} * g.R() * g.N(), rows = size_t{2} * g.R() * g.T;
  return sizeof(int32_t) * ((runs + 1) + rows + 1 + rows + 1);
}

void decode_escapes(const PcaGeometry& g, const uint8_t* sym, int32_t stride,
                    const int16_t* escapes, int32_t num_escapes, int8_t* lo, int64_t* rowsum,
                    int32_t* esc_row, int32_t* esc_col, int32_t* esc_hi, void* scratch,
                    void* stream) {
  check_geometry(g, false);
  LMTIER_CHECK_ARG(stride >= g.T && num_escapes > 0, "pca: decode_escapes: stride ", stride, ", T ",
                   g.T, ", escapes ", num_escapes);
  auto* st = static_cast<cudaStream_t>(stream);
  const int64_t runs = 2LL * g.R() * g.N(), rows = 2LL * g.R() * g.T;
  auto* run_cnt = static_cast<int32_t*>(scratch);  // [runs + 1]: counts, then bases
  int32_t* row_cnt = run_cnt + runs + 1;           // [rows]
  int32_t* bad = row_cnt + rows;                   // [1]
  int32_t* row_fill = bad + 1;                     // [rows + 1]
  LMTIER_CUDA_CHECK(cudaMemsetAsync(row_cnt, 0, sizeof(int32_t) * (2 * rows + 2), st));
  esc_count_kernel<<<warp_grid(runs), kWarpThreads, 0, st>>>(g, sym, stride, run_cnt, row_cnt);
  LMTIER_CUDA_CHECK_LAUNCH();
  esc_scan_kernel<<<1, kScanThreads, 0, st>>>(g, num_escapes, run_cnt, row_cnt, esc_row, bad);
  LMTIER_CUDA_CHECK_LAUNCH();
  esc_fill_kernel<<<warp_grid(runs), kWarpThreads, 0, st>>>(
      g, sym, stride, escapes, run_cnt, esc_row, row_fill, bad, lo, rowsum, esc_col, esc_hi);
  LMTIER_CUDA_CHECK_LAUNCH();
}

}  // namespace pca
}  // namespace lmtier
