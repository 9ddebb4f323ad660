// lmtier — CUDA kernels of the PCA codec levels' transform (issue 19), bit-exact with the torch
// reference lmtier/codec/pca/transform.py (the specification; its docstrings give every rule).
// The int8 GEMMs between them are batched cuBLAS calls (csrc/int8_gemm.cpp), one per batch of layer
// groups; lmtier/codec/pca/kernels.py drives the sequence (per batch of layer groups: the kernels
// get a geometry of the batch's layers and pointers to its groups' rows):
//
//   encode: encode_pre -> per (layer group r, plane p): Y = [xh; xl] @ [eh | el] (int8 -> int32)
//           -> encode_post -> exact tokens (torch, [R, 2, T] sized) -> encode_symbols
//   decode: (torch: symbols -> coefficients, escapes) -> decode_pre (or, for a chunk without
//           escapes, decode_pre_symbols from the symbols) -> Y = lo8(q) @ [dh | dl]
//           -> decode_post (escaped coefficients' high parts added row by row) -> exact tokens
//           (torch)
//
// Geometry: chunk [L][2][T][H][D] (canonical), layer groups of G layers, R = L / G, vectors of
// N = G * H * D values (value n: layer r * G + n / (H*D), head (n / D) % H, channel n % D), N8 = N
// rounded up to 8 (the int8 GEMM's rule; padding is zero). A 16-bit integer v travels as the signed
// bytes hi = v >> 8, lo = (v & 255) - 128 (v = 256 hi + lo + 128; lmtier/codec/pca/imatmul.py).
//
// Layouts (C-contiguous, elements):
// clang-format off
//   xs        int8  [R][2][2T][N8]    rows 0..T-1: hi bytes, rows T..2T-1: lo bytes of x_int
//   rowsum    int64 [R][2][T]         sum over n of x_int (encode) / of lo8(q) (decode); the post
//                                     kernels add 128 * rowsum (imatmul.py's identity)
//   flags     int32 [T]               encode_pre: bit kFlagClamped: a raw value beyond 16 bits,
//                                     bit kFlagNonFinite: a NaN or inf value; encode_post: a
//                                     coefficient beyond 16 bits (callers zero them first)
//   Yenc      int32 [R][2][2T][2*N8]  [xh; xl] @ [eh | el]
//   Ydec      int32 [R][2][T][2*N8]   lo8(q) @ [dh | dl]
//   col       int64 [R][2][N8]        128 * (colsum(e_int) - 128 * N8)
//   q         int16 [R][2][T][N]      clamped coefficients
//   energy    int64 [R][2][T]
//   sym       uint8 [R][2][N][T32]    q + 127, 255 for |q| > 127, 127 on exact tokens and padding
//   qt        int16 [R][2][N][T]      decode: coefficients in stream order (escapes filled in)
//   esc_row   int32 [R*2*T + 1]       CSR over rows (r, p, t) of the escaped high parts;
//   esc_col, esc_hi int32             their component j and hi8(q) = (q - lo8(q)) / 256
//   dcat      int8  [R][2][2*N8][N8]  [dh | dl] of d_int, transposed (row c = column c): the GEMM's
//                                     column-major right operand (imatmul.SplitMatrix.cat_t)
//   out       [L][2][T][H][D] bf16 / fp16
// clang-format on
// Float64 steps are single correctly rounded operations (__dmul_rn, __dsub_rn, __dadd_rn, rint);
// the translation unit is built with -fmad=false. cos / sin: float64 [T][D] tables from the host
// (lmtier/codec/pca/rope.py), null for a model without RoPE.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "lmtier/hd.h"

