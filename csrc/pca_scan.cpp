// lmtier — a PCA codec record's host checks in one call (see lmtier/pca_scan.h). Each check
// mirrors one in Python (named beside it); a refusal returns nullopt and the Python checks run.
#include "lmtier/pca_scan.h"

#include <algorithm>
#include <cstring>

#include "lmtier/rans.h"

namespace lmtier {
namespace pca {
namespace {

template <typename T>
T load(const uint8_t* p) {  // little-endian hosts only (x86-64, aarch64): the format's byte order
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

uint64_t round16(uint64_t x) { return (x + 15) / 16 * 16; }

// rans.min_stream_bytes: its header, 4 bytes a segment end, the lanes' final states a segment but
// the last
uint64_t min_stream_bytes(uint64_t segments) {
  return sizeof(rans::RansStreamHeader) + 4 * segments +
         uint64_t{rans::kStateBytes} * (segments ? segments - 1 : 0);
}

bool contains(const std::vector<uint8_t>& v, uint32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

std::optional<Scanned> scan_record(const ScanSpec& spec, const uint8_t* p, uint64_t n) {
  // format._parse: the header (struct "<4sHHBBHIIIIIIIQQQ", 64 bytes)
  if (p == nullptr || spec.header_bytes != 64 || n < spec.header_bytes) return std::nullopt;
  const uint32_t magic = load<uint32_t>(p), version = load<uint16_t>(p + 4),
                 header_bytes = load<uint16_t>(p + 6), level = p[8], dtype = p[9],
                 S = load<uint16_t>(p + 10), table_id = load<uint32_t>(p + 12),
                 nl = load<uint32_t>(p + 16), np_ = load<uint32_t>(p + 20),
                 nt = load<uint32_t>(p + 24), nh = load<uint32_t>(p + 28),
                 hd = load<uint32_t>(p + 32), meta_bytes = load<uint32_t>(p + 36);
  const uint64_t payload_bytes = load<uint64_t>(p + 40), flags = load<uint64_t>(p + 48);
  if (magic != spec.magic || version != spec.version || header_bytes != spec.header_bytes ||
      flags != 0)
    return std::nullopt;
  // codec._parse: level, model, geometry, dtype (these also make format._parse's geometry hold)
  if (!contains(spec.levels, level) || table_id != spec.model_id || nl != spec.L || np_ != 2 ||
      nh != spec.H || hd != spec.D || S != spec.S || !contains(spec.dtypes, dtype) || nl == 0 ||
      S == 0 || nh == 0 || hd == 0)
    return std::nullopt;
  const uint64_t nsec = uint64_t{nl} * S, r2 = 2 * uint64_t{spec.R};
  if (nsec > spec.max_sections || r2 == 0 || r2 + 3 > nsec) return std::nullopt;
  const uint64_t index_at = spec.header_bytes, meta_at = index_at + 16 * nsec;
  if (meta_at > n || meta_bytes != spec.meta_bytes) return std::nullopt;
  const uint64_t start = meta_at + round16(meta_bytes);
  if (start > n || payload_bytes > n - start) return std::nullopt;
  // format._parse: the section index: 4-byte aligned sections inside the payload, in order
  std::vector<int64_t> offs(r2 + 3), lens(r2 + 3);
  uint64_t prev_end = 0;
  for (uint64_t i = 0; i < nsec; ++i) {
    const uint64_t off = load<uint64_t>(p + index_at + 16 * i),
                   len = load<uint64_t>(p + index_at + 16 * i + 8);
    if (off % 4 || len > payload_bytes || off > payload_bytes - len || (i && off < prev_end))
      return std::nullopt;
    prev_end = off + len;
    if (i < r2 + 3) {
      offs[i] = static_cast<int64_t>(off);
      lens[i] = static_cast<int64_t>(len);
    } else if (len != 0) {  // codec._parse: the sections after the exact tokens are empty
      return std::nullopt;
    }
  }
  // codec._parse: the metadata ("<qII" + digest) against the model and the sections' sizes
  const uint8_t* meta = p + meta_at;
  const int64_t first = load<int64_t>(meta);
  const uint32_t n_exact = load<uint32_t>(meta + 8), n_esc = load<uint32_t>(meta + 12);
  if (spec.meta_bytes != 16 + spec.digest.size() ||
      std::memcmp(meta + 16, spec.digest.data(), spec.digest.size()) != 0)
    return std::nullopt;
  if (nt == 0 || first < 0 || first > spec.max_position - int64_t{nt}) return std::nullopt;
  const uint64_t raw_bytes = uint64_t{n_exact} * nl * 2 * nh * hd * spec.dtype_bytes;
  if (static_cast<uint64_t>(lens[r2 + 1]) != (uint64_t{nt} + 7) / 8 ||
      static_cast<uint64_t>(lens[r2]) != 2 * uint64_t{n_esc} ||
      static_cast<uint64_t>(lens[r2 + 2]) != raw_bytes)
    return std::nullopt;
  const uint64_t t32 = (uint64_t{nt} + rans::kLanes - 1) / rans::kLanes * rans::kLanes;
  const uint64_t length =
      uint64_t{spec.N} * t32;  // each stream's symbols (checked before T is used)
  if (spec.N == 0 || spec.B == 0 || length > rans::kMaxStreamSymbols || t32 / 32 > 0xFFFF)
    return std::nullopt;
  const uint8_t* payload = p + start;
  std::vector<uint8_t> exact(nt);
  const uint8_t* bitmap = payload + offs[r2 + 1];
  uint64_t flagged = 0;
  for (uint32_t t = 0; t < nt; ++t)  // little bit order, the bits past T ignored (np.unpackbits)
    flagged += exact[t] = bitmap[t / 8] >> (t % 8) & 1;
  if (flagged != n_exact) return std::nullopt;
  // streams.check_spans / _headers_as_laid_out: each stream's header exactly the encoder's
  for (uint64_t i = 0; i < r2; ++i)
    if (static_cast<uint64_t>(lens[i]) < sizeof(rans::RansStreamHeader)) return std::nullopt;
  const uint8_t seg_log2 = payload[offs[0] + 6];
  if (seg_log2 < rans::kMinSegLog2 || seg_log2 > rans::kMaxSegLog2) return std::nullopt;
  const uint64_t need = min_stream_bytes((length + (uint64_t{1} << seg_log2) - 1) >> seg_log2);
  for (uint64_t i = 0; i < r2; ++i) {
    rans::RansStreamHeader want{};
    want.magic = rans::kMagic;
    want.version = rans::kVersion;
    want.flags = 0;
    want.seg_log2 = seg_log2;
    want.lanes_log2 = rans::kLanesLog2;
    want.table_id = static_cast<uint16_t>(i % spec.B * spec.N);
    want.run_words = static_cast<uint16_t>(t32 / 32);
    want.num_symbols = static_cast<uint32_t>(length);
    if (i % spec.B * spec.N > 0xFFFF || std::memcmp(payload + offs[i], &want, sizeof want) != 0 ||
        static_cast<uint64_t>(lens[i]) < need)
      return std::nullopt;
  }
  Scanned s;
  s.level = level;
  s.dtype = dtype;
  s.tokens = nt;
  s.n_esc = n_esc;
  s.start = first;
  s.payload_at = start;
  s.end = start + payload_bytes;
  s.checksum = load<uint64_t>(p + 56);
  s.offs = std::move(offs);
  s.lens = std::move(lens);
  s.exact = std::move(exact);
  return s;
}

}  // namespace pca
}  // namespace lmtier
