// lmtier — interleaved rANS entropy coder for uint8 symbol streams, batch-first, bit-exact between
// the multi-threaded CPU implementation (rans_cpu.cpp) and the CUDA kernels (rans_cuda.cu).
//
// Algorithm: rANS (J. Duda, "Asymmetric numeral systems", arXiv:1311.2540) in the interleaved,
// 16-bit-renormalizing, warp-wide form of dietgpu (facebookresearch/dietgpu, ANS codec) — written
// from the description, no code taken:
//   * 8-bit symbols, probability precision M = 2^12 (kProbBits): a table is 256 uint16 frequencies
//     summing to 4096; every symbol that occurs in a coded segment has frequency >= 1.
//   * 32-bit state x in [L, 2^32) with L = 2^16; renormalization moves 16-bit words, so a lane
//     emits (encode) or consumes (decode) at most one word per symbol.
//   * Interleaving: a stream is cut into segments of 2^seg_log2 symbols (the last one may be
//     short); symbol i of a segment belongs to lane i % 32 (kLanes) and step i / 32. The 32 lanes
//     of a segment are one CUDA warp; CPU threads and GPU CTAs parallelize over segments.
//   * Encoding runs steps 0..S-1 forward; in each step the lanes that renormalize append their low
//     16 bits to the segment's word list in ascending lane order (a warp ballot + prefix popcount).
//     Decoding runs steps S-1..0, so it consumes the word list from its end: the lanes that need a
//     word take the last `count` words, again in ascending lane order. The encoder starts every
//     lane at x = L; the decoder checks it ends there with every word consumed (an integrity
//     check).
//   * Per segment the coded payload is [32 x uint32 final lane states][uint16 words...]. If that is
//     not smaller than the segment's raw size, the segment is stored raw (payload = the symbols).
//
// Tables: the caller passes a set of static tables (calibrated offline, [num_tables][256] uint16)
// and a table id per stream. Table switching (version 2): a stream may also name a *run length* R
// (a multiple of kLanes, 0 = off); symbol i is then coded with static table table_id + floor(i /
// R), so one stream (and one set of lane states) spans many tables, e.g. one table per (head,
// channel) run of T tokens. Because R and every segment start are multiples of 32, the 32 lanes of
// one step always share one table. All tables table_id .. table_id + ceil(n / R) - 1 must exist and
// be valid. The encoder rebuilds its per-symbol table when a step enters a new run; the decoder
// keeps the run's cumulative frequencies and finds a lane's symbol as the s with cdf[s] <= slot <
// cdf[s + 1] (the symbol a slot lookup table would give): the CPU by binary search over [0, 1 +
// last present symbol), CUDA from a table of 128 buckets over the slots, then a bounded search. A
// stream whose run tables lack a symbol is re-coded with its own table (run_words = 0). A stream
// whose static table lacks a symbol that a coded segment needs (or whose table id is
// kAdaptiveTable) is coded with its own table, normalized from the stream's histogram by
// rans_normalize_counts() and stored in the stream. Normalization is integer-only and implemented
// once (here, __host__ __device__): Python's build_table calls the same code.
//
// Encoded stream layout (little-endian; every part starts 4-byte aligned; pad bytes are zero):
//   RansStreamHeader                  16 bytes (static_asserted; run_words = R / 32)
//   [adaptive table]                  only if flags & kFlagAdaptive:
//       uint8  present[32]            bitmap of symbols with frequency > 0
//       uint16 freq[popcount(present)]  their frequencies (1..4096, sum 4096), padded to 4
//   uint32 seg_end[num_segments]      end of segment j's payload, bytes from payload start
//   payload                           segment j occupies [start_j, seg_end[j]) with
//                                     start_0 = 0, start_j = round_up(seg_end[j-1], 4);
//                                     size == segment symbols: raw; otherwise rANS
//                                     (128 + 2 * words bytes, smaller than the raw size)
//   total size rounded up to 4 bytes.
// num_segments = ceil(num_symbols / 2^seg_log2). The stream is self-describing; a batch output is
// the streams back to back at 4-byte aligned offsets given by the offsets table [num_streams + 1].
//
// Hostile input: decoding validates every header field, table, segment end and word count against
// the buffer sizes given by the caller, never reads or writes outside them, and loops at most once
// per symbol; a malformed stream gets a nonzero status (RansStatus) and no exception or UB.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lmtier/hd.h"

