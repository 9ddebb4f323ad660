// lmtier — CUDA rANS encoder/decoder, byte-identical to rans_cpu.cpp (format and rules: rans.h).
//
// Mapping: one warp codes one segment (its 32 lanes are the 32 interleaved rANS states, the state
// lives in a register); a CTA of kWarps warps takes a *tile* of kWarps consecutive segments of one
// stream, so the CTA shares one table in shared memory (decode: 4096 x uint32 slot entries; encode:
// 256 x uint2 with the Granlund-Montgomery reciprocal, so encoding needs no division). CTAs are
// persistent (grid = SMs x occupancy) and walk the tiles grid-stride; the table is rebuilt only
// when the tile's table changes. Symbols move through a 512-byte per-warp stage in shared memory,
// so the global loads (encode) and stores (decode) are 16 bytes per lane. Renormalization words are
// read and written as one contiguous run per warp-step (ballot + prefix popcount), i.e. coalesced.
// Table switching (a static table per run of R symbols, R a multiple of 32, so one per warp-step):
// each warp keeps its own table and rebuilds it whenever a step enters a new run (encode: the 256 x
// uint2 entries; decode: RunTables, the run's cdf and 128 buckets of 32 slots naming the symbol at
// each bucket's first slot, so a lane's symbol is that entry's or found by a binary search bounded
// by the next bucket's symbol: usually no search where the CPU decoder searches all 256 symbols);
// given run_luts (build_run_luts_cuda, rans.h), a decoding warp copies a run's RunTables instead
// of building them.
// A decoding warp walks its segment backwards and prefetches into L1 the payload words of its next
// 16 steps and, with table switching, the table of the run it enters next: each step waits for its
// words, so the decoder is latency-bound (few warps per SM when a call has few segments).
//
// Encode = 8 launches on the caller's stream, no host sync, no allocation:
//   validate the static tables (grid: one warp per 32 tables -> bitmap in scratch) ->
//   prep (1 CTA: validate, scan segments/tiles) -> code with static tables -> histogram the streams
//   that met a missing symbol -> normalize their tables -> re-code those streams -> scan sizes and
//   offsets (1 CTA) -> compact segments from fixed slots into the output.
// Decode = 3 launches: validate the static tables (bitmap) -> prep (1 CTA: validate headers, table
// ranges, scan tiles) -> decode. (The tables were once summed inside the 1-CTA prep kernels: 32 MB
// for 65,536 tables through one SM: ~4.5 ms per call by a fit of the 8- and 32-chunk bench_codec
// throughputs, most of a table-switching batch's time.)
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "lmtier/common.h"
#include "lmtier/rans.h"

namespace lmtier {
namespace rans {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kPrepThreads = 1024;
constexpr int kStage = 512;  // bytes per warp stage = 16 steps x 32 lanes
constexpr uint32_t kMissing = 0xFFFFFFFFu;
constexpr int kMaxTablesChecked = 65536;

// Table-switching decode: each warp keeps its run's table in shared memory (RunTables): cdf[0..256]
// and kRunBuckets + 1 bucket entries over the 4,096 slots, bucket[b] = s | (f_s - 1) << 8 | cdf[s]
// << 20 for the symbol s whose range [cdf[s], cdf[s + 1]) holds slot b * 32 (so cdf[s] <= 4064 and
// 1 <= f_s <= 4096: 12 bits each for cdf[s] and f_s - 1), and bucket[128] = kLastBucket (symbol
// 255, cdf[256] = 4095 + 1), the upper bound of the last bucket's search.
constexpr int kRunBucketsLog2 = 7;
constexpr int kRunBuckets = 1 << kRunBucketsLog2;             // 128 buckets of 32 slots
constexpr int kRunBucketShift = kProbBits - kRunBucketsLog2;  // bucket of a slot: slot >> 5
constexpr uint32_t kNoMark = 0xFFFFFFFFu;      // a bucket not yet filled (no entry: cdf <= 4064)
constexpr uint32_t kLastBucket = 0xFFF000FFu;  // symbol 255, f - 1 = 0, cdf 4095: its end is 4096
static_assert(kRunBuckets == 4 * 32, "warp_build_run fills 4 buckets per lane (one uint4)");
struct RunTables {
  uint32_t cdf[260];                 // cdf[0..256], padded to 16 bytes
  uint32_t bucket[kRunBuckets + 4];  // + kLastBucket, padded to 16 bytes
};
static_assert(sizeof(RunTables) % 16 == 0, "RunTables rows must stay 16-byte aligned");

struct EncGlobals {
  unsigned long long total_segments;
  unsigned long long total_tiles;
  unsigned long long total_bytes;
  int32_t error;
  int32_t pad[9];
};
static_assert(sizeof(EncGlobals) <= 64, "EncGlobals must fit the 64-byte globals slot");

struct DecodeWork {
  uint64_t tile_base;
  uint64_t payload_off;  // header + table + segment table bytes
  uint64_t avail;        // payload bytes available
  uint32_t n;
  uint32_t nseg;
  uint32_t num_tiles;
  uint16_t table_id;
  uint8_t adaptive;
  uint8_t seg_log2;
  uint32_t seg_table_off;  // header + adaptive table bytes (<= 16 + 544)
  uint32_t run_len;        // table switching (0: one table)
};
static_assert(sizeof(DecodeWork) == 48,
              "DecodeWork must match StreamWork's size (decode_scratch_bytes)");

struct DecGlobals {
  unsigned long long total_tiles;
};

__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

__device__ __forceinline__ uint32_t ldg_u32(const uint8_t* p) {
  return __ldg(reinterpret_cast<const uint32_t*>(p));
}
__device__ __forceinline__ uint16_t ldg_u16(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}
// The frequencies of symbols 8 lane .. 8 lane + 7 of one table (256 x uint16), two per word, low
// half first: one 16-byte load when the table is 16-byte aligned (tables are 512 bytes apart, so a
// call's tables are all aligned or none; warp-uniform), else 8 loads.
__device__ __forceinline__ uint4 ldg_freq8(const uint16_t* __restrict__ table, int lane) {
  if ((reinterpret_cast<uintptr_t>(table) & 15) == 0)
    return __ldg(reinterpret_cast<const uint4*>(table) + lane);
  const unsigned short* p = reinterpret_cast<const unsigned short*>(table) + lane * 8;
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = __ldg(p + 2 * i) | (uint32_t{__ldg(p + 2 * i + 1)} << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// Brings the 128-byte line holding p (a valid global address) into L1: a hint, no register waits.
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.L1 [%0];" ::"l"(p));
}
// Frequency q of the 8 that ldg_freq8 loaded (q a constant once the caller's loop is unrolled).
__device__ __forceinline__ uint32_t freq_of(const uint4& v, int q) {
  const uint32_t w = q < 2 ? v.x : q < 4 ? v.y : q < 6 ? v.z : v.w;
  return (q & 1) ? w >> 16 : w & 0xFFFF;
}

// Validity bitmap of the static tables (in scratch, or tables_ok_cuda's of a whole array): bit t of
// ok_bits set when table t sums to 4096.
// One warp per bitmap word (32 tables), coalesced 64-byte loads; the grid covers the words of
// tables [0, nt) (a call's: nt = min(num_tables, 65,536); tables_ok_cuda's: all); the prep kernels
// read no other word.
__global__ void __launch_bounds__(kThreads)
    tables_ok_kernel(const uint16_t* __restrict__ tables, int64_t nt,
                     uint32_t* __restrict__ ok_bits) {
  const int lane = threadIdx.x & 31;
  const int64_t wd = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) >> 5;
  if (wd * 32 >= nt) return;  // warp-uniform
  uint32_t bits = 0;
  for (int k = 0; k < 32; ++k) {
    const int64_t t = wd * 32 + k;
    if (t >= nt) break;  // warp-uniform
    uint32_t sum = 0;
#pragma unroll
    for (int q = 0; q < 8; ++q) sum += __ldg(tables + t * 256 + q * 32 + lane);
    sum = __reduce_add_sync(0xFFFFFFFFu, sum);
    if (sum == kProbScale) bits |= 1u << k;
  }
  if (lane == 0) ok_bits[wd] = bits;
}
__device__ __forceinline__ bool table_ok(const uint32_t* ok_bits, int64_t num_tables, uint32_t id) {
  return id < num_tables && id < kMaxTablesChecked && ((ok_bits[id >> 5] >> (id & 31)) & 1);
}
// True when tables [lo, hi) all exist and are valid (hi <= num_tables checked by the caller too).
__device__ bool tables_range_ok(const uint32_t* ok_bits, int64_t num_tables, uint64_t lo,
                                uint64_t hi) {
  if (hi > static_cast<uint64_t>(num_tables) || hi > static_cast<uint64_t>(kMaxTablesChecked))
    return false;
  for (uint64_t t = lo; t < hi;) {
    const uint64_t e = min(hi, (t | 31) + 1);
    const uint32_t cnt = static_cast<uint32_t>(e - t);
    const uint32_t mask = (cnt == 32 ? 0xFFFFFFFFu : ((1u << cnt) - 1)) << (t & 31);
    if ((ok_bits[t >> 5] & mask) != mask) return false;
    t = e;
  }
  return true;
}
// status[0, n) = v (the "scratch too small" verdict of every stream, as the CPU encoder gives it).
__global__ void fill_status_kernel(int32_t* status, uint64_t n, int32_t v) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x)
    status[i] = v;
}

