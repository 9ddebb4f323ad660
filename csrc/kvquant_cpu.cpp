// lmtier — multi-threaded CPU KV quantize / dequantize, bit-exact with the torch reference
// (lmtier/codec/quant.py) and the CUDA kernels (kvquant_cuda.cu). Rules and layouts: kvquant.h.
//
// Work unit: one (chunk, layer, plane, head) = T rows of D values; threads take units from an
// atomic counter. Built with -ffp-contract=off and without -ffast-math (CMakeLists.txt): every fp32
// op is a single IEEE operation in the default rounding mode (std::rint = round half to even).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "lmtier/common.h"
#include "lmtier/kvquant.h"
#include "lmtier/parallel.h"

namespace lmtier {
namespace kvq {
namespace {

inline float f32_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t bits_from_f32(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  if (exp == 0x1F) return f32_from_bits(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return f32_from_bits(sign);
  // subnormal: mant * 2^-24, normalize
  int e = 113;  // biased fp32 exponent of 2^-14
  while ((mant & 0x400) == 0) {
    mant <<= 1;
    --e;
  }
  return f32_from_bits(sign | (static_cast<uint32_t>(e) << 23) | ((mant & 0x3FF) << 13));
}

// Round-to-nearest-even casts (what torch's .to(bfloat16/float16) and __float2*_rn do).
inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = bits_from_f32(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

inline uint16_t f32_to_fp16(float f) {
  uint32_t x = bits_from_f32(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00;   // NaN
  if (x >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to inf (and inf)
  if (x >= 0x38800000u) {                      // normal half
    const uint32_t r = x - (112u << 23);
    return sign | static_cast<uint16_t>((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  }
  if (x < 0x33000000u) return sign;  // below 2^-25 (ties to even at 2^-25 -> 0)
  const uint32_t e = x >> 23;        // 102..112
  const uint32_t m = (x & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14..24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

// Unnormalized FWHT in the reference's stage order (one fp32 add / subtract per output).
inline void fwht(float* y, int d) {
  for (int h = 1; h < d; h <<= 1)
    for (int i = 0; i < d; ++i)
      if ((i & h) == 0) {
        const float a = y[i], b = y[i + h];
        y[i] = a + b;
        y[i + h] = a - b;
      }
}

inline bool is_finite_bits(uint32_t b) { return (b & 0x7F800000u) != 0x7F800000u; }

// One (chunk, layer, plane, head): quantize T rows.
int32_t quantize_unit(int32_t dtype, const KvqGeometry& g, const uint16_t* chunk, uint8_t* symbols,
                      uint8_t* side, int l, int p, int hd, int qmax, float* y) {
  const int T = g.num_tokens, H = g.num_heads, D = g.head_size;
  const uint64_t lp = static_cast<uint64_t>(l) * 2 + p;
  const uint16_t* in = chunk + lp * T * H * D + static_cast<uint64_t>(hd) * D;  // + t*H*D + d
  uint8_t* sym = symbols + (lp * H + hd) * static_cast<uint64_t>(D) * T;        // + d*T + t
  uint8_t* codes = side + (lp * H + hd) * static_cast<uint64_t>(T);             // + t
  const float fq = static_cast<float>(qmax);
  int32_t st = kOk;
  for (int t = 0; t < T; ++t) {
    const uint16_t* row = in + static_cast<uint64_t>(t) * H * D;
    for (int d = 0; d < D; ++d) y[d] = dtype == kBF16 ? bf16_to_f32(row[d]) : fp16_to_f32(row[d]);
    for (int d = 0; d < D; ++d)
      if (!is_finite_bits(bits_from_f32(y[d]))) st |= kErrNonFinite;
    fwht(y, D);
    float a = 0.0f;
    bool finite = true;
    for (int d = 0; d < D; ++d) {
      const float v = std::fabs(y[d]);
      finite = finite && is_finite_bits(bits_from_f32(v));
      a = v > a ? v : a;
    }
    int32_t code = finite ? scale_code_ceil_bits(bits_from_f32(a / fq)) : -1;
    if (code < 0) {
      st |= kErrScaleRange;
      code = 0;
    }
    codes[t] = static_cast<uint8_t>(code);
    const float s = f32_from_bits(scale_value_bits(static_cast<uint32_t>(code)));
    for (int d = 0; d < D; ++d) {
      float q = 0.0f;
      if (code != 0) {
        q = std::rint(y[d] / s);
        q = q < -fq ? -fq : (q > fq ? fq : q);
      }
      sym[static_cast<uint64_t>(d) * T + t] = static_cast<uint8_t>(static_cast<int32_t>(q) + qmax);
    }
  }
  return st;
}

int32_t dequantize_unit(int32_t dtype, const KvqGeometry& g, uint16_t* chunk,
                        const uint8_t* symbols, const uint8_t* side, int l, int p, int hd, int qmax,
                        float* y) {
  const int T = g.num_tokens, H = g.num_heads, D = g.head_size;
  const uint64_t lp = static_cast<uint64_t>(l) * 2 + p;
  uint16_t* out = chunk + lp * T * H * D + static_cast<uint64_t>(hd) * D;
  const uint8_t* sym = symbols + (lp * H + hd) * static_cast<uint64_t>(D) * T;
  const uint8_t* codes = side + (lp * H + hd) * static_cast<uint64_t>(T);
  const float inv_d = 1.0f / static_cast<float>(D);  // exact: D is a power of two
  int32_t st = kOk;
  for (int t = 0; t < T; ++t) {
    const float s = f32_from_bits(scale_value_bits(codes[t]));
    for (int d = 0; d < D; ++d) {
      const int sv = sym[static_cast<uint64_t>(d) * T + t];
      if (sv > 2 * qmax) st |= kErrSymbol;
      y[d] = static_cast<float>(sv - qmax) * s;
    }
    fwht(y, D);
    uint16_t* row = out + static_cast<uint64_t>(t) * H * D;
    for (int d = 0; d < D; ++d) {
      const float v = y[d] * inv_d;
      row[d] = dtype == kBF16 ? f32_to_bf16(v) : f32_to_fp16(v);
    }
  }
  return st;
}

void lossless_unit(bool encode, const KvqGeometry& g, uint16_t* chunk, uint8_t* hi, uint8_t* lo,
                   int l, int p, int hd) {
  const int T = g.num_tokens, H = g.num_heads, D = g.head_size;
  const uint64_t lp = static_cast<uint64_t>(l) * 2 + p;
  uint16_t* x = chunk + lp * T * H * D + static_cast<uint64_t>(hd) * D;
  const uint64_t so = (lp * H + hd) * static_cast<uint64_t>(D) * T;
  for (int t = 0; t < T; ++t) {
    uint16_t* row = x + static_cast<uint64_t>(t) * H * D;
    for (int d = 0; d < D; ++d) {
      const uint64_t i = so + static_cast<uint64_t>(d) * T + t;
      if (encode) {
        const uint32_t u = row[d];
        const uint32_t r = ((u << 1) | (u >> 15)) & 0xFFFFu;
        hi[i] = static_cast<uint8_t>(r >> 8);
        lo[i] = static_cast<uint8_t>(r & 0xFF);
      } else {
        const uint32_t r = (static_cast<uint32_t>(hi[i]) << 8) | lo[i];
        row[d] = static_cast<uint16_t>(((r >> 1) | ((r & 1u) << 15)) & 0xFFFFu);
      }
    }
  }
}

void run(bool encode, int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
         int64_t num_chunks, const uint8_t* qmax, int32_t* status, int32_t num_threads) {
  check_args(mode, dtype, g, num_chunks, chunks, qmax, status, /*on_cuda=*/false);
  for (int64_t c = 0; c < num_chunks; ++c) status[c] = kOk;
  if (num_chunks == 0 || g.num_tokens == 0) return;
  const uint64_t per_chunk = 2ull * g.num_layers * g.num_heads;
  const uint64_t units = per_chunk * static_cast<uint64_t>(num_chunks);
  std::vector<std::atomic<int32_t>> st(static_cast<size_t>(num_chunks));
  for (auto& s : st) s.store(0);
  const int threads = pick_threads(num_threads, units);
  parallel_for(units, threads, [&](uint64_t u) {
    thread_local std::vector<float> y;
    if (y.size() < static_cast<size_t>(g.head_size)) y.resize(g.head_size);
    const uint64_t c = u / per_chunk;
    const uint64_t r = u % per_chunk;
    const int hd = static_cast<int>(r % g.num_heads);
    const int lp = static_cast<int>(r / g.num_heads);
    const int l = lp >> 1, p = lp & 1;
    const KvqChunkDesc& cd = chunks[c];
    auto* x = reinterpret_cast<uint16_t*>(cd.chunk);
    auto* sym = reinterpret_cast<uint8_t*>(cd.symbols);
    auto* side = reinterpret_cast<uint8_t*>(cd.side);
    int32_t s = kOk;
    if (mode == kModeLossless) {
      lossless_unit(encode, g, x, sym, side, l, p, hd);
    } else if (encode) {
      s = quantize_unit(dtype, g, x, sym, side, l, p, hd, qmax[lp], y.data());
    } else {
      s = dequantize_unit(dtype, g, x, sym, side, l, p, hd, qmax[lp], y.data());
    }
    if (s) st[c].fetch_or(s);
  });
  for (int64_t c = 0; c < num_chunks; ++c) status[c] = st[c].load();
}

}  // namespace

void check_args(int32_t mode, int32_t dtype, const KvqGeometry& g, int64_t num_chunks,
                const void* chunks, const uint8_t* qmax, const int32_t* status, bool on_cuda) {
  LMTIER_CHECK_ARG(mode == kModeLossless || mode == kModeHadamardRow, "kvquant: unknown mode ",
                   mode);
  LMTIER_CHECK_ARG(dtype == kBF16 || dtype == kFP16, "kvquant: unknown dtype ", dtype);
  LMTIER_CHECK_ARG(num_chunks >= 0, "kvquant: num_chunks must be >= 0");
  LMTIER_CHECK_ARG(g.num_layers >= 1 && g.num_layers <= kMaxLayers,
                   "kvquant: num_layers must be in [1, ", kMaxLayers, "], got ", g.num_layers);
  LMTIER_CHECK_ARG(g.num_tokens >= 0 && g.num_heads >= 1 && g.head_size >= 1,
                   "kvquant: bad geometry T=", g.num_tokens, " H=", g.num_heads,
                   " D=", g.head_size);
  LMTIER_CHECK_ARG(chunk_elems(g) < (1ull << 40), "kvquant: chunk too large");
  const int D = g.head_size;
  const bool pow2 = (D & (D - 1)) == 0;
  if (on_cuda) {
    LMTIER_CHECK_ARG(D == 32 || D == 64 || D == 128 || D == 256,
                     "kvquant (CUDA): head_size must be 32, 64, 128 or 256, got ", D);
    LMTIER_CHECK_ARG(num_chunks <= (1ll << 31) - 1, "kvquant (CUDA): too many chunks");
  } else if (mode != kModeLossless) {
    LMTIER_CHECK_ARG(pow2 && D <= 1024,
                     "kvquant: quantized levels need a power-of-two head_size <= 1024, got ", D,
                     " (use lossless)");
  }
  LMTIER_CHECK_ARG(num_chunks == 0 || (chunks != nullptr && status != nullptr),
                   "kvquant: null pointer");
  if (mode != kModeLossless) {
    LMTIER_CHECK_ARG(qmax != nullptr, "kvquant: quantized modes need the qmax table");
    for (int i = 0; i < 2 * g.num_layers; ++i)
      LMTIER_CHECK_ARG(qmax[i] >= 1 && qmax[i] <= 127, "kvquant: qmax[", i / 2, "][", i % 2,
                       "] must be in [1, 127], got ", static_cast<int>(qmax[i]));
  }
}

void quantize_cpu(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                  int64_t num_chunks, const uint8_t* qmax, int32_t* status, int32_t num_threads) {
  run(true, mode, dtype, g, chunks, num_chunks, qmax, status, num_threads);
}

void dequantize_cpu(int32_t mode, int32_t dtype, const KvqGeometry& g, const KvqChunkDesc* chunks,
                    int64_t num_chunks, const uint8_t* qmax, int32_t* status, int32_t num_threads) {
  run(false, mode, dtype, g, chunks, num_chunks, qmax, status, num_threads);
}

}  // namespace kvq
}  // namespace lmtier
