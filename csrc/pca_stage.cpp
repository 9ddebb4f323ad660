// lmtier — the host's part of one PCA record's CUDA decode (lmtier::pca::decode_record_staged in
// lmtier/pca.h): page-locked staging blocks from a process-wide pool, the coder's descriptors built
// and the payload copied into one, one upload, decode_record, the exact tokens put in place and the
// checks copied back, with the GIL released by the binding for all of it. Python used to do each
// of these steps as a torch or NumPy call under the GIL (lmtier/codec/pca/native_decode.py).
// Compiled by the host compiler, CUDA builds only.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "lmtier/common.h"
#include "lmtier/pca.h"
#include "lmtier/rans.h"

namespace lmtier {
namespace pca {
namespace {

// A page-locked block (portable: any device may copy from it) and the event recorded after the
// last copy that uses it. `held` while a Stage owns it; reused once not held and the event passed
// (an event never recorded counts as passed).
struct Block {
  uint8_t* host = nullptr;
  size_t bytes = 0;
  int device = 0;
  cudaEvent_t done = nullptr;
  bool held = false;
};

constexpr size_t kMinBlock = size_t{1} << 20;
constexpr size_t kMaxBlock = size_t{1} << 34;

// Blocks are never freed (cudaFreeHost synchronizes the device): their number is the most records
// decoded at once, their sizes powers of two. Created at first use and never destroyed, as the
// side streams of csrc/pca_decode.cpp.
struct Pool {
  std::mutex m;
  std::vector<Block*> blocks;

  Block* acquire(int device, size_t need) {
    std::lock_guard<std::mutex> g(m);
    Block* best = nullptr;
    for (Block* b : blocks) {
      if (b->held || b->device != device || b->bytes < need) continue;
      if (best != nullptr && b->bytes >= best->bytes) continue;
      const cudaError_t q = cudaEventQuery(b->done);
      if (q == cudaErrorNotReady) {  // not an error: cleared, or the next launch check would see it
        (void)cudaGetLastError();
        continue;
      }
      LMTIER_CUDA_CHECK(q);
      best = b;
    }
    if (best == nullptr) {
      LMTIER_CHECK_ARG(need <= kMaxBlock, "decode_record: a staging block of ", need,
                       " bytes (at most ", kMaxBlock, ")");
      size_t bytes = kMinBlock;
      while (bytes < need) bytes *= 2;
      auto b = std::make_unique<Block>();
      LMTIER_CUDA_CHECK(
          cudaHostAlloc(reinterpret_cast<void**>(&b->host), bytes, cudaHostAllocPortable));
      const cudaError_t e = cudaEventCreateWithFlags(&b->done, cudaEventDisableTiming);
      if (e != cudaSuccess) {
        cudaFreeHost(b->host);
        LMTIER_CUDA_CHECK(e);
      }
      b->bytes = bytes;
      b->device = device;
      blocks.push_back(b.get());
      best = b.release();
    }
    best->held = true;
    return best;
  }