// The bits of tables [0, nt) (nt > kMaxTablesChecked only for tables_ok_cuda's whole arrays).
void launch_tables_ok(const uint16_t* tables, int64_t nt, uint32_t* ok_bits, cudaStream_t stream) {
  if (nt <= 0) return;
  const int64_t words = (nt + 31) / 32;
  const int64_t blocks = (words + kWarps - 1) / kWarps;
  LMTIER_CHECK_ARG(blocks <= 0x7FFFFFFF, "rans: ", nt, " tables");
  tables_ok_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(tables, nt, ok_bits);
  LMTIER_CUDA_CHECK_LAUNCH();
}

// Last index i in [0, n) with base(i) <= t (base nondecreasing, base(0) == 0).
template <typename Get>
__device__ __forceinline__ int64_t find_stream(int64_t n, uint64_t t, Get base) {
  int64_t lo = 0, hi = n;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (base(mid) <= t)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Inclusive prefix sum of v over the warp's lanes 0 .. lane (all 32 lanes call it).
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t u = __shfl_up_sync(0xFFFFFFFFu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// Warp 0 computes cdf[0..256] from freq[256] (shared). Caller syncs.
__device__ __forceinline__ void warp_cdf(const uint32_t* freq, uint32_t* cdf) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  uint32_t local[8];
  uint32_t sum = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    local[k] = sum;
    sum += freq[lane * 8 + k];
  }
  const uint32_t incl = warp_inclusive_sum(sum, lane);
  const uint32_t excl = incl - sum;
#pragma unroll
  for (int k = 0; k < 8; ++k) cdf[lane * 8 + k] = excl + local[k];
  if (lane == 31) cdf[256] = incl;
}

// ------------------------------------------------------------------------------------------------
// Encode

__global__ void __launch_bounds__(kPrepThreads)
    enc_prep_kernel(const RansEncodeDesc* __restrict__ descs, int64_t N,
                    const uint32_t* __restrict__ ok_bits, int64_t num_tables, int seg_log2,
                    StreamWork* __restrict__ work, EncGlobals* gl, uint64_t max_segments,
                    int32_t* __restrict__ status) {
  using Scan = cub::BlockScan<unsigned long long, kPrepThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ unsigned long long carry_seg, carry_tile;
  __shared__ int any_err;
  if (threadIdx.x == 0) {
    carry_seg = 0;
    carry_tile = 0;
    any_err = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < N; base += kPrepThreads) {
    const int64_t i = base + threadIdx.x;
    unsigned long long nseg = 0, tiles = 0;
    if (i < N) {
      const RansEncodeDesc d = descs[i];
      int32_t st = kOk;
      if (d.num_symbols > kMaxStreamSymbols)
        st = kErrTooLong;
      else if ((d.num_symbols > 0 && d.src == 0) || !run_len_valid(d.run_len))
        st = kErrBadHeader;
      else if (d.table_id != kAdaptiveTable && d.run_len != 0 && d.num_symbols > 0) {
        const uint64_t runs = run_count(d.num_symbols, d.run_len);
        if (!tables_range_ok(ok_bits, num_tables, d.table_id, d.table_id + runs)) st = kErrBadTable;
      } else if (d.table_id != kAdaptiveTable && !table_ok(ok_bits, num_tables, d.table_id))
        st = kErrBadTable;
      if (st == kOk) {
        nseg = seg_count(d.num_symbols, seg_log2);
        tiles = (nseg + kWarps - 1) / kWarps;
      } else {
        any_err = 1;
      }
      status[i] = st;
      StreamWork& w = work[i];
      w.num_segments = static_cast<uint32_t>(nseg);
      w.num_tiles = static_cast<uint32_t>(tiles);
      w.table_bytes = 0;
      w.status = st;
      w.needs_adaptive = (d.table_id == kAdaptiveTable && d.num_symbols > 0) ? 1u : 0u;
      w.reserved = 0;
      w.out_offset = 0;
    }
    unsigned long long seg_excl, tile_excl, seg_sum, tile_sum;
    Scan(tmp).ExclusiveSum(nseg, seg_excl, seg_sum);
    __syncthreads();
    Scan(tmp).ExclusiveSum(tiles, tile_excl, tile_sum);
    if (i < N) {
      work[i].seg_base = carry_seg + seg_excl;
      work[i].tile_base = carry_tile + tile_excl;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry_seg += seg_sum;
      carry_tile += tile_sum;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    gl->total_segments = carry_seg;
    gl->total_tiles = carry_tile;
    gl->total_bytes = 0;
    gl->error = carry_seg > max_segments ? kErrScratch : (any_err ? -1 : 0);
  }
}

// Builds the encode table of one CTA: enc[s] = {f | sh1 << 13 | cdf << 16 | sh2 << 28, magic}.
__device__ void build_enc_table(const uint16_t* __restrict__ freq_g, uint32_t* freq_s,
                                uint32_t* cdf_s, uint2* enc) {
  for (int s = threadIdx.x; s < 256; s += blockDim.x) freq_s[s] = freq_g[s];
  __syncthreads();
  warp_cdf(freq_s, cdf_s);
  __syncthreads();
  for (int s = threadIdx.x; s < 256; s += blockDim.x) {
    const uint32_t f = freq_s[s];
    uint2 e;
    if (f == 0) {
      e.x = 0;
      e.y = 0;
    } else {
      const DivMagic m = div_magic(f);
      e.x = f | (m.sh1 << 13) | (cdf_s[s] << 16) | (m.sh2 << 28);
      e.y = m.mul;
    }
    enc[s] = e;
  }
  __syncthreads();
}

// div_magic(f) for every frequency 1 .. 4096, computed at compile time (same arithmetic as
// div_magic in rans.h; test_gpu_rans.py checks the streams byte for byte): table-switching streams
// rebuild their encode table every run, and a lookup is much cheaper than div_magic's loop and
// 64-bit division. mul[f] = DivMagic::mul, sh[f] = sh1 | sh2 << 1.
struct MagicTable {
  uint32_t mul[kProbScale + 1];
  uint8_t sh[kProbScale + 1];
};
constexpr MagicTable make_magic_table() {
  MagicTable t{};
  for (uint32_t d = 1; d <= kProbScale; ++d) {
    uint32_t l = 0;
    while ((1u << l) < d) ++l;
    t.mul[d] = static_cast<uint32_t>(((1ull << 32) * ((1ull << l) - d)) / d + 1);
    t.sh[d] = static_cast<uint8_t>((l < 1 ? l : 1) | ((l > 1 ? l - 1 : 0) << 1));
  }
  return t;
}
__device__ const MagicTable kMagicTable = make_magic_table();

// One warp builds the encode table of one static table into its own shared enc[256] (the entries of
// build_enc_table). Table switching streams rebuild it whenever a step enters a new run.
__device__ __forceinline__ void warp_build_enc(const uint16_t* __restrict__ freq_g, uint2* enc,
                                               int lane) {
  uint32_t f[8];
  uint32_t sum = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    f[k] = __ldg(reinterpret_cast<const unsigned short*>(freq_g) + lane * 8 + k);
    sum += f[k];
  }
  uint32_t c = warp_inclusive_sum(sum, lane) - sum;
  __syncwarp();
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    uint2 e = make_uint2(0, 0);
    if (f[k] != 0 && f[k] <= kProbScale) {  // f > 4096 only in an invalid table (rejected by prep)
      const uint32_t sh = kMagicTable.sh[f[k]];
      e.x = f[k] | ((sh & 1) << 13) | (c << 16) | ((sh >> 1) << 28);
      e.y = kMagicTable.mul[f[k]];
    }
    enc[lane * 8 + k] = e;
    c += f[k];
  }
  __syncwarp();
}