namespace lmtier {
namespace pca {

enum PcaDType : int32_t { kBF16 = 0, kFP16 = 1 };

struct PcaGeometry {
  int32_t L, T, H, D, G;
  LMTIER_HD int32_t N() const { return G * H * D; }
  LMTIER_HD int32_t N8() const { return (N() + 7) / 8 * 8; }
  LMTIER_HD int32_t R() const { return L / G; }
};

constexpr int32_t kXMax = 32767;
constexpr int64_t kEMax = int64_t(1) << 20;
constexpr int32_t kMaxVector = 8192;
constexpr int32_t kSymOffset = 127;    // symbol = q + kSymOffset (transform.py's OFFSET)
constexpr int32_t kSymEscape = 255;    // the escape symbol (transform.py's ESCAPE)
constexpr int32_t kFlagClamped = 1;    // encode_pre's flags: a raw value beyond 16 bits
constexpr int32_t kFlagNonFinite = 2;  // encode_pre's flags: NaN or inf in the token's values

// Checks the geometry (LMTIER_CHECK_ARG: G divides L, N <= kMaxVector, even D with RoPE).
void check_geometry(const PcaGeometry& g, bool rope);

void encode_pre(int32_t dtype, const PcaGeometry& g, const void* kv, const double* cos_t,
                const double* sin_t, const double* inv_x_scale, int8_t* xs, int64_t* rowsum,
                int32_t* flags, void* stream);
void encode_post(const PcaGeometry& g, const int32_t* y, const int64_t* col, const int64_t* rowsum,
                 const double* e_mu, const double* k, int16_t* q, int64_t* energy, int32_t* flags,
                 void* stream);
void encode_symbols(const PcaGeometry& g, int32_t t32, const int16_t* q, const uint8_t* exact,
                    uint8_t* sym, void* stream);
void decode_pre(const PcaGeometry& g, const int16_t* qt, int8_t* lo, int64_t* rowsum, void* stream);
// decode_pre of a chunk without escaped coefficients, from its symbols sym [R][2][N][stride]
// (stride >= T: the streams' padded rows) directly: value = symbol - kSymOffset; the escape symbols
// (kSymEscape) are counted into *esc_count (int32, added to; the caller zeroes it and refuses the
// chunk when it is not 0).
void decode_pre_symbols(const PcaGeometry& g, const uint8_t* sym, int32_t stride, int8_t* lo,
                        int64_t* rowsum, int32_t* esc_count, void* stream);
void decode_post(int32_t dtype, const PcaGeometry& g, const int32_t* y, const int64_t* rowsum,
                 const int32_t* esc_row, const int32_t* esc_col, const int32_t* esc_hi,
                 const int8_t* dcat, const double* f, const double* mu, const double* cos_t,
                 const double* sin_t, void* out, void* stream);

// The escaped coefficients of a record's symbols on the device, after decode_pre_symbols (which
// wrote lo8(kSymEscape - kSymOffset) for them): escapes int16 [num_escapes] in stream order (runs
// (r, p, j) in order, tokens in order), written into lo and rowsum, and the CSR of their high parts
// by row (r, p, t): esc_row [R * 2 * T + 1], esc_col / esc_hi [num_escapes] (decode_post's). When
// the symbols hold another number of escapes, nothing is written and esc_row is all 0 (the caller
// refuses the record: decode_pre_symbols' esc_count differs from num_escapes). scratch: device
// memory of escape_scratch_bytes(g). csrc/pca_escapes.cu.
size_t escape_scratch_bytes(const PcaGeometry& g);
void decode_escapes(const PcaGeometry& g, const uint8_t* sym, int32_t stride,
                    const int16_t* escapes, int32_t num_escapes, int8_t* lo, int64_t* rowsum,
                    int32_t* esc_row, int32_t* esc_col, int32_t* esc_hi, void* scratch,
                    void* stream);

// One record's decode, every step queued by the host in one call (csrc/pca_decode.cpp;
// lmtier/codec/pca/native_decode.py lays out the buffers): the record's rANS streams
// (rans::decode_cuda, calls of streams_per_call streams: the first on `stream`, the others on side
// streams from a process-wide pool, forked from and joined back to `stream`), then
// decode_pre_symbols, decode_escapes when the record has escaped coefficients, then per batch of
// groups_per_batch layer groups one batched int8 GEMM (igemm::bgemm_s8) and decode_post. The same
// kernels as lmtier/codec/pca/kernels.py's _decode (an escape CSR's rows in another order: its sum
// is integer), so the same bits. Nothing waits: status, counts and *esc_count (which must equal
// num_escapes) are the caller's to check once `stream` ran (esc_count and esc_row are zeroed here
// first). All pointers are device addresses.
struct DecodeRecordArgs {
  int32_t dtype;
  PcaGeometry g;              // T = the record's tokens
  int32_t t32;                // symbols per component run (T rounded up to 32): sym's row
  const void* descs;          // [num_streams] rans::RansDecodeDesc
  int64_t num_streams;        // 2R
  int64_t tables_per_stream;  // N
  int64_t streams_per_call;   // streams of one rANS call (16-bit table ids)
  const uint16_t* tables;     // [num_streams * N][256]
  const uint8_t* run_luts;    // null or [num_streams * N][rans::kRunLutBytes] of these tables
  const uint32_t* tables_ok;  // null or rans::tables_ok_cuda's bitmap of these tables
  uint64_t* counts;           // [num_streams] decoded symbols
  int32_t* status;            // [num_streams] RansStatus
  uint8_t* scratch;           // one rans::decode_scratch_bytes(streams_per_call) per call
  uint64_t scratch_bytes;     // per call
  const uint8_t* sym;         // [R][2][N][t32]: the descriptors' outputs
  const int16_t* escapes;     // [num_escapes], stream order (null when 0)
  int32_t num_escapes;        // the record's (its metadata's)
  int32_t* esc_col;           // [num_escapes]
  int32_t* esc_hi;            // [num_escapes]
  void* esc_scratch;          // escape_scratch_bytes(g) (unused when num_escapes is 0)
  int8_t* lo;                 // [2R][T][N8]
  int64_t* rowsum;            // [R][2][T]
  int32_t* esc_count;         // [1]
  int32_t* esc_row;           // [R * 2 * T + 1]
  int32_t* y;                 // [2 * groups_per_batch][T][2 * p8]
  int32_t groups_per_batch;
  int32_t p8;           // the decode matrix's P8
  const int8_t* dcat;   // [2R][2 * p8][N8]
  const double* f;      // [R][2][N]
  const double* mu;     // [R][2][N]
  const double* cos_t;  // [T][D] or null
  const double* sin_t;
  void* out;  // [L][2][T][H][D] of dtype
  void* gemm_workspace;
  uint64_t gemm_workspace_bytes;
  void* stream;
};
void decode_record(const DecodeRecordArgs& a);

// A record's exact tokens put into its decoded chunk: token idx[e] of every (layer, plane) of out
// [L][2][T][H][D] (16-bit elements) from raw [L][2][n_exact][H][D]; idx int64 [n_exact] (device),
// an index outside [0, T) skipped. csrc/pca_cuda.cu.
void scatter_exact_tokens(const PcaGeometry& g, const int64_t* idx, int32_t n_exact,
                          const void* raw, void* out, void* stream);

// The host's part of one record's decode (csrc/pca_stage.cpp): a page-locked staging block from a
// process-wide pool receives the coder's descriptors (built here: stream i of the payload into
// symbol row i of a.sym), the payload and the exact tokens' index; one copy uploads them to
// `upload` (device: descriptors at 0, payload at payload_at, index at idx_at); decode_record(a)
// follows (a.descs = upload), then scatter_exact_tokens from the uploaded exact tokens (section
// num_streams + 2), then the device's checks (checks_bytes at `checks`) are copied back into the
// block, all on a.stream. The block goes back to the pool once its Stage is dropped and the stream
// passed the copy back. The payload's sections (offs / lens: num_streams + 3 entries) must lie in
// it.
struct StageArgs {
  const uint8_t* payload;
  uint64_t payload_bytes;
  const int64_t* offs;  // [num_streams + 3] section offsets in payload
  const int64_t* lens;  // [num_streams + 3]
  const int64_t* exact_idx;
  int32_t n_exact;
  uint8_t* upload;  // device
  uint64_t payload_at, idx_at;
  const uint8_t* checks;  // device
  uint64_t checks_bytes;
};

// A staging block in use by one record's decode: its checks (host, page-locked) once the stream
// passed them.
class Stage {
 public:
  Stage(void* block, const uint8_t* checks, uint64_t checks_bytes)
      : block_(block), checks_(checks), checks_bytes_(checks_bytes) {}
  ~Stage();
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;
  const uint8_t* checks() const { return checks_; }
  uint64_t checks_bytes() const { return checks_bytes_; }
  // The block stays out of the pool for good (its event could not be recorded).
  void keep() { block_ = nullptr; }

 private:
  void* block_;
  const uint8_t* checks_;
  uint64_t checks_bytes_;
};

// decode_record with its host part (StageArgs); raises as decode_record and LMTIER_CHECK_ARG for
// sections outside the payload or regions that do not fit the layout.
std::unique_ptr<Stage> decode_record_staged(DecodeRecordArgs a, const StageArgs& s);
// (blocks, bytes) of page-locked memory the staging pool holds (all devices).
std::pair<size_t, size_t> stage_pool_stats();

}  // namespace pca
}  // namespace lmtier