  void release(Block* b) {
    std::lock_guard<std::mutex> g(m);
    b->held = false;
  }
};

Pool& pool() {
  static Pool& p = *new Pool;
  return p;
}

uint64_t up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

std::pair<size_t, size_t> stage_pool_stats() {
  Pool& p = pool();
  std::lock_guard<std::mutex> g(p.m);
  size_t bytes = 0;
  for (const Block* b : p.blocks) bytes += b->bytes;
  return {p.blocks.size(), bytes};
}

Stage::~Stage() {
  if (block_ != nullptr) pool().release(static_cast<Block*>(block_));
}

std::unique_ptr<Stage> decode_record_staged(DecodeRecordArgs a, const StageArgs& s) {
  const int64_t n = a.num_streams;
  LMTIER_CHECK_ARG(n > 0 && s.n_exact >= 0 && s.n_exact <= a.g.T && s.upload != nullptr &&
                       s.checks != nullptr && a.sym != nullptr,
                   "decode_record: ", n, " streams, ", s.n_exact, " exact tokens of T = ", a.g.T);
  // the checks: int32 status [n] (256-aligned), int64 counts [n], int32 escape count
  const uint64_t checks_bytes = up(4 * static_cast<uint64_t>(n), 256) + 8 * n + 4;
  LMTIER_CHECK_ARG(s.checks_bytes == checks_bytes, "decode_record: ", s.checks_bytes,
                   " bytes of checks, ", checks_bytes, " for ", n, " streams");
  uint64_t used = 0;
  for (int64_t i = 0; i < n + 3; ++i) {
    LMTIER_CHECK_ARG(s.offs[i] >= 0 && s.lens[i] >= 0 && s.offs[i] % 4 == 0 &&
                         static_cast<uint64_t>(s.offs[i] + s.lens[i]) <= s.payload_bytes,
                     "decode_record: section ", i, " [", s.offs[i], ", +", s.lens[i],
                     ") outside the payload of ", s.payload_bytes, " bytes or not 4-byte aligned");
    used = std::max(used, static_cast<uint64_t>(s.offs[i] + s.lens[i]));
  }
  for (int32_t e = 0; e < s.n_exact; ++e)
    LMTIER_CHECK_ARG(s.exact_idx[e] >= (e ? s.exact_idx[e - 1] + 1 : 0) && s.exact_idx[e] < a.g.T,
                     "decode_record: exact token index ", e, " is ", s.exact_idx[e],
                     ": indices must rise within [0, ", a.g.T, ")");
  const uint64_t desc_bytes = sizeof(rans::RansDecodeDesc) * n;
  const uint64_t exact_bytes = sizeof(int64_t) * s.n_exact;
  LMTIER_CHECK_ARG(s.payload_at >= desc_bytes && s.payload_at % 16 == 0 &&
                       s.idx_at >= s.payload_at + used && s.idx_at % 8 == 0 &&
                       s.idx_at <= s.payload_at + used + 8,
                   "decode_record: payload at ", s.payload_at, ", index at ", s.idx_at, " for ",
                   desc_bytes, " bytes of descriptors and ", used, " of payload");
  const int64_t raw = static_cast<int64_t>(s.n_exact) * a.g.L * 2 * a.g.H * a.g.D * 2;
  LMTIER_CHECK_ARG(s.lens[n + 2] == raw, "decode_record: ", s.n_exact,
                   " exact tokens in a section of ", s.lens[n + 2], " bytes, ", raw, " expected");
  const uint64_t upload_bytes = s.idx_at + exact_bytes;
  const uint64_t checks_at = up(upload_bytes, 256);
  int device = 0;
  LMTIER_CUDA_CHECK(cudaGetDevice(&device));
  Block* b = pool().acquire(device, checks_at + s.checks_bytes);
  std::unique_ptr<Stage> stage;
  try {
    stage.reset(new Stage(b, b->host + checks_at, s.checks_bytes));
  } catch (...) {
    pool().release(b);
    throw;
  }
  auto* descs = reinterpret_cast<rans::RansDecodeDesc*>(b->host);
  const uint64_t length = static_cast<uint64_t>(a.tables_per_stream) * a.t32;
  const uint64_t payload_dev = reinterpret_cast<uint64_t>(s.upload) + s.payload_at;
  for (int64_t i = 0; i < n; ++i)
    descs[i] = {payload_dev + static_cast<uint64_t>(s.offs[i]), static_cast<uint64_t>(s.lens[i]),
                reinterpret_cast<uint64_t>(a.sym) + length * static_cast<uint64_t>(i), length};
  std::memcpy(b->host + s.payload_at, s.payload, used);
  if (s.n_exact) std::memcpy(b->host + s.idx_at, s.exact_idx, exact_bytes);
  auto* st = static_cast<cudaStream_t>(a.stream);
  a.descs = s.upload;
  try {
    LMTIER_CUDA_CHECK(cudaMemcpyAsync(s.upload, b->host, upload_bytes, cudaMemcpyHostToDevice, st));
    decode_record(a);
    scatter_exact_tokens(a.g, reinterpret_cast<const int64_t*>(s.upload + s.idx_at), s.n_exact,
                         s.upload + s.payload_at + s.offs[n + 2], a.out, a.stream);
    LMTIER_CUDA_CHECK(
        cudaMemcpyAsync(b->host + checks_at, s.checks, s.checks_bytes, cudaMemcpyDeviceToHost, st));
  } catch (...) {
    if (cudaEventRecord(b->done, st) != cudaSuccess) stage->keep();  // waits for what was queued
    throw;
  }
  const cudaError_t e = cudaEventRecord(b->done, st);
  if (e != cudaSuccess) stage->keep();  // never reused: copies into it may be pending
  LMTIER_CUDA_CHECK(e);
  return stage;
}

}  // namespace pca
}  // namespace lmtier