namespace lmtier {
namespace rans {

constexpr int kProbBits = 12;
constexpr uint32_t kProbScale = 1u << kProbBits;  // 4096
constexpr uint32_t kStateLower = 1u << 16;        // L
constexpr int kLanesLog2 = 5;
constexpr int kLanes = 1 << kLanesLog2;      // 32 interleaved states per segment
constexpr int kStateBytes = kLanes * 4;      // 128 bytes of final states per coded segment
constexpr int kMinSegLog2 = 10;              // 1 KiB segments
constexpr int kMaxSegLog2 = 20;              // 1 MiB segments
constexpr int kDefaultSegLog2 = 14;          // 16 KiB: 0.8 % state overhead at 8x compression
constexpr uint32_t kAdaptiveTable = 0xFFFF;  // table id: always use the stream's own table
constexpr uint64_t kMaxStreamSymbols = 1ull << 31;
constexpr uint32_t kMagic = 0x534E524Cu;  // "LRNS" little-endian
constexpr uint8_t kVersion = 2;  // 2: run_words (table switching) replaces a reserved field
constexpr uint8_t kFlagAdaptive = 1;
constexpr int kAdaptiveTableMaxBytes = 32 + 2 * 256;
constexpr uint32_t kMaxRunLen = 32u * 0xFFFFu;  // run_words is a uint16

struct RansStreamHeader {
  uint32_t magic;      // kMagic
  uint8_t version;     // kVersion
  uint8_t flags;       // kFlagAdaptive or 0; other bits must be 0
  uint8_t seg_log2;    // segment = 2^seg_log2 symbols, kMinSegLog2..kMaxSegLog2
  uint8_t lanes_log2;  // kLanesLog2
  // Requested static table id (kAdaptiveTable: none); first table of a run stream.
  uint16_t table_id;
  // Table switching: run length R = 32 * run_words symbols (0: one table); 0 if adaptive.
  uint16_t run_words;
  uint32_t num_symbols;  // symbols in the stream, <= kMaxStreamSymbols
};
static_assert(sizeof(RansStreamHeader) == 16, "RansStreamHeader must be 16 bytes");

// Per-stream status codes (int32). 0 = OK.
enum RansStatus : int32_t {
  kOk = 0,
  kErrTruncated = 1,   // buffer shorter than the header / table / segment table / payload
  kErrBadHeader = 2,   // magic, version, flags, seg_log2, lanes or reserved field invalid
  kErrBadTable = 3,    // unknown table id, or frequencies that do not sum to 4096
  kErrCapacity = 4,    // decoded symbols exceed the destination capacity
  kErrBadSegment = 5,  // a segment end / size is inconsistent
  kErrCorrupt = 6,     // rANS integrity check failed (states / words do not match)
  kErrMisaligned = 7,  // stream address not 4-byte aligned
  kErrTooLong = 8,     // encode: stream longer than kMaxStreamSymbols
  kErrScratch = 9,     // encode: scratch smaller than rans_encode_scratch_bytes
  kErrOutput = 10,     // encode: output buffer smaller than the encoded batch
};

// One stream to encode. Arrays of these: [num_streams], device-accessible for CUDA calls.
struct RansEncodeDesc {
  uint64_t src;          // address of num_symbols uint8 symbols (device for CUDA, host for CPU)
  uint64_t num_symbols;  // <= kMaxStreamSymbols
  uint32_t table_id;     // < num_tables, or kAdaptiveTable
  // Table switching: 0 (one table) or R, a multiple of kLanes <= kMaxRunLen; the static tables
  // table_id .. table_id + ceil(num_symbols / R) - 1 code the runs.
  uint32_t run_len;
};
static_assert(sizeof(RansEncodeDesc) == 24, "RansEncodeDesc layout is shared with Python");

// One stream to decode.
struct RansDecodeDesc {
  uint64_t src;           // address of the encoded stream (4-byte aligned)
  uint64_t src_bytes;     // bytes readable at src (>= the stream's size; extra bytes are ignored)
  uint64_t dst;           // address of the decoded symbols
  uint64_t dst_capacity;  // bytes writable at dst
};
static_assert(sizeof(RansDecodeDesc) == 32, "RansDecodeDesc layout is shared with Python");

// ---- shared arithmetic (host and device) ------------------------------------------------------

LMTIER_HD uint64_t seg_count(uint64_t num_symbols, int seg_log2) {
  return (num_symbols + (1ull << seg_log2) - 1) >> seg_log2;
}
LMTIER_HD uint64_t round_up4(uint64_t v) { return (v + 3) & ~3ull; }
LMTIER_HD uint32_t adaptive_table_bytes(uint32_t num_present) {
  return static_cast<uint32_t>(round_up4(32 + 2ull * num_present));
}

// Exact floor(x / d) for every uint32 x and 1 <= d <= 4096 with one multiply-high (Granlund &
// Montgomery, "Division by invariant integers using multiplication", PLDI 1994, fig. 4.1):
//   l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1,
//   t = mulhi(m, x), q = (t + ((x - t) >> min(l, 1))) >> max(l - 1, 0).
struct DivMagic {
  uint32_t mul;
  uint32_t sh1;
  uint32_t sh2;
};
LMTIER_HD DivMagic div_magic(uint32_t d) {
  uint32_t l = 0;
  while ((1u << l) < d) ++l;
  DivMagic m;
  m.mul = static_cast<uint32_t>(((1ull << 32) * ((1ull << l) - d)) / d + 1);
  m.sh1 = l < 1 ? l : 1;
  m.sh2 = l > 1 ? l - 1 : 0;
  return m;
}
LMTIER_HD uint32_t div_by_magic(uint32_t x, uint32_t mul, uint32_t sh1, uint32_t sh2) {
  const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(x) * mul) >> 32);
  return (t + ((x - t) >> sh1)) >> sh2;
}

