// lmtier — multi-threaded CPU gather/scatter between paged KV and canonical chunks.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "lmtier/common.h"
#include "lmtier/paged_copy.h"
#include "lmtier/paged_index.h"

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
  for (int p = 0; p < d.num_planes; ++p) {
    const PlaneStrides& s = d.planes[p];
    LMTIER_CHECK_ARG(s.offset >= 0 && s.block >= 0 && s.head >= 0 && s.token >= 0 && s.channel > 0,
                     "plane ", p, " has a negative offset/stride or a non-positive channel stride");
  }
  LMTIER_CHECK_ARG(vec_bytes == 1 || vec_bytes == 2 || vec_bytes == 4 || vec_bytes == 8 ||
                       vec_bytes == 16,
                   "vec_bytes must be 1, 2, 4, 8 or 16, got ", vec_bytes);
  const int64_t row_bytes = static_cast<int64_t>(d.head_size) * d.elem_bytes;
  LMTIER_CHECK_ARG(row_bytes % vec_bytes == 0, "vec_bytes ", vec_bytes, " does not divide row bytes ",
                   row_bytes);
  for (int p = 0; p < d.num_planes; ++p)
    LMTIER_CHECK_ARG(d.planes[p].channel == 1 || vec_bytes == d.elem_bytes,
                     "plane ", p, " has strided channels; vec_bytes must equal elem_bytes");
}

namespace {

// Copies one row; `paged` is the row's channel-0 address in the cache.
inline void copy_row(CopyDirection dir, uint8_t* paged, uint8_t* canon, int64_t row_bytes,
                     int64_t channel_stride_bytes, int32_t elem_bytes, int32_t head_size) {
  if (channel_stride_bytes == elem_bytes) {
    if (dir == CopyDirection::kGather)
      std::memcpy(canon, paged, row_bytes);
    else
      std::memcpy(paged, canon, row_bytes);
    return;
  }
  for (int32_t c = 0; c < head_size; ++c) {
    uint8_t* p = paged + c * channel_stride_bytes;
    uint8_t* q = canon + static_cast<int64_t>(c) * elem_bytes;
    if (dir == CopyDirection::kGather)
      std::memcpy(q, p, elem_bytes);
    else
      std::memcpy(p, q, elem_bytes);
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
  for (int64_t c = 0; c < C; ++c) LMTIER_CHECK_ARG(b.chunk_ptrs[c] != 0, "chunk ", c, " pointer is null");

  const int64_t row_bytes = static_cast<int64_t>(d.head_size) * d.elem_bytes;
  const int64_t rows_per_plane = T * d.num_heads;
  const int64_t num_planes_total = C * d.num_layers * d.num_planes;  // (chunk, layer, plane) units
  const int64_t total_bytes = num_planes_total * rows_per_plane * row_bytes;

  auto work = [&](int64_t unit_begin, int64_t unit_end) {
    for (int64_t u = unit_begin; u < unit_end; ++u) {
      for (int64_t r = 0; r < rows_per_plane; ++r) {
        const int64_t row = u * rows_per_plane + r;
        const RowCoord rc = decompose_row(row, d, T);
        const int64_t slot = b.slot_mapping[rc.chunk * T + rc.token];
        uint8_t* canon = reinterpret_cast<uint8_t*>(b.chunk_ptrs[rc.chunk]) +
                         canonical_row_offset_bytes(rc, d, T);
        if (slot < 0) {
          if (dir == CopyDirection::kGather) std::memset(canon, 0, row_bytes);
          continue;
        }
        uint8_t* paged = reinterpret_cast<uint8_t*>(d.layer_ptrs[rc.layer]) +
                         paged_row_offset_bytes(rc, slot, d);
        copy_row(dir, paged, canon, row_bytes, d.planes[rc.plane].channel * d.elem_bytes,
                 d.elem_bytes, d.head_size);
      }
    }
  };

  int64_t nt = num_threads > 0 ? num_threads
                               : std::min<int64_t>(16, std::max(1u, std::thread::hardware_concurrency()));
  // Below ~1 MiB per thread, threads cost more than they save.
  nt = std::max<int64_t>(1, std::min<int64_t>({nt, num_planes_total, total_bytes / (1 << 20) + 1}));
  if (nt == 1) {
    work(0, num_planes_total);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(nt - 1);
  const int64_t per = (num_planes_total + nt - 1) / nt;
  for (int64_t t = 1; t < nt; ++t) {
    const int64_t lo = t * per, hi = std::min(num_planes_total, lo + per);
    if (lo >= hi) break;
    threads.emplace_back(work, lo, hi);
  }
  work(0, std::min(per, num_planes_total));
  for (auto& th : threads) th.join();
}

}  // namespace lmtier
