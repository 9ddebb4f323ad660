// lmtier — CUDA gather/scatter between paged KV and canonical chunks: one launch per batch.
//
// Mapping: a group of G threads (G = min(32, next_pow2(units per row))) copies one row of
// head_size elements in `V`-sized units; a CTA of 256 threads covers 256 / G rows per step and
// walks the rows grid-stride. Rows are visited in canonical order, so canonical-side accesses are
// fully coalesced and each row's paged-side bytes are contiguous (or element-strided for
// vllm-cpu's transposed K). Index arithmetic is shared with the CPU path (paged_index.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "lmtier/common.h"
#include "lmtier/paged_copy.h"
#include "lmtier/paged_index.h"

namespace lmtier {
namespace {

constexpr int kThreads = 256;

template <typename V, bool kGather>
__global__ void __launch_bounds__(kThreads)
    paged_copy_kernel(const PagedKVDesc d, const ChunkBatch b, const int64_t total_rows,
                      const int32_t units_per_row, const int32_t group_log2,
                      int32_t* __restrict__ error_count) {
  const int32_t group = 1 << group_log2;
  const int32_t lane = threadIdx.x & (group - 1);
  const int64_t rows_per_cta = kThreads >> group_log2;
  const int64_t num_slots = d.num_blocks * d.block_size;
  const int64_t T = b.tokens_per_chunk;
  for (int64_t row = blockIdx.x * rows_per_cta + (threadIdx.x >> group_log2); row < total_rows;
       row += static_cast<int64_t>(gridDim.x) * rows_per_cta) {
    const RowCoord rc = decompose_row(row, d, T);
    const int64_t slot = b.slot_mapping[rc.chunk * T + rc.token];
    V* canon = reinterpret_cast<V*>(reinterpret_cast<uint8_t*>(b.chunk_ptrs[rc.chunk]) +
                                    canonical_row_offset_bytes(rc, d, T));
    if (slot < 0) {
      if (kGather)
        for (int32_t u = lane; u < units_per_row; u += group) canon[u] = V{};
      continue;
    }
    if (slot >= num_slots) {
      if (lane == 0 && error_count != nullptr) atomicAdd(error_count, 1);
      continue;
    }
    const PlaneStrides s = rc.plane == 0 ? d.planes[0] : d.planes[1];
    const uint8_t* base = reinterpret_cast<const uint8_t*>(d.layer_ptrs[rc.layer]);
    V* paged =
        reinterpret_cast<V*>(const_cast<uint8_t*>(base) + paged_row_offset_bytes(rc, slot, d));
    // channel stride in units of V: 1 for contiguous rows; for strided channels V == element.
    const int64_t ustride = s.channel;
#pragma unroll 4
    for (int32_t u = lane; u < units_per_row; u += group) {
      if (kGather)
        canon[u] = paged[u * ustride];
      else
        paged[u * ustride] = canon[u];
    }
  }
}

template <typename V>
void launch(CopyDirection dir, const PagedKVDesc& d, const ChunkBatch& b, int64_t total_rows,
            int32_t vec_bytes, int grid, int32_t* err, cudaStream_t stream) {
  const int32_t units =
      static_cast<int32_t>(static_cast<int64_t>(d.head_size) * d.elem_bytes / vec_bytes);
  int32_t g_log2 = 0;
  while ((1 << g_log2) < units && g_log2 < 5) ++g_log2;
  if (dir == CopyDirection::kGather)
    paged_copy_kernel<V, true><<<grid, kThreads, 0, stream>>>(d, b, total_rows, units, g_log2, err);
  else
    paged_copy_kernel<V, false>
        <<<grid, kThreads, 0, stream>>>(d, b, total_rows, units, g_log2, err);
  LMTIER_CUDA_CHECK_LAUNCH();
}

}  // namespace

void paged_copy_cuda(CopyDirection dir, const PagedKVDesc& d, const ChunkBatch& b,
                     int32_t vec_bytes, int32_t max_ctas, int32_t* error_count, void* stream_ptr) {
  validate_desc(d, b.tokens_per_chunk, vec_bytes);
  LMTIER_CHECK_ARG(b.num_chunks >= 0, "num_chunks must be >= 0, got ", b.num_chunks);
  if (b.num_chunks == 0 || b.tokens_per_chunk == 0) return;
  LMTIER_CHECK_ARG(b.slot_mapping != nullptr && b.chunk_ptrs != nullptr,
                   "slot_mapping / chunk_ptrs is null");
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t total_rows =
      b.num_chunks * d.num_layers * d.num_planes * b.tokens_per_chunk * d.num_heads;
  int device = 0, sms = 0;
  LMTIER_CUDA_CHECK(cudaGetDevice(&device));
  LMTIER_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t units = static_cast<int64_t>(d.head_size) * d.elem_bytes / vec_bytes;
  int64_t g = 1;
  while (g < units && g < 32) g <<= 1;
  const int64_t rows_per_cta = kThreads / g;
  int64_t grid = (total_rows + rows_per_cta - 1) / rows_per_cta;
  const int64_t cap = max_ctas > 0 ? max_ctas : static_cast<int64_t>(sms) * 8;
  grid = std::max<int64_t>(1, std::min(grid, cap));
  switch (vec_bytes) {
    case 16: launch<uint4>(dir, d, b, total_rows, vec_bytes, (int)grid, error_count, stream); break;
    case 8: launch<uint2>(dir, d, b, total_rows, vec_bytes, (int)grid, error_count, stream); break;
    case 4:
      launch<uint32_t>(dir, d, b, total_rows, vec_bytes, (int)grid, error_count, stream);
      break;
    case 2:
      launch<uint16_t>(dir, d, b, total_rows, vec_bytes, (int)grid, error_count, stream);
      break;
    default:
      launch<uint8_t>(dir, d, b, total_rows, vec_bytes, (int)grid, error_count, stream);
      break;
  }
}

}  // namespace lmtier
