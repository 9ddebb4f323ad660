// lmtier — multi-threaded CPU rANS encoder/decoder. Produces byte-identical streams to the CUDA
// kernels (rans_cuda.cu): both follow the per-segment procedure documented in rans.h, lane by lane
// in ascending order, with the same segment ordering, padding and table rules.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "lmtier/common.h"
#include "lmtier/parallel.h"
#include "lmtier/rans.h"

namespace lmtier {
namespace rans {
namespace {

constexpr uint32_t kMissing = 0xFFFFFFFFu;

// enc[s] = freq | cdf << 16 (freq 0: absent).
void build_enc_table(const uint16_t* freq, uint32_t* enc) {
  uint32_t cdf = 0;
  for (int s = 0; s < 256; ++s) {
    enc[s] = freq[s] | (cdf << 16);
    cdf += freq[s];
  }
}

// dec[slot] = symbol | (freq - 1) << 8 | (slot - cdf) << 20. Requires a valid table.
void build_dec_table(const uint16_t* freq, uint32_t* dec) {
  uint32_t cdf = 0;
  for (int s = 0; s < 256; ++s) {
    for (uint32_t j = 0; j < freq[s]; ++j)
      dec[cdf + j] = static_cast<uint32_t>(s) | ((freq[s] - 1u) << 8) | (j << 20);
    cdf += freq[s];
  }
}

inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Encodes one segment of n (1..2^seg_log2) symbols into slot ([kStateBytes states][words]).
// Returns the coded payload bytes (< n), n for a raw segment (stops as soon as coding cannot win;
// slot then holds garbage), or kMissing when a symbol has frequency 0.
// Table switching (run_len > 0): step k (symbols first + 32k ..) uses enc + 256 * ((first + 32k) /
// run_len).
uint32_t encode_segment(const uint8_t* sym, uint32_t n, const uint32_t* enc0, uint8_t* slot,
                        uint32_t run_len = 0, uint64_t first = 0) {
  const uint32_t* enc = enc0;
  uint32_t x[kLanes];
  for (int l = 0; l < kLanes; ++l) x[l] = kStateLower;
  uint8_t* words = slot + kStateBytes;
  uint64_t pos = 0;
  const uint32_t steps = (n + kLanes - 1) / kLanes;
  for (uint32_t k = 0; k < steps; ++k) {
    const uint32_t base = k * kLanes;
    const int active = static_cast<int>(std::min<uint32_t>(kLanes, n - base));
    if (run_len) enc = enc0 + 256ull * ((first + base) / run_len);
    for (int l = 0; l < active; ++l) {
      const uint32_t e = enc[sym[base + l]];
      const uint32_t f = e & 0xFFFF;
      if (f == 0) return kMissing;
      uint32_t s = x[l];
      if ((s >> 20) >= f) {  // s >= f * 2^20, without overflow at f = 4096
        words[2 * pos] = static_cast<uint8_t>(s);
        words[2 * pos + 1] = static_cast<uint8_t>(s >> 8);
        ++pos;
        s >>= 16;
      }
      const uint32_t q = s / f;
      x[l] = (q << kProbBits) + (s - q * f) + (e >> 16);
    }
    if (kStateBytes + 2 * pos >= n) return n;
  }
  for (int l = 0; l < kLanes; ++l) store_u32(slot + 4 * l, x[l]);
  return static_cast<uint32_t>(kStateBytes + 2 * pos);
}

// Decodes one rANS segment (size validated: kStateBytes <= size < n, size - kStateBytes even).
int32_t decode_segment(const uint8_t* payload, uint32_t size, uint32_t n, const uint32_t* dec,
                       uint8_t* out) {
  uint32_t x[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    x[l] = load_u32(payload + 4 * l);
    if (x[l] < kStateLower) return kErrCorrupt;
  }
  const uint8_t* words = payload + kStateBytes;
  uint64_t pos = (size - kStateBytes) / 2;
  const uint32_t steps = (n + kLanes - 1) / kLanes;
  for (uint32_t k = steps; k-- > 0;) {
    const uint32_t base = k * kLanes;
    const int active = static_cast<int>(std::min<uint32_t>(kLanes, n - base));
    uint32_t need = 0;
    for (int l = 0; l < active; ++l) {
      const uint32_t e = dec[x[l] & (kProbScale - 1)];
      out[base + l] = static_cast<uint8_t>(e);
      x[l] = (((e >> 8) & 0xFFF) + 1) * (x[l] >> kProbBits) + (e >> 20);
      need += x[l] < kStateLower ? 1 : 0;
    }
    if (need > pos) return kErrCorrupt;
    uint64_t w = pos - need;
    for (int l = 0; l < active; ++l)
      if (x[l] < kStateLower) x[l] = (x[l] << 16) | load_u16(words + 2 * (w++));
    pos -= need;
  }
  if (pos != 0) return kErrCorrupt;
  for (int l = 0; l < kLanes; ++l)
    if (x[l] != kStateLower) return kErrCorrupt;
  return kOk;
}

// Table-switching decodes of runs of at least kBucketRun symbols find a slot's symbol from a
// per-run index of buckets of 2^kBucketLog2 slots over the nonzero-frequency symbols (built in ~512
// steps a run; a slot then takes fewer than 2^kBucketLog2 steps, whatever gaps the table has);
// shorter runs search.
constexpr int kBucketLog2 = 4;
constexpr uint32_t kBucketRun = 128;

// Decodes one rANS segment of a table-switching stream: step k uses static table
// tables + 256 * (table_id + (first + 32k) / run_len), a slot's symbol found in its cdf (the symbol
// s with cdf[s] <= slot < cdf[s + 1]: the same symbol a slot table gives). Tables validated.
int32_t decode_segment_runs(const uint8_t* payload, uint32_t size, uint32_t n,
                            const uint16_t* tables, uint32_t table_id, uint32_t run_len,
                            uint64_t first, uint8_t* out) {
  uint32_t x[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    x[l] = load_u32(payload + 4 * l);
    if (x[l] < kStateLower) return kErrCorrupt;
  }
  const uint8_t* words = payload + kStateBytes;
  uint64_t pos = (size - kStateBytes) / 2;
  const uint32_t steps = (n + kLanes - 1) / kLanes;
  uint32_t cdf[257];
  uint32_t top = 256;  // 1 + last symbol with frequency > 0: cdf[top] == 4096, the search bound
  // buckets: the nonzero-frequency symbols in order, their cdf (then kProbScale), and per bucket of
  // slots the index of its first slot's symbol among them
  uint8_t nz_sym[256], first_of[kProbScale >> kBucketLog2];
  uint32_t nz_cdf[257];
  const bool buckets = run_len >= kBucketRun;
  uint64_t cur = ~0ull;
  for (uint32_t k = steps; k-- > 0;) {
    const uint32_t base = k * kLanes;
    const int active = static_cast<int>(std::min<uint32_t>(kLanes, n - base));
    const uint64_t run = (first + base) / run_len;
    if (run != cur) {
      const uint16_t* f = tables + 256ull * (table_id + run);
      cdf[0] = 0;
      for (int s = 0; s < 256; ++s) {
        cdf[s + 1] = cdf[s] + f[s];
        if (f[s]) top = static_cast<uint32_t>(s) + 1;
      }
      if (buckets) {
        uint32_t used = 0;
        for (uint32_t s = 0; s < 256; ++s) {
          if (!f[s]) continue;
          nz_sym[used] = static_cast<uint8_t>(s);
          nz_cdf[used++] = cdf[s];
        }
        nz_cdf[used] = kProbScale;  // > every slot: the walks below stop at the last symbol
        for (uint32_t b = 0, i = 0; b < (kProbScale >> kBucketLog2); ++b) {
          while (nz_cdf[i + 1] <= (b << kBucketLog2)) ++i;  // nz_cdf[0] = 0: the first symbol's
          first_of[b] = static_cast<uint8_t>(i);
        }
      }
      cur = run;
    }
    uint32_t need = 0;
    for (int l = 0; l < active; ++l) {
      const uint32_t slot = x[l] & (kProbScale - 1);
      // the symbol: largest s < top with cdf[s] <= slot (cdf[0] = 0 <= slot < cdf[top] = 4096)
      uint32_t lo = 0;
      if (buckets) {  // up from its bucket's first symbol: at most 2^kBucketLog2 - 1 steps
        uint32_t i = first_of[slot >> kBucketLog2];
        while (nz_cdf[i + 1] <= slot) ++i;
        lo = nz_sym[i];  // the largest nonzero-frequency symbol with cdf <= slot: the same one
      } else {  // searched without branches (the answer in [lo, lo + len)): 2-3x a branchy search
        for (uint32_t len = top; len > 1;) {
          const uint32_t half = len >> 1;
          lo = cdf[lo + half] <= slot ? lo + half : lo;
          len -= half;
        }
      }
      out[base + l] = static_cast<uint8_t>(lo);
      x[l] = (cdf[lo + 1] - cdf[lo]) * (x[l] >> kProbBits) + slot - cdf[lo];
      need += x[l] < kStateLower ? 1 : 0;
    }
    if (need > pos) return kErrCorrupt;
    uint64_t w = pos - need;
    for (int l = 0; l < active; ++l)
      if (x[l] < kStateLower) x[l] = (x[l] << 16) | load_u16(words + 2 * (w++));
    pos -= need;
  }
  if (pos != 0) return kErrCorrupt;
  for (int l = 0; l < kLanes; ++l)
    if (x[l] != kStateLower) return kErrCorrupt;
  return kOk;
}

// Validated view of one encoded stream (rules in rans.h; the CUDA prep kernel applies the same).
struct StreamView {
  int32_t status = kOk;
  uint32_t n = 0;
  uint32_t table_id = 0;
  uint32_t run_len = 0;  // > 0: table switching (static tables table_id + run)
  int seg_log2 = 0;
  uint64_t nseg = 0;
  uint16_t freq[256];
  const uint8_t* seg_end = nullptr;
  const uint8_t* payload = nullptr;
  uint64_t avail = 0;
};

StreamView parse_stream(const RansDecodeDesc& d, const uint16_t* tables, int64_t num_tables) {
  StreamView v;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(d.src);
  if (d.src % 4 != 0) {
    v.status = kErrMisaligned;
    return v;
  }
  if (src == nullptr || d.src_bytes < sizeof(RansStreamHeader)) {
    v.status = kErrTruncated;
    return v;
  }
  RansStreamHeader h;
  std::memcpy(&h, src, sizeof(h));
  if (h.magic != kMagic || h.version != kVersion || (h.flags & ~kFlagAdaptive) != 0 ||
      h.seg_log2 < kMinSegLog2 || h.seg_log2 > kMaxSegLog2 || h.lanes_log2 != kLanesLog2 ||
      h.num_symbols > kMaxStreamSymbols || ((h.flags & kFlagAdaptive) && h.run_words != 0)) {
    v.status = kErrBadHeader;
    return v;
  }
  if (h.num_symbols > d.dst_capacity || (h.num_symbols > 0 && d.dst == 0)) {
    v.status = kErrCapacity;
    return v;
  }
  uint64_t off = sizeof(RansStreamHeader);
  if (h.flags & kFlagAdaptive) {
    if (off + 32 > d.src_bytes) {
      v.status = kErrTruncated;
      return v;
    }
    uint32_t np = 0;
    for (int b = 0; b < 32; ++b) np += static_cast<uint32_t>(__builtin_popcount(src[off + b]));
    const uint64_t tb = adaptive_table_bytes(np);
    if (off + tb > d.src_bytes) {
      v.status = kErrTruncated;
      return v;
    }
    uint32_t idx = 0, sum = 0;
    for (int s = 0; s < 256; ++s) {
      uint16_t f = 0;
      if ((src[off + (s >> 3)] >> (s & 7)) & 1) {
        f = load_u16(src + off + 32 + 2 * idx++);
        if (f == 0) {
          v.status = kErrBadTable;
          return v;
        }
      }
      v.freq[s] = f;
      sum += f;
    }
    if (sum != kProbScale) {
      v.status = kErrBadTable;
      return v;
    }
    off += tb;
  } else if (h.num_symbols > 0 && h.run_words != 0) {
    const uint32_t run_len = 32u * h.run_words;
    const uint64_t runs = run_count(h.num_symbols, run_len);
    if (tables == nullptr || h.table_id + runs > static_cast<uint64_t>(num_tables)) {
      v.status = kErrBadTable;
      return v;
    }
    for (uint64_t r = 0; r < runs; ++r)
      if (!table_valid(tables + 256 * (h.table_id + r))) {
        v.status = kErrBadTable;
        return v;
      }
    v.run_len = run_len;
  } else if (h.num_symbols > 0) {
    if (h.table_id >= num_tables || tables == nullptr) {
      v.status = kErrBadTable;
      return v;
    }
    std::memcpy(v.freq, tables + 256 * static_cast<uint64_t>(h.table_id), sizeof(v.freq));
    if (!table_valid(v.freq)) {
      v.status = kErrBadTable;
      return v;
    }
  }
  v.table_id = h.table_id;
  v.n = h.num_symbols;
  v.seg_log2 = h.seg_log2;
  v.nseg = seg_count(h.num_symbols, h.seg_log2);
  if (off + 4 * v.nseg > d.src_bytes) {
    v.status = kErrTruncated;
    return v;
  }
  v.seg_end = src + off;
  v.payload = src + off + 4 * v.nseg;
  v.avail = d.src_bytes - off - 4 * v.nseg;
  return v;
}

// Writes the stream header (+ adaptive table) at dst; returns bytes written.
uint64_t write_header(uint8_t* dst, uint32_t n, int seg_log2, uint32_t table_id, uint32_t run_len,
                      bool adaptive, const uint16_t* freq) {
  RansStreamHeader h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.flags = adaptive ? kFlagAdaptive : 0;
  h.seg_log2 = static_cast<uint8_t>(seg_log2);
  h.lanes_log2 = kLanesLog2;
  h.table_id = static_cast<uint16_t>(table_id);
  h.run_words = adaptive ? 0 : static_cast<uint16_t>(run_len / kLanes);
  h.num_symbols = n;
  std::memcpy(dst, &h, sizeof(h));
  if (!adaptive) return sizeof(h);
  uint8_t* t = dst + sizeof(h);
  std::memset(t, 0, 32);
  uint32_t np = 0;
  for (int s = 0; s < 256; ++s)
    if (freq[s]) {
      t[s >> 3] |= static_cast<uint8_t>(1u << (s & 7));
      std::memcpy(t + 32 + 2 * np, &freq[s], 2);
      ++np;
    }
  const uint32_t tb = adaptive_table_bytes(np);
  std::memset(t + 32 + 2 * np, 0, tb - 32 - 2 * np);
  return sizeof(h) + tb;
}

uint32_t present_count(const uint16_t* freq) {
  uint32_t np = 0;
  for (int s = 0; s < 256; ++s) np += freq[s] ? 1 : 0;
  return np;
}

}  // namespace

uint64_t encode_scratch_capacity(uint64_t num_streams, uint64_t scratch_bytes, int seg_log2) {
  const EncodeScratchLayout base = encode_scratch_layout(num_streams, 0, seg_log2);
  if (base.total > scratch_bytes) return 0;
  uint64_t m = (scratch_bytes - base.total) / (base.slot_bytes + 12);
  while (m > 0 && encode_scratch_layout(num_streams, m, seg_log2).total > scratch_bytes) --m;
  // the division above ignores the 256-byte alignment of each region, so it may also fall short
  // of what encode_scratch_bytes sized the scratch for: step up while the next count still fits
  while (encode_scratch_layout(num_streams, m + 1, seg_log2).total <= scratch_bytes) ++m;
  return m;
}

void encode_cpu(const RansEncodeDesc* descs, int64_t num_streams, const uint16_t* tables,
                int64_t num_tables, int seg_log2, uint8_t* out, uint64_t out_bytes,
                uint64_t* offsets, int32_t* status, void* scratch, uint64_t scratch_bytes,
                int32_t num_threads) {
  LMTIER_CHECK_ARG(seg_log2 >= kMinSegLog2 && seg_log2 <= kMaxSegLog2,
                   "rans: seg_log2 must be in [", kMinSegLog2, ", ", kMaxSegLog2, "], got ",
                   seg_log2);
  LMTIER_CHECK_ARG(num_streams >= 0 && num_tables >= 0 && num_tables <= 0xFFFF,
                   "rans: bad num_streams / num_tables");
  LMTIER_CHECK_ARG(offsets != nullptr && (num_streams == 0 || (descs && status)),
                   "rans: null descs / offsets / status");
  const uint64_t N = static_cast<uint64_t>(num_streams);
  for (uint64_t i = 0; i <= N; ++i) offsets[i] = 0;
  if (N == 0) return;
  const uint64_t cap = scratch == nullptr ? 0 : encode_scratch_capacity(N, scratch_bytes, seg_log2);
  const EncodeScratchLayout L = encode_scratch_layout(N, cap, seg_log2);
  if (scratch == nullptr || L.total > scratch_bytes) {
    for (uint64_t i = 0; i < N; ++i) status[i] = kErrScratch;
    return;
  }
  uint8_t* sc = static_cast<uint8_t*>(scratch);
  StreamWork* work = reinterpret_cast<StreamWork*>(sc + L.streams);
  uint32_t* hist = reinterpret_cast<uint32_t*>(sc + L.hist);
  uint16_t* afreq = reinterpret_cast<uint16_t*>(sc + L.freq);
  uint32_t* seg_size = reinterpret_cast<uint32_t*>(sc + L.seg_size);
  uint64_t* seg_start = reinterpret_cast<uint64_t*>(sc + L.seg_start);
  uint8_t* slots = sc + L.slots;

  // 1. Validate, assign segments.
  uint64_t total_seg = 0;
  bool ok = true;
  for (uint64_t i = 0; i < N; ++i) {
    const RansEncodeDesc& d = descs[i];
    StreamWork& w = work[i];
    std::memset(&w, 0, sizeof(w));
    int32_t st = kOk;
    if (d.num_symbols > kMaxStreamSymbols)
      st = kErrTooLong;
    else if ((d.num_symbols > 0 && d.src == 0) || !run_len_valid(d.run_len))
      st = kErrBadHeader;
    else if (d.table_id != kAdaptiveTable && d.run_len != 0 && d.num_symbols > 0) {
      const uint64_t runs = run_count(d.num_symbols, d.run_len);
      if (tables == nullptr || d.table_id + runs > static_cast<uint64_t>(num_tables))
        st = kErrBadTable;
      for (uint64_t r = 0; st == kOk && r < runs; ++r)
        if (!table_valid(tables + 256 * (d.table_id + r))) st = kErrBadTable;
    } else if (d.table_id != kAdaptiveTable &&
               (static_cast<int64_t>(d.table_id) >= num_tables || tables == nullptr ||
                !table_valid(tables + 256 * static_cast<uint64_t>(d.table_id))))
      st = kErrBadTable;
    w.status = st;
    w.seg_base = total_seg;
    w.num_segments = st == kOk ? static_cast<uint32_t>(seg_count(d.num_symbols, seg_log2)) : 0;
    w.needs_adaptive = (d.table_id == kAdaptiveTable && d.num_symbols > 0) ? 1 : 0;
    total_seg += w.num_segments;
    ok = ok && st == kOk;
  }
  if (total_seg > L.max_segments) {
    for (uint64_t i = 0; i < N; ++i) status[i] = kErrScratch;
    return;
  }
  if (!ok) {
    for (uint64_t i = 0; i < N; ++i) status[i] = work[i].status;
    return;
  }
  // segment -> stream map (host only)
  std::vector<uint32_t> seg_stream(total_seg);
  for (uint64_t i = 0; i < N; ++i)
    for (uint32_t j = 0; j < work[i].num_segments; ++j)
      seg_stream[work[i].seg_base + j] = static_cast<uint32_t>(i);
  const int threads = pick_threads(num_threads, total_seg);
  const uint32_t seg_len = 1u << seg_log2;
  auto seg_n = [&](uint64_t i, uint32_t j) {
    return static_cast<uint32_t>(
        std::min<uint64_t>(seg_len, descs[i].num_symbols - static_cast<uint64_t>(j) * seg_len));
  };

  // 2. Static tables.
  // (only the tables some stream uses: a table-switching set may hold tens of thousands)
  std::vector<uint32_t> enc_static(static_cast<size_t>(num_tables) * 256);
  {
    std::vector<uint8_t> used(static_cast<size_t>(num_tables), 0);
    for (uint64_t i = 0; i < N; ++i) {
      const RansEncodeDesc& d = descs[i];
      if (d.table_id == kAdaptiveTable || d.num_symbols == 0) continue;
      const uint64_t runs = d.run_len ? run_count(d.num_symbols, d.run_len) : 1;
      std::fill(used.begin() + d.table_id, used.begin() + d.table_id + runs, uint8_t{1});
    }
    parallel_for(static_cast<uint64_t>(num_tables),
                 pick_threads(num_threads, static_cast<uint64_t>(num_tables)), [&](uint64_t t) {
                   if (used[t]) build_enc_table(tables + 256 * t, enc_static.data() + 256 * t);
                 });
  }
  parallel_for(total_seg, threads, [&](uint64_t g) {
    const uint32_t i = seg_stream[g];
    if (__atomic_load_n(&work[i].needs_adaptive, __ATOMIC_RELAXED)) return;
    const uint32_t j = static_cast<uint32_t>(g - work[i].seg_base);
    const uint8_t* src =
        reinterpret_cast<const uint8_t*>(descs[i].src) + static_cast<uint64_t>(j) * seg_len;
    const uint32_t r = encode_segment(
        src, seg_n(i, j), enc_static.data() + 256ull * descs[i].table_id, slots + g * L.slot_bytes,
        descs[i].run_len, static_cast<uint64_t>(j) * seg_len);
    if (r == kMissing) __atomic_store_n(&work[i].needs_adaptive, 1u, __ATOMIC_RELAXED);
    seg_size[g] = r;
  });

  // 3. Adaptive tables for the streams that need them.
  std::vector<uint32_t> flagged;
  for (uint64_t i = 0; i < N; ++i)
    if (work[i].needs_adaptive) flagged.push_back(static_cast<uint32_t>(i));
  if (!flagged.empty()) {
    parallel_for(flagged.size(), pick_threads(num_threads, flagged.size()), [&](uint64_t k) {
      const uint32_t i = flagged[k];
      uint32_t* h = hist + 256ull * i;
      std::fill(h, h + 256, 0u);
      const uint8_t* src = reinterpret_cast<const uint8_t*>(descs[i].src);
      for (uint64_t p = 0; p < descs[i].num_symbols; ++p) ++h[src[p]];
      uint64_t c[256];
      for (int s = 0; s < 256; ++s) c[s] = h[s];
      normalize_counts(c, 0, afreq + 256ull * i);
      work[i].table_bytes = adaptive_table_bytes(present_count(afreq + 256ull * i));
    });
    std::vector<uint64_t> fsegs;
    for (uint32_t i : flagged)
      for (uint32_t j = 0; j < work[i].num_segments; ++j) fsegs.push_back(work[i].seg_base + j);
    parallel_for(fsegs.size(), pick_threads(num_threads, fsegs.size()), [&](uint64_t k) {
      const uint64_t g = fsegs[k];
      const uint32_t i = seg_stream[g];
      const uint32_t j = static_cast<uint32_t>(g - work[i].seg_base);
      uint32_t enc[256];
      build_enc_table(afreq + 256ull * i, enc);
      const uint8_t* src =
          reinterpret_cast<const uint8_t*>(descs[i].src) + static_cast<uint64_t>(j) * seg_len;
      seg_size[g] = encode_segment(src, seg_n(i, j), enc, slots + g * L.slot_bytes);
    });
  }

  // 4. Sizes and offsets.
  seg_start[0] = 0;
  for (uint64_t g = 0; g < total_seg; ++g) seg_start[g + 1] = seg_start[g] + round_up4(seg_size[g]);
  uint64_t off = 0;
  for (uint64_t i = 0; i < N; ++i) {
    StreamWork& w = work[i];
    w.out_offset = off;
    offsets[i] = off;
    const uint64_t payload = seg_start[w.seg_base + w.num_segments] - seg_start[w.seg_base];
    off += sizeof(RansStreamHeader) + w.table_bytes + 4ull * w.num_segments + payload;
  }
  if (off > out_bytes || (off > 0 && out == nullptr)) {
    for (uint64_t i = 0; i < N; ++i) status[i] = kErrOutput;
    for (uint64_t i = 0; i <= N; ++i) offsets[i] = 0;
    return;
  }

  // 5. Write streams.
  parallel_for(N, pick_threads(num_threads, N), [&](uint64_t i) {
    const StreamWork& w = work[i];
    write_header(out + w.out_offset, static_cast<uint32_t>(descs[i].num_symbols), seg_log2,
                 descs[i].table_id, descs[i].run_len, w.table_bytes != 0, afreq + 256ull * i);
  });
  parallel_for(total_seg, threads, [&](uint64_t g) {
    const uint32_t i = seg_stream[g];
    const StreamWork& w = work[i];
    const uint32_t j = static_cast<uint32_t>(g - w.seg_base);
    uint8_t* seg_tab = out + w.out_offset + sizeof(RansStreamHeader) + w.table_bytes;
    uint8_t* payload = seg_tab + 4ull * w.num_segments;
    const uint64_t start = seg_start[g] - seg_start[w.seg_base];
    const uint32_t size = seg_size[g];
    const uint32_t n = seg_n(i, j);
    store_u32(seg_tab + 4ull * j, static_cast<uint32_t>(start + size));
    const uint8_t* from = size == n ? reinterpret_cast<const uint8_t*>(descs[i].src) +
                                          static_cast<uint64_t>(j) * seg_len
                                    : slots + g * L.slot_bytes;
    std::memcpy(payload + start, from, size);
    std::memset(payload + start + size, 0, round_up4(size) - size);
  });
  offsets[N] = off;
  for (uint64_t i = 0; i < N; ++i) status[i] = kOk;
}

void decode_cpu(const RansDecodeDesc* descs, int64_t num_streams, const uint16_t* tables,
                int64_t num_tables, uint64_t* out_lengths, int32_t* status, int32_t num_threads) {
  LMTIER_CHECK_ARG(num_streams >= 0 && num_tables >= 0, "rans: bad num_streams / num_tables");
  LMTIER_CHECK_ARG(num_streams == 0 || (descs && out_lengths && status),
                   "rans: null descs / out_lengths / status");
  const uint64_t N = static_cast<uint64_t>(num_streams);
  std::vector<StreamView> views(N);
  std::vector<uint64_t> seg_base(N + 1, 0);
  for (uint64_t i = 0; i < N; ++i) {
    views[i] = parse_stream(descs[i], tables, num_tables);
    seg_base[i + 1] = seg_base[i] + (views[i].status == kOk ? views[i].nseg : 0);
  }
  const uint64_t total_seg = seg_base[N];
  std::vector<std::atomic<int32_t>> st(N);
  for (uint64_t i = 0; i < N; ++i) st[i].store(views[i].status, std::memory_order_relaxed);
  // decode tables per stream, built once
  std::vector<std::vector<uint32_t>> dec(N);
  parallel_for(N, pick_threads(num_threads, N), [&](uint64_t i) {
    if (views[i].status == kOk && views[i].nseg > 0 && views[i].run_len == 0) {
      dec[i].resize(kProbScale);
      build_dec_table(views[i].freq, dec[i].data());
    }
  });
  parallel_for(total_seg, pick_threads(num_threads, total_seg), [&](uint64_t g) {
    const uint64_t i = static_cast<uint64_t>(std::upper_bound(seg_base.begin(), seg_base.end(), g) -
                                             seg_base.begin()) -
                       1;
    const StreamView& v = views[i];
    const uint64_t j = g - seg_base[i];
    const uint64_t seg_len = 1ull << v.seg_log2;
    const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(seg_len, v.n - j * seg_len));
    const uint64_t start = j == 0 ? 0 : round_up4(load_u32(v.seg_end + 4 * (j - 1)));
    const uint64_t end = load_u32(v.seg_end + 4 * j);
    int32_t r = kOk;
    uint8_t* dst = reinterpret_cast<uint8_t*>(descs[i].dst) + j * seg_len;
    if (start > end || end > v.avail) {
      r = kErrBadSegment;
    } else {
      const uint64_t size = end - start;
      if (size == n)
        std::memcpy(dst, v.payload + start, n);
      else if (size < n && size >= kStateBytes && (size - kStateBytes) % 2 == 0)
        r = v.run_len ? decode_segment_runs(v.payload + start, static_cast<uint32_t>(size), n,
                                            tables, v.table_id, v.run_len, j * seg_len, dst)
                      : decode_segment(v.payload + start, static_cast<uint32_t>(size), n,
                                       dec[i].data(), dst);
      else
        r = kErrBadSegment;
    }
    if (r != kOk) {
      int32_t expected = kOk;
      st[i].compare_exchange_strong(expected, r);
    }
  });
  for (uint64_t i = 0; i < N; ++i) {
    status[i] = st[i].load();
    out_lengths[i] = status[i] == kOk ? views[i].n : 0;
  }
}

}  // namespace rans
}  // namespace lmtier