// Normalize symbol counts to frequencies summing to kProbScale, deterministically (integers only):
//   f_s = max(1, floor(c_s * 4096 / total)) for every symbol with c_s > 0 (and for s <
//   alphabet_size even when c_s == 0, so a static table covers the whole alphabet); then, while the
//   sum is below 4096, add 1 to the symbol with the largest remainder c_s * 4096 - f_s * total
//   (ties: lowest symbol; each symbol at most once per round), and while it is above 4096, subtract
//   1 from the symbol with the largest frequency > 1 (ties: lowest symbol).
// counts: [256] uint64 (sum < 2^51); freq_out: [256] uint16. Returns false (freq_out zeroed) when
// no symbol is present.
LMTIER_HD bool normalize_counts(const uint64_t* counts, int alphabet_size, uint16_t* freq_out) {
  uint64_t total = 0;
  int present = 0;
  for (int s = 0; s < 256; ++s) {
    total += counts[s];
    present += (counts[s] > 0 || s < alphabet_size) ? 1 : 0;
  }
  for (int s = 0; s < 256; ++s) freq_out[s] = 0;
  if (present == 0) return false;
  if (total == 0) total = 1;  // only forced symbols: all get frequency >= 1 below
  uint32_t sum = 0;
  for (int s = 0; s < 256; ++s) {
    if (counts[s] == 0 && s >= alphabet_size) continue;
    uint64_t f = counts[s] * kProbScale / total;
    if (f < 1) f = 1;
    freq_out[s] = static_cast<uint16_t>(f);
    sum += static_cast<uint32_t>(f);
  }
  // Deficit: largest-remainder rounds (each round gives at most one unit per symbol).
  while (sum < kProbScale) {
    uint8_t used[256];
    for (int s = 0; s < 256; ++s) used[s] = 0;
    bool gave = false;
    while (sum < kProbScale) {
      int best = -1;
      uint64_t best_rem = 0;
      for (int s = 0; s < 256; ++s) {
        if (freq_out[s] == 0 || used[s]) continue;
        const uint64_t exact = counts[s] * kProbScale;
        const uint64_t have = static_cast<uint64_t>(freq_out[s]) * total;
        const uint64_t rem = exact > have ? exact - have : 0;
        if (best < 0 || rem > best_rem) {
          best = s;
          best_rem = rem;
        }
      }
      if (best < 0) break;
      used[best] = 1;
      freq_out[best] += 1;
      sum += 1;
      gave = true;
    }
    if (!gave) break;
  }
  // Excess (from the max(1, .) clamps): take from the largest frequencies.
  while (sum > kProbScale) {
    int best = -1;
    for (int s = 0; s < 256; ++s)
      if (freq_out[s] > 1 && (best < 0 || freq_out[s] > freq_out[best])) best = s;
    if (best < 0) break;  // unreachable: present <= 256 < 4096
    freq_out[best] -= 1;
    sum -= 1;
  }
  return true;
}

// Number of runs of a run-switching stream (0 when run_len == 0 or n == 0).
LMTIER_HD uint64_t run_count(uint64_t num_symbols, uint32_t run_len) {
  return run_len == 0 ? 0 : (num_symbols + run_len - 1) / run_len;
}
// True when a requested run length is acceptable (0 or a positive multiple of kLanes <=
// kMaxRunLen).
LMTIER_HD bool run_len_valid(uint32_t run_len) {
  return run_len % kLanes == 0 && run_len <= kMaxRunLen;
}

