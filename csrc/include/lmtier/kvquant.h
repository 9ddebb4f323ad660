// lmtier — KV codec quantize / dequantize, batch-first, bit-exact between the multi-threaded CPU
// implementation (kvquant_cpu.cpp), the CUDA kernels (kvquant_cuda.cu) and the torch reference
// lmtier/codec/quant.py (the specification; docs/codec.md "Exact arithmetic").
//
// Modes (what the kernels implement; levels map onto them in lmtier/codec/native.py):
//   kModeLossless       rotate-left-1 of every 16-bit element, hi byte -> symbols, lo byte -> side,
//                       both in stream order [L, 2, H, D, T].
//   kModeHadamardRow    TOKEN_HEAD granularity with the Hadamard rotation (levels high/default/
//                       low): per (layer, plane, token, head) row of D values: widen to fp32,
//                       unnormalized FWHT in the fixed stage order h = 1, 2, ..., D/2, a = max|y|,
//                       target = a / qmax (fp32 RN division), E5M3 round-up code, q = rint(y / S)
//                       (RN division, half-to-even), symbol = q + qmax. Side = codes [L, 2, H, T]
//                       (layer-major, K then V, [H, T] each). Dequantize: y = (sym - qmax) * S
//                       (exact), x = fwht(y) * (1/D) (exact), one RN cast to the output dtype.
//   Only single correctly rounded fp32 operations and exact multiplies: the translation units are
//   built without fast-math, with -ffp-contract=off (C++) and -fmad=false (CUDA).
//
// Layouts (per chunk, all C-contiguous, elements):
//   chunk    [L][2][T][H][D] bf16 or fp16 (canonical, lmtier/layout.py)
//   symbols  [L][2][H][D][T] uint8                      = symbol_bytes(geometry)
//   side     quantized: [L][2][H][T] uint8 E5M3 codes   = side_bytes(kModeHadamardRow, geometry)
//            lossless:  [L][2][H][D][T] uint8 lo plane  = side_bytes(kModeLossless, geometry)
//   qmax     [L][2] uint8, 1..127 (level.<plane>.qmax_table(L), layer-major, K then V); host memory
//            for both implementations (the CUDA entry copies it into the kernel parameters).
// A batch is C chunks given by a descriptor array [C] KvqChunkDesc (host memory for CPU calls,
// device memory for CUDA calls); chunk, symbols and side of one descriptor must not overlap.
//
// Status: [C] int32 per chunk, a bitwise OR of KvqStatus flags (0 = ok); written for every chunk
// (CUDA: the entry zeroes it with cudaMemsetAsync on the stream, kernels atomicOr into it). Outputs
// of a chunk with a nonzero status are unspecified (the caller must not use them).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lmtier/hd.h"

namespace lmtier {
namespace kvq {

enum KvqMode : int32_t {
  kModeLossless = 0,
  kModeHadamardRow = 1,
};

enum KvqDType : int32_t {
  kBF16 = 0,
  kFP16 = 1,
};

enum KvqStatus : int32_t {
  kOk = 0,
  kErrNonFinite = 1,   // quantize: NaN or inf in the input (quantized modes)
  kErrScaleRange = 2,  // quantize: a row's scale exceeds E5M3's range (|KV| beyond ~28,672 * qmax)
  kErrSymbol = 4,      // dequantize: a symbol above 2 * qmax (corrupt data)
};

constexpr int kMaxLayers = 1024;  // qmax table travels in the CUDA kernel parameters ([L][2] bytes)
constexpr int kTileTokens = 64;   // CUDA: tokens per CTA (one (chunk, layer, plane, head) each)

struct KvqGeometry {
  int32_t num_layers;  // L, 1..kMaxLayers
  int32_t num_tokens;  // T, >= 0 (0: nothing to do)
  int32_t num_heads;   // H, >= 1
  int32_t head_size;   // D: lossless any >= 1 (CPU) / 32, 64, 128, 256 (CUDA);
                       //    quantized: a power of two, <= 1024 (CPU) / 32, 64, 128, 256 (CUDA)
};

// One chunk of a batch (addresses; 24 bytes, layout shared with Python: lmtier/codec/native.py).
struct KvqChunkDesc {
  uint64_t chunk;    // [L][2][T][H][D] bf16/fp16 (input of quantize, output of dequantize)
  uint64_t symbols;  // [L][2][H][D][T] uint8
  uint64_t side;     // side_bytes(mode, geometry) uint8
};
static_assert(sizeof(KvqChunkDesc) == 24, "KvqChunkDesc layout is shared with Python");

// ---- sizes (bytes per chunk) --------------------------------------------------------------------
inline uint64_t chunk_elems(const KvqGeometry& g) {
  return 2ull * g.num_layers * g.num_tokens * g.num_heads * g.head_size;
}
inline uint64_t chunk_bytes(const KvqGeometry& g) { return 2 * chunk_elems(g); }
inline uint64_t symbol_bytes(const KvqGeometry& g) { return chunk_elems(g); }
inline uint64_t side_bytes(int32_t mode, const KvqGeometry& g) {
  return mode == kModeLossless ? chunk_elems(g) : 2ull * g.num_layers * g.num_heads * g.num_tokens;
}

// ---- host entry points -------------------------------------------------------------------
//
// Throw InvalidArgument (Python ValueError) for bad scalar arguments: unknown mode / dtype, a
// geometry the implementation does not support, qmax outside 1..127, null pointers. Data errors go
// to status. CPU: num_threads <= 0 means min(hardware threads, 16). CUDA: every launch and memset
// is enqueued on `stream` (cudaStream_t), one kernel launch per call, nothing allocated, nothing
// synchronized.

void quantize_cpu(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                  int64_t num_chunks, const uint8_t* qmax, int32_t* status, int32_t num_threads);

void dequantize_cpu(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                    int64_t num_chunks, const uint8_t* qmax, int32_t* status, int32_t num_threads);

#ifdef LMTIER_WITH_CUDA
void quantize_cuda(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                   int64_t num_chunks, const uint8_t* qmax, int32_t* status, void* stream);

void dequantize_cuda(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                     int64_t num_chunks, const uint8_t* qmax, int32_t* status, void* stream);
#endif

// Shared argument validation (throws InvalidArgument). on_cuda selects the CUDA geometry rules.
void check_args(int32_t mode, int32_t dtype, const KvqGeometry& g, int64_t num_chunks,
                const void* chunks, const uint8_t* qmax, const int32_t* status, bool on_cuda);

// ---- shared scalar arithmetic (host and device: the CPU and CUDA quantizers call these) ---------
// E5M3 round-up code of a finite fp32 target >= 0 given by its bits; returns -1 when out of range.
LMTIER_HD int32_t scale_code_ceil_bits(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) == 0) return 0;
  const int32_t exp_field = static_cast<int32_t>((bits >> 23) & 0xFF);
  const uint32_t mant = bits & 0x7FFFFFu;
  int32_t m = static_cast<int32_t>((mant + ((1u << 20) - 1)) >> 20);
  int32_t e = exp_field - 127 + 17;
  if (m == 8) {
    m = 0;
    e += 1;
  }
  if (e > 31 || (e == 31 && m == 7)) return -1;
  if (e < 0) return 1;
  return 1 + e * 8 + m;
}
// fp32 bits of the scale of code c (c == 0 -> +0.0).
LMTIER_HD uint32_t scale_value_bits(uint32_t c) {
  if (c == 0) return 0;
  const uint32_t k = c - 1;
  return (((k >> 3) + 110) << 23) | ((k & 7) << 20);
}

}  // namespace kvq
}  // namespace lmtier
