// lmtier — runtime helpers (host allocations, DMA copies). Compiled by the host compiler; the CUDA
// runtime is linked statically, so no libcuda is needed at build or import time.
#include "lmtier/runtime.h"

#include <sys/mman.h>

#include <cstdlib>
#include <vector>

#include "lmtier/common.h"

#ifdef LMTIER_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace lmtier {

bool built_with_cuda() {
#ifdef LMTIER_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef LMTIER_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

void* host_alloc(size_t nbytes, bool pinned) {
  LMTIER_CHECK_ARG(nbytes > 0, "host_alloc: nbytes must be > 0");
  void* p = nullptr;
  if (pinned) {
#ifdef LMTIER_WITH_CUDA
    LMTIER_CHECK_ARG(cuda_device_count() > 0, "host_alloc: pinned memory needs a CUDA device");
    LMTIER_CUDA_CHECK(cudaHostAlloc(&p, nbytes, cudaHostAllocPortable | cudaHostAllocMapped));
    return p;
#else
    LMTIER_CHECK_ARG(false, "host_alloc: pinned memory needs a CUDA build of lmtier");
#endif
  }
  // A fresh anonymous mapping, never memory recycled from malloc's free lists: its pages are
  // zero and untouched until first written, so a lazily populated pool costs no resident memory
  // (posix_memalign may hand back an already-faulted free chunk of the heap).
  p = mmap(nullptr, host_alloc_bytes(nbytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
           -1, 0);
  LMTIER_CHECK(p != MAP_FAILED, "host_alloc: out of memory (", nbytes, " bytes)");
  return p;
}

size_t host_alloc_bytes(size_t nbytes) { return (nbytes + 4095) / 4096 * 4096; }

void host_free(void* ptr, size_t nbytes, bool pinned) {
  if (ptr == nullptr) return;
#ifdef LMTIER_WITH_CUDA
  if (pinned) {
    cudaFreeHost(ptr);
    return;
  }
#endif
  munmap(ptr, host_alloc_bytes(nbytes));
}

#ifdef LMTIER_WITH_CUDA
void memcpy_async(void* dst, const void* src, size_t nbytes, void* stream) {
  LMTIER_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

void memcpy_batch_async(void* const* dsts, const void* const* srcs, const size_t* sizes,
                        size_t count, void* stream) {
  if (count == 0) return;
  LMTIER_CHECK_ARG(stream != nullptr,
                   "memcpy_batch_async: the legacy default stream is not allowed");
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
  LMTIER_CUDA_CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &attr_idx, 1,
                                         static_cast<cudaStream_t>(stream)));
}
#endif

}  // namespace lmtier