// True when freq is a valid table: sum == 4096 (zero entries allowed for absent symbols).
LMTIER_HD bool table_valid(const uint16_t* freq) {
  uint32_t sum = 0;
  for (int s = 0; s < 256; ++s) sum += freq[s];
  return sum == kProbScale;
}

// ---- sizes -------------------------------------------------------------------------------------

// Worst-case encoded bytes of one stream of num_symbols symbols (raw segments, adaptive table).
inline uint64_t max_encoded_bytes(uint64_t num_symbols, int seg_log2) {
  const uint64_t nseg = seg_count(num_symbols, seg_log2);
  return sizeof(RansStreamHeader) + kAdaptiveTableMaxBytes + 4 * nseg + num_symbols + 3 * nseg + 4;
}
// Worst-case bytes of a batch: sum of max_encoded_bytes over the streams, bounded from the totals.
inline uint64_t max_batch_encoded_bytes(uint64_t num_streams, uint64_t total_symbols,
                                        int seg_log2) {
  const uint64_t nseg = (total_symbols >> seg_log2) + num_streams;
  return num_streams * (sizeof(RansStreamHeader) + kAdaptiveTableMaxBytes + 4) + 7 * nseg +
         total_symbols;
}

// Bytes of the static-table validity bitmap in scratch (bit t: table t sums to 4096; ids < 65,536).
constexpr uint64_t kTablesOkBytes = 65536 / 8;

// Scratch layout shared by the CPU and CUDA encoders (offsets in bytes from the scratch base).
struct EncodeScratchLayout {
  uint64_t streams;     // [num_streams] StreamWork
  uint64_t hist;        // [num_streams][256] uint32 histograms (adaptive streams)
  uint64_t freq;        // [num_streams][256] uint16 adaptive tables
  uint64_t seg_size;    // [max_segments] uint32 payload bytes per segment
  uint64_t seg_start;   // [max_segments + 1] uint64 padded payload prefix (global)
  uint64_t globals;     // 64 bytes
  uint64_t tables_ok;   // kTablesOkBytes: validity bitmap of the static tables (CUDA)
  uint64_t slots;       // [max_segments][slot_bytes] coded payloads before compaction
  uint64_t slot_bytes;  // 2^seg_log2 + 64
  uint64_t max_segments;
  uint64_t total;
};

// Per-stream work record in scratch (both implementations).
struct StreamWork {
  uint64_t seg_base;    // first global segment index
  uint64_t tile_base;   // first global tile index (CUDA)
  uint64_t out_offset;  // byte offset of the encoded stream in the batch output
  uint32_t num_segments;
  uint32_t num_tiles;
  uint32_t table_bytes;  // bytes of the adaptive table section (0: static)
  int32_t status;
  uint32_t needs_adaptive;  // set when a coded segment meets a symbol absent from the static table
  uint32_t reserved;
};
static_assert(sizeof(StreamWork) == 48, "StreamWork layout");

inline EncodeScratchLayout encode_scratch_layout(uint64_t num_streams, uint64_t max_segments,
                                                 int seg_log2) {
  auto a = [](uint64_t v) { return (v + 255) & ~255ull; };
  EncodeScratchLayout s{};
  uint64_t o = 0;
  s.streams = o;
  o = a(o + num_streams * sizeof(StreamWork));
  s.hist = o;
  o = a(o + num_streams * 256 * 4);
  s.freq = o;
  o = a(o + num_streams * 256 * 2);
  s.seg_size = o;
  o = a(o + max_segments * 4);
  s.seg_start = o;
  o = a(o + (max_segments + 1) * 8);
  s.globals = o;
  o = a(o + 64);
  s.tables_ok = o;
  o = a(o + kTablesOkBytes);
  s.slots = o;
  s.slot_bytes = (1ull << seg_log2) + 64;
  s.max_segments = max_segments;
  o = a(o + max_segments * s.slot_bytes);
  s.total = o;
  return s;
}

// Largest max_segments whose layout fits in scratch_bytes (0 if not even the per-stream part fits).
uint64_t encode_scratch_capacity(uint64_t num_streams, uint64_t scratch_bytes, int seg_log2);

// Scratch bytes for encoding num_streams streams holding total_symbols symbols together.
inline uint64_t encode_scratch_bytes(uint64_t num_streams, uint64_t total_symbols, int seg_log2) {
  const uint64_t max_segments = (total_symbols >> seg_log2) + num_streams;
  return encode_scratch_layout(num_streams, max_segments, seg_log2).total;
}
// Scratch bytes for decoding num_streams streams.
inline uint64_t decode_scratch_bytes(uint64_t num_streams) {
  return ((num_streams * sizeof(StreamWork) + 255) & ~255ull) + 256 + kTablesOkBytes;
}