// One warp encodes one segment (see encode_segment in rans_cpu.cpp: same steps, same result).
// Table switching (run_len > 0): enc is the warp's own table, rebuilt from tables + 256 * (table_id
// + (first + 32 k) / run_len) when step k enters a new run.
__device__ uint32_t encode_segment_warp(const uint8_t* __restrict__ src, uint32_t n, uint2* enc,
                                        uint8_t* __restrict__ slot, uint8_t* stage, int lane,
                                        const uint16_t* __restrict__ run_tables = nullptr,
                                        uint32_t run_len = 0, uint64_t first = 0) {
  uint32_t x = kStateLower;
  // Table switching: run of the current step and steps of it already coded (run_len and first are
  // multiples of 32, so a step never straddles two runs); no division per step.
  uint64_t run = run_len ? first / run_len : 0;
  uint32_t into = run_len ? static_cast<uint32_t>(first % run_len) / kLanes : 0;
  const uint32_t steps_per_run = run_len / kLanes;
  bool built = false;
  uint32_t pos = 0;
  uint16_t* words = reinterpret_cast<uint16_t*>(slot + kStateBytes);
  const uint32_t steps = (n + kLanes - 1) / kLanes;
  const uint32_t lt = lanemask_lt();
  for (uint32_t g = 0; g * 16 < steps; ++g) {
    const uint32_t base = g * kStage;
    const uint32_t len = min(static_cast<uint32_t>(kStage), n - base);
    __syncwarp();
    if (len == kStage && (reinterpret_cast<uintptr_t>(src + base) & 15) == 0) {
      reinterpret_cast<uint4*>(stage)[lane] =
          __ldg(reinterpret_cast<const uint4*>(src + base) + lane);
    } else {
      for (uint32_t b = lane; b < len; b += 32) stage[b] = __ldg(src + base + b);
    }
    __syncwarp();
    const uint32_t kend = min(16u, steps - g * 16);
    for (uint32_t kk = 0; kk < kend; ++kk) {
      const bool active = base + kk * 32 + lane < n;
      if (run_len) {  // warp-uniform
        if (into == steps_per_run) {
          ++run;
          into = 0;
          built = false;
        }
        if (!built) {
          warp_build_enc(run_tables + 256 * run, enc, lane);
          built = true;
        }
        ++into;
      }
      uint2 e = make_uint2(0, 0);
      if (active) e = enc[stage[kk * 32 + lane]];
      const uint32_t f = e.x & 0x1FFF;
      if (__any_sync(0xFFFFFFFFu, active && f == 0)) return kMissing;
      const bool emit = active && (x >> 20) >= f;  // x >= f * 2^20 (no overflow at f = 4096)
      const uint32_t m = __ballot_sync(0xFFFFFFFFu, emit);
      if (emit) {
        words[pos + __popc(m & lt)] = static_cast<uint16_t>(x);
        x >>= 16;
      }
      pos += __popc(m);
      if (active) {
        const uint32_t q = div_by_magic(x, e.y, (e.x >> 13) & 1, e.x >> 28);
        x = x + ((e.x >> 16) & 0xFFF) + q * (kProbScale - f);
      }
      if (kStateBytes + 2 * pos >= n) return n;
    }
  }
  reinterpret_cast<uint32_t*>(slot)[lane] = x;
  return kStateBytes + 2 * pos;
}

