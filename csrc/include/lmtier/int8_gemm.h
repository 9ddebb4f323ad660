// lmtier — batched exact int8 GEMMs (int32 accumulators) on cuBLAS, for the PCA codec levels'
// transform (lmtier/codec/pca/kernels.py): a batch of a chunk's 2R GEMMs as one call, so cuBLAS
// spreads all of them over the SMs at once (one GEMM of a chunk fills a fraction of them).
//
// cuBLAS is not linked: the module imports on machines without a GPU driver or cuBLAS, and links
// no libtorch. The library is found at first use with dlopen, preferring the one the process
// already loaded (torch's libcublas.so.13 / .12), and its functions taken with dlsym.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace lmtier {
namespace igemm {

// out[b] = a[b] @ bt[b]^T for b < batch, exact: a int8 [batch][m][k] and bt int8 [batch][p][k]
// (C-contiguous, device pointers; bt row c is column c of the right operand), out int32
// [batch][m][p]; enqueued on `stream` (a cudaStream_t) of the current device. k and p multiples of
// 4 (cuBLAS's int8 rule; lmtier pads to 8); every |sum| below 2^31 (the caller's bound).
// workspace: workspace_bytes of device memory the caller allocated on `stream` for this call
// (cuBLAS's scratch; 0 bytes: algorithms that need none).
// Throws InvalidArgument for bad sizes, std::runtime_error when cuBLAS is not found or refuses the
// call (the caller then runs the GEMMs another way: nothing was written that it relies on).
void bgemm_s8(int32_t batch, int32_t m, int32_t k, int32_t p, const int8_t* a, const int8_t* bt,
              int32_t* out, void* workspace, size_t workspace_bytes, void* stream);

// The cuBLAS library found ("libcublas.so.13", ...), or why none: a reason prefixed "none: ".
std::string library();

}  // namespace igemm
}  // namespace lmtier