// Decode lookups of table-switching streams (CUDA only): a warp decoding a stream with run_len > 0
// needs, for each run's static table, its cdf and 128 buckets of 32 slots (the RunTables of
// rans_cuda.cu). Building them from the frequencies at every run costs more than the run's 8
// decode steps; build_run_luts_cuda computes them once per table into kRunLutBytes a table:
//   uint32 bucket[128]  bucket b: s | (f_s - 1) << 8 | cdf[s] << 20 for the symbol s whose range
//                        holds slot 32 b
//   uint16 cdf[256]     cdf[0..255] (cdf[256] = 4096 and the closing bucket are constants)
// A table that does not sum to 4096 gets unspecified bytes (its streams are refused before any
// lookup). decode_cuda reads them when given run_luts: the same symbols, the same statuses.
constexpr uint64_t kRunLutBytes = 1024;

// ---- host entry points ---------------------------------------------------------------------
// Common arguments:
//   descs        [num_streams] RansEncodeDesc / RansDecodeDesc (host for CPU, device-accessible
//                for CUDA)
//   tables       [num_tables][256] uint16 static tables (same memory rule); may be null if
//                num_tables == 0
//   status       [num_streams] int32 RansStatus per stream (same memory rule)
//   scratch      caller-provided, >= encode_scratch_bytes / decode_scratch_bytes (same memory rule)
//   num_threads  CPU threads (<= 0: min(hardware threads, 16))
//   stream       cudaStream_t (CUDA only); every launch and memset is enqueued on it, nothing
//                syncs.
//
// Encode also writes offsets [num_streams + 1] uint64 (byte offset of stream i in out; offsets[N] =
// total bytes) into `offsets`; on any error the output is unspecified and offsets[N] = 0. Throws
// InvalidArgument only for bad scalar arguments (seg_log2, null pointers); data errors go to
// status. Decode writes out_lengths [num_streams] uint64 = decoded symbols (0 on error).

void encode_cpu(const RansEncodeDesc* descs, int64_t num_streams, const uint16_t* tables,
                int64_t num_tables, int seg_log2, uint8_t* out, uint64_t out_bytes,
                uint64_t* offsets, int32_t* status, void* scratch, uint64_t scratch_bytes,
                int32_t num_threads);

void decode_cpu(const RansDecodeDesc* descs, int64_t num_streams, const uint16_t* tables,
                int64_t num_tables, uint64_t* out_lengths, int32_t* status, int32_t num_threads);

#ifdef LMTIER_WITH_CUDA
void encode_cuda(const RansEncodeDesc* descs, int64_t num_streams, const uint16_t* tables,
                 int64_t num_tables, int seg_log2, uint8_t* out, uint64_t out_bytes,
                 uint64_t* offsets, int32_t* status, void* scratch, uint64_t scratch_bytes,
                 void* stream);

// run_luts: null (each warp builds a run's lookups itself) or [num_tables][kRunLutBytes] of
// build_run_luts_cuda over these same tables, 16-byte aligned, on the device.
// tables_ok: null (the tables' validity is checked at this call: each table read once) or the
// bitmap tables_ok_cuda wrote for these same tables, from bit 0 (on the device; a slice of a larger
// array's bitmap must start at a table id that is a multiple of 32).
void decode_cuda(const RansDecodeDesc* descs, int64_t num_streams, const uint16_t* tables,
                 int64_t num_tables, const uint8_t* run_luts, const uint32_t* tables_ok,
                 uint64_t* out_lengths, int32_t* status, void* scratch, uint64_t scratch_bytes,
                 void* stream);

// The validity bitmap of tables [num_tables][256] (device) into ok_bits [(num_tables + 31) / 32]
// uint32 (device): bit t % 32 of word t / 32 set when table t sums to 4096 (kProbScale), as each
// decode_cuda call otherwise computes for its own tables; queued on `stream`. For tables that do
// not change: decode_cuda then skips reading them. Throws InvalidArgument for null pointers or
// num_tables < 0.
void tables_ok_cuda(const uint16_t* tables, int64_t num_tables, uint32_t* ok_bits, void* stream);

// The decode lookups of tables [num_tables][256] (device) into luts [num_tables][kRunLutBytes]
// (device, 16-byte aligned), queued on `stream`. Throws InvalidArgument for null pointers, a
// misaligned luts or num_tables < 0.
void build_run_luts_cuda(const uint16_t* tables, int64_t num_tables, uint8_t* luts, void* stream);
#endif

}  // namespace rans
}  // namespace lmtier