// kAdaptivePass = false: code every stream with its static table (skip streams already known to
// need their own table); true: code only the streams that need their own table.
template <bool kAdaptivePass>
__global__ void __launch_bounds__(kThreads)
    enc_segments_kernel(const RansEncodeDesc* __restrict__ descs, int64_t N,
                        const uint16_t* __restrict__ tables, int seg_log2, StreamWork* work,
                        const uint16_t* __restrict__ afreq, const EncGlobals* __restrict__ gl,
                        uint32_t* __restrict__ seg_size, uint8_t* slots, uint64_t slot_bytes) {
  __shared__ uint2 enc[256];
  __shared__ uint2 wenc[kWarps][256];  // per-warp tables of table-switching streams
  __shared__ uint32_t freq_s[256];
  __shared__ uint32_t cdf_s[257];
  __shared__ __align__(16) uint8_t stage[kWarps][kStage];
  __shared__ uint32_t s_flag;
  if (gl->error != 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint64_t total_tiles = gl->total_tiles;
  int64_t key = -1;
  for (uint64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const int64_t i = find_stream(N, t, [&](int64_t k) { return work[k].tile_base; });
    // The flag may flip while this pass runs (another CTA met a missing symbol): read it once per
    // tile and broadcast, so the table rebuild below stays CTA-uniform.
    __syncthreads();
    if (threadIdx.x == 0)
      s_flag = *reinterpret_cast<volatile const uint32_t*>(&work[i].needs_adaptive);
    __syncthreads();
    const uint32_t flagged = s_flag;
    if (kAdaptivePass ? flagged == 0 : flagged != 0) continue;
    const RansEncodeDesc d = descs[i];
    // Table switching: per-warp tables, no CTA table.
    const bool runs = !kAdaptivePass && d.run_len != 0;
    const int64_t newkey = runs            ? key
                           : kAdaptivePass ? (int64_t{1} << 32) + i
                                           : int64_t{d.table_id};
    if (newkey != key) {
      __syncthreads();
      build_enc_table(kAdaptivePass ? afreq + 256 * i : tables + 256ull * d.table_id, freq_s, cdf_s,
                      enc);
      key = newkey;
    }
    const uint64_t j = (t - work[i].tile_base) * kWarps + warp;
    if (j >= work[i].num_segments) continue;
    const uint64_t g = work[i].seg_base + j;
    const uint64_t first = j << seg_log2;
    const uint32_t n = static_cast<uint32_t>(min(uint64_t{1} << seg_log2, d.num_symbols - first));
    const uint32_t r =
        runs ? encode_segment_warp(reinterpret_cast<const uint8_t*>(d.src) + first, n, wenc[warp],
                                   slots + g * slot_bytes, stage[warp], lane,
                                   tables + 256ull * d.table_id, d.run_len, first)
             : encode_segment_warp(reinterpret_cast<const uint8_t*>(d.src) + first, n, enc,
                                   slots + g * slot_bytes, stage[warp], lane);
    if (lane == 0) {
      seg_size[g] = r;
      if (!kAdaptivePass && r == kMissing) atomicOr(&work[i].needs_adaptive, 1u);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    enc_hist_kernel(const RansEncodeDesc* __restrict__ descs, int64_t N, int seg_log2,
                    const StreamWork* work, const EncGlobals* __restrict__ gl,
                    uint32_t* __restrict__ hist) {
  __shared__ uint32_t h[256];
  if (gl->error != 0) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint64_t total_tiles = gl->total_tiles;
  for (uint64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const int64_t i = find_stream(N, t, [&](int64_t k) { return work[k].tile_base; });
    if (work[i].needs_adaptive == 0) continue;
    __syncthreads();
    for (int s = threadIdx.x; s < 256; s += blockDim.x) h[s] = 0;
    __syncthreads();
    const RansEncodeDesc d = descs[i];
    const uint64_t j = (t - work[i].tile_base) * kWarps + warp;
    if (j < work[i].num_segments) {
      const uint64_t first = j << seg_log2;
      const uint32_t n = static_cast<uint32_t>(min(uint64_t{1} << seg_log2, d.num_symbols - first));
      const uint8_t* src = reinterpret_cast<const uint8_t*>(d.src) + first;
      for (uint32_t b = lane; b < n; b += 32) atomicAdd(&h[__ldg(src + b)], 1u);
    }
    __syncthreads();
    for (int s = threadIdx.x; s < 256; s += blockDim.x)
      if (h[s]) atomicAdd(&hist[256 * i + s], h[s]);
  }
}

__global__ void enc_normalize_kernel(int64_t N, StreamWork* work, const EncGlobals* __restrict__ gl,
                                     const uint32_t* __restrict__ hist,
                                     uint16_t* __restrict__ afreq) {
  if (gl->error != 0) return;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N || work[i].needs_adaptive == 0) return;
  uint64_t c[256];
  for (int s = 0; s < 256; ++s) c[s] = hist[256 * i + s];
  uint16_t* f = afreq + 256 * i;
  normalize_counts(c, 0, f);
  uint32_t np = 0;
  for (int s = 0; s < 256; ++s) np += f[s] ? 1 : 0;
  work[i].table_bytes = adaptive_table_bytes(np);
}

__global__ void __launch_bounds__(kPrepThreads)
    enc_scan_kernel(int64_t N, StreamWork* work, EncGlobals* gl,
                    const uint32_t* __restrict__ seg_size,
                    unsigned long long* __restrict__ seg_start, uint64_t* __restrict__ offsets,
                    uint64_t out_bytes, int32_t* __restrict__ status) {
  using Scan = cub::BlockScan<unsigned long long, kPrepThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ unsigned long long carry;
  const int32_t err0 = gl->error;
  if (err0 != 0) {
    for (int64_t i = threadIdx.x; i <= N; i += blockDim.x) {
      offsets[i] = 0;
      if (i < N && err0 > 0) status[i] = err0;
    }
    return;
  }
  const unsigned long long total_seg = gl->total_segments;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (unsigned long long base = 0; base < total_seg; base += kPrepThreads) {
    const unsigned long long g = base + threadIdx.x;
    const unsigned long long v = g < total_seg ? round_up4(seg_size[g]) : 0;
    unsigned long long excl, sum;
    Scan(tmp).ExclusiveSum(v, excl, sum);
    if (g < total_seg) seg_start[g] = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  if (threadIdx.x == 0) seg_start[total_seg] = carry;
  __syncthreads();
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < N; base += kPrepThreads) {
    const int64_t i = base + threadIdx.x;
    unsigned long long bytes = 0;
    if (i < N) {
      const StreamWork& w = work[i];
      bytes = sizeof(RansStreamHeader) + w.table_bytes + 4ull * w.num_segments +
              (seg_start[w.seg_base + w.num_segments] - seg_start[w.seg_base]);
    }
    unsigned long long excl, sum;
    Scan(tmp).ExclusiveSum(bytes, excl, sum);
    if (i < N) {
      work[i].out_offset = carry + excl;
      offsets[i] = carry + excl;
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  if (carry > out_bytes) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i <= N; i += blockDim.x) {
      offsets[i] = 0;
      if (i < N) status[i] = kErrOutput;
    }
    if (threadIdx.x == 0) gl->error = kErrOutput;
    return;
  }
  if (threadIdx.x == 0) {
    offsets[N] = carry;
    gl->total_bytes = carry;
  }
}

__global__ void __launch_bounds__(kThreads)
    enc_compact_kernel(const RansEncodeDesc* __restrict__ descs, int64_t N, int seg_log2,
                       const StreamWork* __restrict__ work, const EncGlobals* __restrict__ gl,
                       const uint16_t* __restrict__ afreq, const uint32_t* __restrict__ seg_size,
                       const unsigned long long* __restrict__ seg_start,
                       const uint8_t* __restrict__ slots, uint64_t slot_bytes,
                       uint8_t* __restrict__ out) {
  if (gl->error != 0) return;
  // Headers (+ adaptive tables): one thread per stream.
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const StreamWork& w = work[i];
    uint8_t* p = out + w.out_offset;
    const bool adaptive = w.table_bytes != 0;
    uint32_t* h = reinterpret_cast<uint32_t*>(p);
    h[0] = kMagic;
    h[1] = kVersion | (uint32_t{adaptive ? kFlagAdaptive : 0u} << 8) | (uint32_t(seg_log2) << 16) |
           (uint32_t{kLanesLog2} << 24);
    h[2] = (descs[i].table_id & 0xFFFF) | (adaptive ? 0u : (descs[i].run_len / kLanes) << 16);
    h[3] = static_cast<uint32_t>(descs[i].num_symbols);
    if (adaptive) {
      const uint16_t* f = afreq + 256 * i;
      uint32_t* bm = reinterpret_cast<uint32_t*>(p + 16);
      uint32_t np = 0;
      for (int wd = 0; wd < 8; ++wd) {
        uint32_t bits = 0;
        for (int b = 0; b < 32; ++b) bits |= (f[wd * 32 + b] ? 1u : 0u) << b;
        bm[wd] = bits;
      }
      uint16_t* fq = reinterpret_cast<uint16_t*>(p + 16 + 32);
      for (int s = 0; s < 256; ++s)
        if (f[s]) fq[np++] = f[s];
      if (np & 1) fq[np] = 0;
    }
  }
  // Segments: one warp per segment, tiles grid-stride.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint64_t total_tiles = gl->total_tiles;
  for (uint64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const int64_t i = find_stream(N, t, [&](int64_t k) { return work[k].tile_base; });
    const StreamWork& w = work[i];
    const uint64_t j = (t - w.tile_base) * kWarps + warp;
    if (j >= w.num_segments) continue;
    const uint64_t g = w.seg_base + j;
    const uint64_t first = j << seg_log2;
    const uint32_t n =
        static_cast<uint32_t>(min(uint64_t{1} << seg_log2, descs[i].num_symbols - first));
    uint8_t* seg_tab = out + w.out_offset + sizeof(RansStreamHeader) + w.table_bytes;
    uint8_t* payload = seg_tab + 4ull * w.num_segments;
    const uint64_t start = seg_start[g] - seg_start[w.seg_base];
    const uint32_t size = seg_size[g];
    if (lane == 0) reinterpret_cast<uint32_t*>(seg_tab)[j] = static_cast<uint32_t>(start + size);
    uint32_t* dst = reinterpret_cast<uint32_t*>(payload + start);
    const uint32_t nw = static_cast<uint32_t>((size + 3) / 4);
    if (size != n) {
      const uint32_t* from = reinterpret_cast<const uint32_t*>(slots + g * slot_bytes);
      for (uint32_t k = lane; k < nw; k += 32) {
        uint32_t v = from[k];
        const uint32_t valid = size - 4 * k;  // bytes of this word inside the payload
        if (valid < 4) v &= (1u << (8 * valid)) - 1;
        dst[k] = v;
      }
    } else {
      const uint8_t* src = reinterpret_cast<const uint8_t*>(descs[i].src) + first;
      if ((reinterpret_cast<uintptr_t>(src) & 3) == 0) {
        for (uint32_t k = lane; k < nw; k += 32) {
          uint32_t v;
          const uint32_t valid = size - 4 * k;
          if (valid >= 4) {
            v = __ldg(reinterpret_cast<const uint32_t*>(src) + k);
          } else {
            v = 0;
            for (uint32_t b = 0; b < valid; ++b) v |= uint32_t{__ldg(src + 4 * k + b)} << (8 * b);
          }
          dst[k] = v;
        }
      } else {
        uint8_t* d8 = payload + start;
        for (uint32_t b = lane; b < 4 * nw; b += 32) d8[b] = b < size ? __ldg(src + b) : 0;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Decode

__global__ void __launch_bounds__(kPrepThreads)
    dec_prep_kernel(const RansDecodeDesc* __restrict__ descs, int64_t N,
                    const uint32_t* __restrict__ ok_bits, int64_t num_tables,
                    DecodeWork* __restrict__ work, DecGlobals* gl,
                    uint64_t* __restrict__ out_lengths, int32_t* __restrict__ status) {
  using Scan = cub::BlockScan<unsigned long long, kPrepThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ unsigned long long carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < N; base += kPrepThreads) {
    const int64_t i = base + threadIdx.x;
    unsigned long long tiles = 0;
    if (i < N) {
      const RansDecodeDesc d = descs[i];
      DecodeWork w{};
      int32_t st = kOk;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(d.src);
      if (d.src & 3)
        st = kErrMisaligned;
      else if (d.src == 0 || d.src_bytes < sizeof(RansStreamHeader))
        st = kErrTruncated;
      uint32_t n = 0;
      uint64_t off = sizeof(RansStreamHeader), nseg = 0;
      int seg_log2 = 0;
      if (st == kOk) {
        const uint32_t h0 = ldg_u32(src), h1 = ldg_u32(src + 4), h2 = ldg_u32(src + 8);
        n = ldg_u32(src + 12);
        const uint32_t version = h1 & 0xFF, flags = (h1 >> 8) & 0xFF, lanes = h1 >> 24;
        seg_log2 = (h1 >> 16) & 0xFF;
        if (h0 != kMagic || version != kVersion || (flags & ~uint32_t{kFlagAdaptive}) != 0 ||
            seg_log2 < kMinSegLog2 || seg_log2 > kMaxSegLog2 || lanes != kLanesLog2 ||
            ((flags & kFlagAdaptive) && (h2 >> 16) != 0) || n > kMaxStreamSymbols) {
          st = kErrBadHeader;
        } else if (n > d.dst_capacity || (n > 0 && d.dst == 0)) {
          st = kErrCapacity;
        } else {
          w.table_id = static_cast<uint16_t>(h2 & 0xFFFF);
          w.adaptive = static_cast<uint8_t>(flags & kFlagAdaptive);
          if (w.adaptive) {
            if (off + 32 > d.src_bytes) {
              st = kErrTruncated;
            } else {
              uint32_t np = 0;
              for (int b = 0; b < 8; ++b) np += __popc(ldg_u32(src + off + 4 * b));
              const uint64_t tb = adaptive_table_bytes(np);
              if (off + tb > d.src_bytes) {
                st = kErrTruncated;
              } else {
                uint32_t sum = 0;
                for (uint32_t k = 0; k < np; ++k) {
                  const uint32_t f = ldg_u16(src + off + 32 + 2 * k);
                  if (f == 0) st = kErrBadTable;
                  sum += f;
                }
                if (sum != kProbScale) st = kErrBadTable;
                off += tb;
              }
            }
          } else if (n > 0 && (h2 >> 16) != 0) {
            w.run_len = 32u * (h2 >> 16);
            const uint64_t runs = run_count(n, w.run_len);
            if (!tables_range_ok(ok_bits, num_tables, w.table_id, w.table_id + runs))
              st = kErrBadTable;
          } else if (n > 0 && !table_ok(ok_bits, num_tables, w.table_id)) {
            st = kErrBadTable;
          }
          if (st == kOk) {
            nseg = seg_count(n, seg_log2);
            if (off + 4 * nseg > d.src_bytes) st = kErrTruncated;
          }
        }
      }
      if (st == kOk) {
        w.n = n;
        w.nseg = static_cast<uint32_t>(nseg);
        w.num_tiles = static_cast<uint32_t>((nseg + kWarps - 1) / kWarps);
        w.seg_log2 = static_cast<uint8_t>(seg_log2);
        w.seg_table_off = static_cast<uint32_t>(off);
        w.payload_off = off + 4 * nseg;
        w.avail = d.src_bytes - w.payload_off;
        tiles = w.num_tiles;
      } else {
        w = DecodeWork{};
      }
      status[i] = st;
      out_lengths[i] = st == kOk ? n : 0;
      work[i] = w;
    }
    unsigned long long excl, sum;
    Scan(tmp).ExclusiveSum(tiles, excl, sum);
    if (i < N) work[i].tile_base = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  if (threadIdx.x == 0) gl->total_tiles = carry;
}

// Builds the decode table: dec[slot] = sym | (f - 1) << 8 | (slot - cdf) << 20.
__device__ void build_dec_table(const uint8_t* __restrict__ src, const DecodeWork& w,
                                const uint16_t* __restrict__ tables, uint32_t* freq_s,
                                uint32_t* cdf_s, uint32_t* dec) {
  if (w.adaptive) {
    const uint8_t* bm = src + sizeof(RansStreamHeader);
    for (int s = threadIdx.x; s < 256; s += blockDim.x) {
      uint32_t idx = 0;
      for (int b = 0; b < (s >> 5); ++b) idx += __popc(ldg_u32(bm + 4 * b));
      const uint32_t word = ldg_u32(bm + 4 * (s >> 5));
      idx += __popc(word & ((1u << (s & 31)) - 1));
      freq_s[s] = ((word >> (s & 31)) & 1) ? ldg_u16(bm + 32 + 2 * idx) : 0;
    }
  } else {
    for (int s = threadIdx.x; s < 256; s += blockDim.x) freq_s[s] = tables[256ull * w.table_id + s];
  }
  __syncthreads();
  warp_cdf(freq_s, cdf_s);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int s = warp; s < 256; s += kWarps) {
    const uint32_t f = freq_s[s], c = cdf_s[s];
    for (uint32_t j = lane; j < f; j += 32) dec[c + j] = uint32_t(s) | ((f - 1) << 8) | (j << 20);
  }
  __syncthreads();
}

// One warp decodes one coded segment (size validated by the caller). Returns a RansStatus.
__device__ int32_t decode_segment_warp(const uint8_t* __restrict__ payload, uint32_t size,
                                       uint32_t n, const uint32_t* dec, uint8_t* __restrict__ dst,
                                       uint8_t* stage, int lane) {
  uint32_t x = ldg_u32(payload + 4 * lane);
  if (__any_sync(0xFFFFFFFFu, x < kStateLower)) return kErrCorrupt;
  const uint8_t* words = payload + kStateBytes;
  uint32_t pos = (size - kStateBytes) / 2;
  const uint32_t steps = (n + kLanes - 1) / kLanes;
  const uint32_t groups = (steps + 15) / 16;
  const uint32_t lt = lanemask_lt();
  for (uint32_t g = groups; g-- > 0;) {
    const uint32_t kbeg = g * 16, kend = min(steps, kbeg + 16);
    // The words the group's 16 steps read (at most 512, just below pos): into L1 before the steps
    // need them (each step waits for its words), lane l the line of byte 2 pos - 1 - 128 l.
    if (lane <= 8 && 2 * pos > 128u * lane) prefetch_l1(words + 2 * pos - 1 - 128 * lane);
    for (uint32_t k = kend; k-- > kbeg;) {
      const bool active = k * 32 + lane < n;
      if (active) {
        const uint32_t e = dec[x & (kProbScale - 1)];
        stage[(k - kbeg) * 32 + lane] = static_cast<uint8_t>(e);
        x = (((e >> 8) & 0xFFF) + 1) * (x >> kProbBits) + (e >> 20);
      }
      const bool need = active && x < kStateLower;
      const uint32_t m = __ballot_sync(0xFFFFFFFFu, need);
      const uint32_t c = __popc(m);
      if (c > pos) return kErrCorrupt;
      if (need) x = (x << 16) | ldg_u16(words + 2 * (pos - c + __popc(m & lt)));
      pos -= c;
    }
    __syncwarp();
    const uint32_t base = g * kStage;
    const uint32_t len = min(static_cast<uint32_t>(kStage), n - base);
    if (len == kStage && (reinterpret_cast<uintptr_t>(dst + base) & 15) == 0) {
      reinterpret_cast<uint4*>(dst + base)[lane] = reinterpret_cast<const uint4*>(stage)[lane];
    } else {
      for (uint32_t b = lane; b < len; b += 32) dst[base + b] = stage[b];
    }
    __syncwarp();
  }
  if (__any_sync(0xFFFFFFFFu, pos != 0 || x != kStateLower)) return kErrCorrupt;
  return kOk;
}

// One warp builds its RunTables for one static table from this lane's frequencies fv (ldg_freq8,
// symbols 8 lane .. 8 lane + 7): the cdf by a warp scan, then the buckets in three steps between
// __syncwarp()s. Clear: every bucket kNoMark. Mark: each symbol s with f_s > 0 writes its entry
// into the first bucket b with b * 32 >= cdf[s] if s covers that boundary (b * 32 < cdf[s + 1]).
// Fill: an unmarked bucket's boundary lies in the range of the symbol of the nearest marked bucket
// below it, whose entry it takes (each lane fills buckets 4 lane .. 4 lane + 3, carrying in the
// last mark of the lanes below by ballot + shfl). For a valid table every boundary 0, 32, .., 4064
// lies in exactly one symbol's range, bucket 0 in the first symbol's with f > 0 (always marked).
__device__ __forceinline__ void warp_build_run(const uint4 fv, RunTables* rt, int lane) {
  uint32_t f[8], c[8];
  uint32_t sum = 0;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    f[q] = freq_of(fv, q);
    sum += f[q];
  }
  c[0] = warp_inclusive_sum(sum, lane) - sum;
#pragma unroll
  for (int q = 1; q < 8; ++q) c[q] = c[q - 1] + f[q - 1];
  __syncwarp();  // every lane is done with the previous run's tables
  uint4* cdf4 = reinterpret_cast<uint4*>(rt->cdf);
  uint4* bucket4 = reinterpret_cast<uint4*>(rt->bucket);
  cdf4[2 * lane] = make_uint4(c[0], c[1], c[2], c[3]);
  cdf4[2 * lane + 1] = make_uint4(c[4], c[5], c[6], c[7]);
  bucket4[lane] = make_uint4(kNoMark, kNoMark, kNoMark, kNoMark);
  __syncwarp();
  // Mark, in two rounds of 4 symbols: all 8 at once raised dec_kernel's registers on sm_90 and
  // sm_100 (from 56 to 63-72, below the 9 CTAs per SM that the non-switching path runs at).
  constexpr uint32_t kWidth = 1u << kRunBucketShift;
  uint32_t cq = c[0];  // cdf[8 lane + 4 h + q]
#pragma unroll 1
  for (uint32_t h = 0; h < 2; ++h) {
    const uint32_t lo = h ? fv.z : fv.x, hi = h ? fv.w : fv.y;
#pragma unroll
    for (uint32_t q = 0; q < 4; ++q) {
      const uint32_t fq = ((q < 2 ? lo : hi) >> (16 * (q & 1))) & 0xFFFF;
      const uint32_t b = (cq + kWidth - 1) >> kRunBucketShift;
      if (fq != 0 && b < kRunBuckets && b * kWidth < cq + fq)
        rt->bucket[b] =
            (static_cast<uint32_t>(lane) * 8 + h * 4 + q) | ((fq - 1) << 8) | (cq << 20);
      cq += fq;
    }
  }
  __syncwarp();
  const uint4 m = bucket4[lane];
  uint32_t v[4] = {m.x, m.y, m.z, m.w};
  uint32_t last = kNoMark;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (v[i] != kNoMark) last = v[i];
  const uint32_t below = __ballot_sync(0xFFFFFFFFu, last != kNoMark) & lanemask_lt();
  uint32_t carry = __shfl_sync(0xFFFFFFFFu, last, below ? 31 - __clz(below) : 0);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (v[i] == kNoMark)
      v[i] = carry;
    else
      carry = v[i];
  }
  bucket4[lane] = make_uint4(v[0], v[1], v[2], v[3]);
  __syncwarp();
}

// One warp copies the RunTables of one static table from its decode lookups (kRunLutBytes at lut:
// build_run_luts_kernel's image of warp_build_run's result, rans.h): the same cdf[0..255] and
// bucket[0..127]; cdf[256] and bucket[128] are set once per segment.
__device__ __forceinline__ void warp_load_run(const uint8_t* __restrict__ lut, RunTables* rt,
                                              int lane) {
  const uint4 b = __ldg(reinterpret_cast<const uint4*>(lut) + lane);
  const uint4 c = __ldg(reinterpret_cast<const uint4*>(lut + 512) + lane);
  __syncwarp();  // every lane is done with the previous run's tables
  reinterpret_cast<uint4*>(rt->bucket)[lane] = b;
  uint4* cdf4 = reinterpret_cast<uint4*>(rt->cdf);
  cdf4[2 * lane] = make_uint4(c.x & 0xFFFF, c.x >> 16, c.y & 0xFFFF, c.y >> 16);
  cdf4[2 * lane + 1] = make_uint4(c.z & 0xFFFF, c.z >> 16, c.w & 0xFFFF, c.w >> 16);
  __syncwarp();
}

// One warp per static table: warp_build_run, then its cdf[0..255] (as uint16) and bucket[0..127]
// out to the table's kRunLutBytes of luts (rans.h's layout).
__global__ void __launch_bounds__(kThreads)
    build_run_luts_kernel(const uint16_t* __restrict__ tables, int64_t num_tables,
                          uint8_t* __restrict__ luts) {
  __shared__ __align__(16) RunTables rts[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t{blockIdx.x} * kWarps + warp;
  if (t >= num_tables) return;  // warp-uniform; the kernel has no block-wide barrier
  RunTables* rt = &rts[warp];
  warp_build_run(ldg_freq8(tables + 256 * t, lane), rt, lane);
  uint8_t* out = luts + kRunLutBytes * t;
  reinterpret_cast<uint4*>(out)[lane] = reinterpret_cast<const uint4*>(rt->bucket)[lane];
  const uint4* c4 = reinterpret_cast<const uint4*>(rt->cdf);
  const uint4 a = c4[2 * lane], b = c4[2 * lane + 1];
  auto pack = [](uint32_t lo, uint32_t hi) { return (lo & 0xFFFF) | (hi & 0xFFFF) << 16; };
  reinterpret_cast<uint4*>(out + 512)[lane] =
      make_uint4(pack(a.x, a.y), pack(a.z, a.w), pack(b.x, b.y), pack(b.z, b.w));
}

// One warp decodes one coded segment of a table-switching stream: step k uses static table
// run_tables + 256 * ((first + 32 k) / run_len) (warp-uniform); the warp rebuilds its RunTables
// when a step enters a new run and prefetches the table of the run after it (walking backwards: the
// previous one) into L1 then. A lane's symbol is the s with cdf[s] <= slot < cdf[s + 1], as
// decode_segment_runs in rans_cpu.cpp finds it by binary search (so the same output): bucket[slot
// >> 5]'s symbol if slot lies in its range, else a binary search over the symbols after it up to
// bucket[(slot >> 5) + 1]'s (whose range holds the next boundary, above slot), knowing cdf at both
// ends from the two entries. Tables validated by the prep kernel (each sums to 4096; with any other
// table the lookups still stay inside RunTables and end).
__device__ int32_t decode_segment_warp_runs(const uint8_t* __restrict__ payload, uint32_t size,
                                            uint32_t n, const uint16_t* __restrict__ run_tables,
                                            const uint8_t* __restrict__ run_luts, uint32_t run_len,
                                            uint64_t first, RunTables* rt,
                                            uint8_t* __restrict__ dst, uint8_t* stage, int lane) {
  uint32_t x = ldg_u32(payload + 4 * lane);
  if (__any_sync(0xFFFFFFFFu, x < kStateLower)) return kErrCorrupt;
  const uint8_t* words = payload + kStateBytes;
  uint32_t pos = (size - kStateBytes) / 2;
  const uint32_t steps = (n + kLanes - 1) / kLanes;
  const uint32_t groups = (steps + 15) / 16;
  const uint32_t lt = lanemask_lt();
  // Run of the current step and its step index inside the run (walking backwards; run_len and first
  // are multiples of 32): no division per step.
  const uint64_t p_last = first + uint64_t{steps ? steps - 1 : 0} * kLanes;
  uint64_t run = p_last / run_len;
  uint32_t into = static_cast<uint32_t>(p_last % run_len) / kLanes;
  const uint32_t steps_per_run = run_len / kLanes;
  const uint64_t run_first = first / run_len;  // the segment's first run: no prefetch below it
  if (lane == 0) {  // the entries no build writes (this memory may have held another CTA table)
    rt->cdf[256] = kProbScale;
    rt->bucket[kRunBuckets] = kLastBucket;
  }
  bool built = false;
  for (uint32_t g = groups; g-- > 0;) {
    const uint32_t kbeg = g * 16, kend = min(steps, kbeg + 16);
    // The words the group's 16 steps read (at most 512, just below pos): into L1 before the steps
    // need them (each step waits for its words), lane l the line of byte 2 pos - 1 - 128 l.
    if (lane <= 8 && 2 * pos > 128u * lane) prefetch_l1(words + 2 * pos - 1 - 128 * lane);
    for (uint32_t k = kend; k-- > kbeg;) {
      if (!built) {                 // warp-uniform
        if (run_luts != nullptr) {  // the run's lookups, built once per table (build_run_luts)
          const uint8_t* lut = run_luts + kRunLutBytes * run;
          if (run > run_first && lane < static_cast<int>(kRunLutBytes / 128))
            prefetch_l1(lut - kRunLutBytes + 128 * lane);  // the next run's, 8 lines
          warp_load_run(lut, rt, lane);
        } else {
          const uint16_t* table = run_tables + 256 * run;
          if (run > run_first) prefetch_l1(table - 256 + lane * 8);  // the next build's table
          warp_build_run(ldg_freq8(table, lane), rt, lane);
        }
        built = true;
      }
      if (into == 0) {  // the next step (k - 1) starts the previous run
        --run;
        into = steps_per_run - 1;
        built = false;
      } else {
        --into;
      }
      const bool active = k * 32 + lane < n;
      if (active) {
        const uint32_t slot = x & (kProbScale - 1);
        const uint32_t e = rt->bucket[slot >> kRunBucketShift];
        const uint32_t en = rt->bucket[(slot >> kRunBucketShift) + 1];
        uint32_t s = e & 0xFF, c0 = e >> 20, f = ((e >> 8) & 0xFFF) + 1;
        // Past the bucket's first symbol (slot >= c0 always)? en < e never holds (the entries grow
        // with b, kLastBucket tops them): testing it too makes the branch wait for both loads, so
        // they go out together and the search below starts without another round trip.
        if ((slot - c0 >= f) | (en < e)) {
          uint32_t lo = s + 1, hi = (en & 0xFF) + 1;                          // answer in [lo, hi)
          uint32_t clo = c0 + f, chi = (en >> 20) + ((en >> 8) & 0xFFF) + 1;  // cdf[lo], cdf[hi]
          while (lo + 1 < hi) {
            const uint32_t mid = (lo + hi) >> 1;
            const uint32_t cm = rt->cdf[mid];
            if (cm <= slot) {
              lo = mid;
              clo = cm;
            } else {
              hi = mid;
              chi = cm;
            }
          }
          s = lo;
          c0 = clo;
          f = chi - clo;
        }
        stage[(k - kbeg) * 32 + lane] = static_cast<uint8_t>(s);
        x = f * (x >> kProbBits) + slot - c0;
      }
      const bool need = active && x < kStateLower;
      const uint32_t m = __ballot_sync(0xFFFFFFFFu, need);
      const uint32_t c = __popc(m);
      if (c > pos) return kErrCorrupt;
      if (need) x = (x << 16) | ldg_u16(words + 2 * (pos - c + __popc(m & lt)));
      pos -= c;
    }
    __syncwarp();
    const uint32_t base = g * kStage;
    const uint32_t len = min(static_cast<uint32_t>(kStage), n - base);
    if (len == kStage && (reinterpret_cast<uintptr_t>(dst + base) & 15) == 0) {
      reinterpret_cast<uint4*>(dst + base)[lane] = reinterpret_cast<const uint4*>(stage)[lane];
    } else {
      for (uint32_t b = lane; b < len; b += 32) dst[base + b] = stage[b];
    }
    __syncwarp();
  }
  if (__any_sync(0xFFFFFFFFu, pos != 0 || x != kStateLower)) return kErrCorrupt;
  return kOk;
}

__global__ void __launch_bounds__(kThreads)
    dec_kernel(const RansDecodeDesc* __restrict__ descs, int64_t N,
               const uint16_t* __restrict__ tables, const uint8_t* __restrict__ run_luts,
               const DecodeWork* __restrict__ work, const DecGlobals* __restrict__ gl,
               int32_t* __restrict__ status) {
  __shared__ uint32_t dec[kProbScale];
  // build_dec_table's inputs or the warps' run tables, never live at once: build_dec_table runs
  // between __syncthreads() on a tile of a stream without table switching, and a warp's RunTables
  // live inside one decode_segment_warp_runs call (which sets them up). Sharing them keeps the
  // kernel at 9 CTAs per SM on sm_90 / sm_100 (24.7 KB of shared memory, 56 registers).
  __shared__ __align__(16) union {
    struct {
      uint32_t freq[256];
      uint32_t cdf[257];
    } tab;
    RunTables run[kWarps];
  } sm;
  __shared__ __align__(16) uint8_t stage[kWarps][kStage];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint64_t total_tiles = gl->total_tiles;
  int64_t key = -1;
  for (uint64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const int64_t i = find_stream(N, t, [&](int64_t k) { return work[k].tile_base; });
    const DecodeWork w = work[i];
    const RansDecodeDesc d = descs[i];
    const uint8_t* src = reinterpret_cast<const uint8_t*>(d.src);
    const int64_t newkey = w.run_len    ? key
                           : w.adaptive ? (int64_t{1} << 32) + i
                                        : int64_t{w.table_id};
    if (newkey != key) {
      __syncthreads();
      build_dec_table(src, w, tables, sm.tab.freq, sm.tab.cdf, dec);
      key = newkey;
    }
    const uint64_t j = (t - w.tile_base) * kWarps + warp;
    if (j >= w.nseg) continue;
    const uint64_t seg_len = uint64_t{1} << w.seg_log2;
    const uint32_t n = static_cast<uint32_t>(min(seg_len, uint64_t{w.n} - j * seg_len));
    const uint8_t* seg_tab = src + w.seg_table_off;
    const uint64_t start = j == 0 ? 0 : round_up4(ldg_u32(seg_tab + 4 * (j - 1)));
    const uint64_t end = ldg_u32(seg_tab + 4 * j);
    uint8_t* dst = reinterpret_cast<uint8_t*>(d.dst) + j * seg_len;
    const uint8_t* payload = src + w.payload_off + start;
    int32_t r = kOk;
    if (start > end || end > w.avail) {
      r = kErrBadSegment;
    } else {
      const uint64_t size = end - start;
      if (size == n) {
        if ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
          for (uint32_t k = lane; k < n / 4; k += 32)
            reinterpret_cast<uint32_t*>(dst)[k] =
                __ldg(reinterpret_cast<const uint32_t*>(payload) + k);
          for (uint32_t b = (n & ~3u) + lane; b < n; b += 32) dst[b] = __ldg(payload + b);
        } else {
          for (uint32_t b = lane; b < n; b += 32) dst[b] = __ldg(payload + b);
        }
      } else if (size < n && size >= kStateBytes && ((size - kStateBytes) & 1) == 0) {
        r = w.run_len ? decode_segment_warp_runs(
                            payload, static_cast<uint32_t>(size), n, tables + 256ull * w.table_id,
                            run_luts ? run_luts + kRunLutBytes * w.table_id : nullptr, w.run_len,
                            j * seg_len, &sm.run[warp], dst, stage[warp], lane)
                      : decode_segment_warp(payload, static_cast<uint32_t>(size), n, dec, dst,
                                            stage[warp], lane);
      } else {
        r = kErrBadSegment;
      }
    }
    if (r != kOk && lane == 0) atomicCAS(&status[i], kOk, r);
  }
}

int persistent_grid(const void* kernel, int threads, size_t smem) {
  int device = 0, sms = 0, per_sm = 0;
  LMTIER_CUDA_CHECK(cudaGetDevice(&device));
  LMTIER_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LMTIER_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return std::max(1, sms * std::max(1, per_sm));
}

}  // namespace

void encode_cuda(const RansEncodeDesc* descs, int64_t num_streams, const uint16_t* tables,
                 int64_t num_tables, int seg_log2, uint8_t* out, uint64_t out_bytes,
                 uint64_t* offsets, int32_t* status, void* scratch, uint64_t scratch_bytes,
                 void* stream_ptr) {
  LMTIER_CHECK_ARG(seg_log2 >= kMinSegLog2 && seg_log2 <= kMaxSegLog2,
                   "rans: seg_log2 must be in [", kMinSegLog2, ", ", kMaxSegLog2, "], got ",
                   seg_log2);
  LMTIER_CHECK_ARG(num_streams >= 0 && num_tables >= 0 && num_tables <= 0xFFFF,
                   "rans: bad num_streams / num_tables");
  LMTIER_CHECK_ARG(offsets != nullptr, "rans: offsets is null");
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const uint64_t N = static_cast<uint64_t>(num_streams);
  if (N == 0) {
    LMTIER_CUDA_CHECK(cudaMemsetAsync(offsets, 0, sizeof(uint64_t), stream));
    return;
  }
  LMTIER_CHECK_ARG(descs && status && scratch, "rans: null descs / status / scratch");
  LMTIER_CHECK_ARG((reinterpret_cast<uintptr_t>(out) & 3) == 0,
                   "rans: output buffer must be 4-byte aligned");
  const uint64_t cap = encode_scratch_capacity(N, scratch_bytes, seg_log2);
  const EncodeScratchLayout L = encode_scratch_layout(N, cap, seg_log2);
  if (L.total > scratch_bytes) {  // like encode_cpu: a data verdict per stream, offsets all 0
    LMTIER_CUDA_CHECK(cudaMemsetAsync(offsets, 0, (N + 1) * sizeof(uint64_t), stream));
    const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((N + 255) / 256, 1024));
    fill_status_kernel<<<blocks, 256, 0, stream>>>(status, N, kErrScratch);
    LMTIER_CUDA_CHECK_LAUNCH();
    return;
  }
  uint8_t* sc = static_cast<uint8_t*>(scratch);
  auto* work = reinterpret_cast<StreamWork*>(sc + L.streams);
  auto* hist = reinterpret_cast<uint32_t*>(sc + L.hist);
  auto* afreq = reinterpret_cast<uint16_t*>(sc + L.freq);
  auto* seg_size = reinterpret_cast<uint32_t*>(sc + L.seg_size);
  auto* seg_start = reinterpret_cast<unsigned long long*>(sc + L.seg_start);
  auto* gl = reinterpret_cast<EncGlobals*>(sc + L.globals);
  uint8_t* slots = sc + L.slots;

  LMTIER_CUDA_CHECK(cudaMemsetAsync(hist, 0, N * 256 * sizeof(uint32_t), stream));
  LMTIER_CUDA_CHECK(cudaMemsetAsync(afreq, 0, N * 256 * sizeof(uint16_t), stream));
  auto* ok_bits = reinterpret_cast<uint32_t*>(sc + L.tables_ok);
  launch_tables_ok(tables, std::min<int64_t>(num_tables, kMaxTablesChecked), ok_bits, stream);
  enc_prep_kernel<<<1, kPrepThreads, 0, stream>>>(descs, num_streams, ok_bits, num_tables, seg_log2,
                                                  work, gl, L.max_segments, status);
  LMTIER_CUDA_CHECK_LAUNCH();
  static const int grid_seg_static =
      persistent_grid(reinterpret_cast<const void*>(&enc_segments_kernel<false>), kThreads, 0);
  static const int grid_seg_adaptive =
      persistent_grid(reinterpret_cast<const void*>(&enc_segments_kernel<true>), kThreads, 0);
  static const int grid_hist =
      persistent_grid(reinterpret_cast<const void*>(&enc_hist_kernel), kThreads, 0);
  static const int grid_compact =
      persistent_grid(reinterpret_cast<const void*>(&enc_compact_kernel), kThreads, 0);
  enc_segments_kernel<false><<<grid_seg_static, kThreads, 0, stream>>>(
      descs, num_streams, tables, seg_log2, work, afreq, gl, seg_size, slots, L.slot_bytes);
  LMTIER_CUDA_CHECK_LAUNCH();
  enc_hist_kernel<<<grid_hist, kThreads, 0, stream>>>(descs, num_streams, seg_log2, work, gl, hist);
  LMTIER_CUDA_CHECK_LAUNCH();
  enc_normalize_kernel<<<static_cast<unsigned>((N + 127) / 128), 128, 0, stream>>>(
      num_streams, work, gl, hist, afreq);
  LMTIER_CUDA_CHECK_LAUNCH();
  enc_segments_kernel<true><<<grid_seg_adaptive, kThreads, 0, stream>>>(
      descs, num_streams, tables, seg_log2, work, afreq, gl, seg_size, slots, L.slot_bytes);
  LMTIER_CUDA_CHECK_LAUNCH();
  enc_scan_kernel<<<1, kPrepThreads, 0, stream>>>(num_streams, work, gl, seg_size, seg_start,
                                                  offsets, out == nullptr ? 0 : out_bytes, status);
  LMTIER_CUDA_CHECK_LAUNCH();
  enc_compact_kernel<<<grid_compact, kThreads, 0, stream>>>(
      descs, num_streams, seg_log2, work, gl, afreq, seg_size, seg_start, slots, L.slot_bytes, out);
  LMTIER_CUDA_CHECK_LAUNCH();
}

void decode_cuda(const RansDecodeDesc* descs, int64_t num_streams, const uint16_t* tables,
                 int64_t num_tables, const uint8_t* run_luts, const uint32_t* tables_ok,
                 uint64_t* out_lengths, int32_t* status, void* scratch, uint64_t scratch_bytes,
                 void* stream_ptr) {
  LMTIER_CHECK_ARG(num_streams >= 0 && num_tables >= 0, "rans: bad num_streams / num_tables");
  LMTIER_CHECK_ARG((reinterpret_cast<uintptr_t>(run_luts) & 15) == 0,
                   "rans: run_luts must be 16-byte aligned");
  if (num_streams == 0) return;
  LMTIER_CHECK_ARG(descs && out_lengths && status && scratch,
                   "rans: null descs / out_lengths / status / scratch");
  const uint64_t N = static_cast<uint64_t>(num_streams);
  LMTIER_CHECK_ARG(scratch_bytes >= decode_scratch_bytes(N), "rans: decode scratch of ",
                   scratch_bytes, " bytes, need ", decode_scratch_bytes(N));
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  auto* work = static_cast<DecodeWork*>(scratch);
  auto* gl = reinterpret_cast<DecGlobals*>(static_cast<uint8_t*>(scratch) +
                                           ((N * sizeof(DecodeWork) + 255) & ~255ull));
  const uint32_t* ok_bits = tables_ok;
  if (ok_bits == nullptr) {  // checked here, at each call
    auto* bits = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(scratch) +
                                             ((N * sizeof(DecodeWork) + 255) & ~255ull) + 256);
    launch_tables_ok(tables, std::min<int64_t>(num_tables, kMaxTablesChecked), bits, stream);
    ok_bits = bits;
  }
  dec_prep_kernel<<<1, kPrepThreads, 0, stream>>>(descs, num_streams, ok_bits, num_tables, work, gl,
                                                  out_lengths, status);
  LMTIER_CUDA_CHECK_LAUNCH();
  static const int grid = persistent_grid(reinterpret_cast<const void*>(&dec_kernel), kThreads, 0);
  dec_kernel<<<grid, kThreads, 0, stream>>>(descs, num_streams, tables, run_luts, work, gl, status);
  LMTIER_CUDA_CHECK_LAUNCH();
}

