// lmtier — small runtime helpers: host allocations and copy-engine (DMA) copies.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lmtier {

// Number of usable CUDA devices; 0 in a CPU-only build or when no driver/device is present.
int cuda_device_count();

// True when this module was compiled with the CUDA kernels.
bool built_with_cuda();

// Page-aligned host allocation of exactly `nbytes` bytes. pinned=true: page-locked and mapped
// (cudaHostAlloc(Portable | Mapped)), needs a usable CUDA device; pinned=false: a fresh anonymous
// mmap of host_alloc_bytes(nbytes) (zero pages, none resident until first touched).
void* host_alloc(size_t nbytes, bool pinned);
// Bytes host_alloc maps for an unpinned request of `nbytes` (rounded up to 4 KiB pages).
size_t host_alloc_bytes(size_t nbytes);
// Frees what host_alloc(nbytes, pinned) returned; the same nbytes and pinned must be passed.
void host_free(void* ptr, size_t nbytes, bool pinned);

#ifdef LMTIER_WITH_CUDA
// cudaMemcpyAsync(cudaMemcpyDefault) on `stream`.
void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream);
// One cudaMemcpyBatchAsync of `count` copies (copy engines; stream-ordered source access).
// `stream` must not be the legacy default stream (the driver refuses it).
void memcpy_batch_async(void* const* dsts, const void* const* srcs, const size_t* sizes,
                        size_t count, void* stream);
#endif

}  // namespace lmtier
