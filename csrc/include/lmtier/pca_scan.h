// lmtier — a PCA codec record's host checks in one call (csrc/pca_scan.cpp): the record format's
// header and section index (lmtier/codec/format.py `_parse`), the PCA metadata against the model
// (lmtier/codec/pca/codec.py `_parse`) and the streams' spans and headers as the encoder lays them
// out (lmtier/codec/pca/streams.py `check_spans`), without the interpreter's many small steps.
// A fast path: it accepts a subset of what those checks accept (the common case) and names nothing;
// a record it refuses goes through the Python checks, which accept it or name what is wrong.
// Host code, every build.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace lmtier {
namespace pca {

// What the record must be, from lmtier/codec/format.py and the PCA model (lmtier/codec/pca/codec.py
// `_scan_spec`): the format's constants come from Python, not from here.
struct ScanSpec {
  uint32_t magic = 0;  // the 4 magic bytes, little-endian
  uint32_t version = 0, header_bytes = 0;
  uint64_t max_sections = 0;
  std::vector<uint8_t> levels;  // level ids the model holds
  std::vector<uint8_t> dtypes;  // record dtype codes a PCA record may hold
  uint32_t dtype_bytes = 2;     // bytes of one element of those dtypes
  uint32_t model_id = 0;
  uint32_t L = 0, H = 0, D = 0, S = 0;  // layers, heads, head size, sections per layer
  uint32_t R = 0, N = 0, B = 0;         // layer groups, components, streams per coder call
  uint32_t meta_bytes = 0;              // a PCA record's metadata: int64 start, uint32 x2, digest
  std::vector<uint8_t> digest;          // the model data's digest
  int64_t max_position = 0;             // start + T stays at or below it
};

// A record that passed: the offsets are the payload's (relative to payload_at).
struct Scanned {
  uint32_t level = 0, dtype = 0, tokens = 0, n_esc = 0;
  int64_t start = 0;
  uint64_t payload_at = 0, end = 0, checksum = 0;
  std::vector<int64_t> offs, lens;  // the 2R streams, escapes, exact bitmap, exact tokens
  std::vector<uint8_t> exact;       // [T]: 1 for an exact token
};

// The record's fields when every check passes and its streams' headers are exactly the encoder's
// (lmtier/codec/pca/streams.py `_headers_as_laid_out`); nullopt otherwise (and for T = 0). The
// checksum is not verified (the caller does, over bytes [0, 56) and [header_bytes, end)).
std::optional<Scanned> scan_record(const ScanSpec& spec, const uint8_t* p, uint64_t n);

}  // namespace pca
}  // namespace lmtier