void tables_ok_cuda(const uint16_t* tables, int64_t num_tables, uint32_t* ok_bits,
                    void* stream_ptr) {
  LMTIER_CHECK_ARG(num_tables >= 0, "rans: num_tables must be >= 0, got ", num_tables);
  if (num_tables == 0) return;
  LMTIER_CHECK_ARG(tables != nullptr && ok_bits != nullptr, "rans: null tables / ok_bits");
  launch_tables_ok(tables, num_tables, ok_bits, static_cast<cudaStream_t>(stream_ptr));
}

void build_run_luts_cuda(const uint16_t* tables, int64_t num_tables, uint8_t* luts,
                         void* stream_ptr) {
  LMTIER_CHECK_ARG(num_tables >= 0, "rans: num_tables must be >= 0, got ", num_tables);
  if (num_tables == 0) return;
  LMTIER_CHECK_ARG(tables != nullptr && luts != nullptr, "rans: null tables / luts");
  LMTIER_CHECK_ARG((reinterpret_cast<uintptr_t>(luts) & 15) == 0,
                   "rans: luts must be 16-byte aligned");
  const uint64_t blocks = (static_cast<uint64_t>(num_tables) + kWarps - 1) / kWarps;
  LMTIER_CHECK_ARG(blocks <= 0x7FFFFFFFull, "rans: ", num_tables, " tables");
  build_run_luts_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                          static_cast<cudaStream_t>(stream_ptr)>>>(tables, num_tables, luts);
  LMTIER_CUDA_CHECK_LAUNCH();
}

}  // namespace rans
}  // namespace lmtier
