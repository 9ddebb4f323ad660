// lmtier — one PCA record's CUDA decode queued by the host in one call (see DecodeRecordArgs in
// lmtier/pca.h): the ~20 launches, memsets and event operations that lmtier/codec/pca/kernels.py
// and streams.py queue one Python call at a time, here without the interpreter between them.
// Compiled by the host compiler, CUDA builds only.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "lmtier/common.h"
#include "lmtier/int8_gemm.h"
#include "lmtier/pca.h"
#include "lmtier/rans.h"

namespace lmtier {
namespace pca {
namespace {

// Side streams of one device, a process-wide pool handed out round robin (bounded whatever the
// number of threads; created at first use, never destroyed: a thread may be inside decode_record
// while exit() runs the static destructors). Two calls given the same stream run in turn: the
// events keep every order.
constexpr int kSideStreams = 8;

cudaStream_t side_stream(int device) {
  static std::mutex& m = *new std::mutex;
  static auto& pools = *new std::vector<std::vector<cudaStream_t>>;
  static auto& next = *new std::vector<unsigned>;
  std::lock_guard<std::mutex> g(m);
  if (static_cast<size_t>(device) >= pools.size()) {
    pools.resize(device + 1);
    next.resize(device + 1, 0);
  }
  auto& pool = pools[device];
  if (pool.size() < kSideStreams) {
    cudaStream_t st = nullptr;
    LMTIER_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    pool.push_back(st);
    return st;
  }
  return pool[next[device]++ % kSideStreams];
}

// An event of one call (destroying it while recorded work is pending is allowed: its resources go
// once that work ran).
struct Event {
  cudaEvent_t e = nullptr;
  Event() { LMTIER_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(e); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// The rANS calls of the record's streams: call k takes streams [k B, (k + 1) B) and their tables
// (its table ids are relative to its slice, lmtier/codec/pca/streams.py's table_base). A call lasts
// as long as one warp's work on its longest segment however few streams it has, so the calls run
// side by side: call 0 on `stream`, the others on side streams that start after the work queued so
// far on `stream` and that `stream` waits for (also when a launch throws).
void decode_streams(const DecodeRecordArgs& a) {
  const int64_t b = a.streams_per_call, n = a.tables_per_stream;
  const int64_t calls = (a.num_streams + b - 1) / b;
  auto* descs = static_cast<const rans::RansDecodeDesc*>(a.descs);
  auto* main = static_cast<cudaStream_t>(a.stream);
  auto launch = [&](int64_t k, cudaStream_t st) {
    const int64_t lo = k * b, count = std::min(b, a.num_streams - lo), first = lo * n;
    // the call's slice of the bitmap when it starts at a whole word (else the call checks them)
    const uint32_t* ok = a.tables_ok && first % 32 == 0 ? a.tables_ok + first / 32 : nullptr;
    rans::decode_cuda(descs + lo, count, a.tables + 256 * first, count * n,
                      a.run_luts ? a.run_luts + rans::kRunLutBytes * first : nullptr, ok,
                      a.counts + lo, a.status + lo, a.scratch + k * a.scratch_bytes,
                      a.scratch_bytes, st);
  };
  if (calls <= 1) {
    if (calls == 1) launch(0, main);
    return;
  }
  int device = 0;
  LMTIER_CUDA_CHECK(cudaGetDevice(&device));
  std::vector<cudaStream_t> side(calls - 1);
  for (auto& x : side) x = side_stream(device);
  Event forked;
  LMTIER_CUDA_CHECK(cudaEventRecord(forked.e, main));
  for (auto x : side) LMTIER_CUDA_CHECK(cudaStreamWaitEvent(x, forked.e, 0));
  std::exception_ptr failed;
  int64_t launched = 0;  // side streams that may hold work of this call
  try {
    launch(0, main);
    for (int64_t k = 1; k < calls; ++k, ++launched) launch(k, side[k - 1]);
  } catch (...) {
    failed = std::current_exception();
    launched = calls - 1;  // a call that threw may have queued part of its work
  }
  cudaError_t join_err = cudaSuccess;  // every side stream joined, the first error kept
  for (int64_t k = 0; k < launched; ++k) {
    Event joined;
    cudaError_t e = cudaEventRecord(joined.e, side[k]);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(main, joined.e, 0);
    if (e != cudaSuccess && join_err == cudaSuccess) join_err = e;
  }
  if (failed) std::rethrow_exception(failed);
  LMTIER_CUDA_CHECK(join_err);
}

}  // namespace

void decode_record(const DecodeRecordArgs& a) {
  const PcaGeometry& g = a.g;
  check_geometry(g, a.cos_t != nullptr);
  LMTIER_CHECK_ARG(g.T > 0 && a.t32 >= g.T && a.t32 % 32 == 0, "decode_record: T ", g.T, ", t32 ",
                   a.t32);
  LMTIER_CHECK_ARG(a.num_streams == 2 * int64_t{g.R()} && a.streams_per_call > 0 &&
                       a.tables_per_stream == g.N() &&
                       a.streams_per_call * a.tables_per_stream <= rans::kAdaptiveTable,
                   "decode_record: ", a.num_streams, " streams of ", a.tables_per_stream,
                   " tables, ", a.streams_per_call, " a call, for R ", g.R(), " N ", g.N());
  LMTIER_CHECK_ARG(
      a.num_escapes == 0 || (a.num_escapes > 0 && a.escapes != nullptr && a.esc_col != nullptr &&
                             a.esc_hi != nullptr && a.esc_scratch != nullptr),
      "decode_record: ", a.num_escapes, " escapes without their buffers");
  LMTIER_CHECK_ARG(a.groups_per_batch > 0 && a.p8 > 0 && a.p8 % 4 == 0,
                   "decode_record: groups_per_batch ", a.groups_per_batch, ", p8 ", a.p8);
  LMTIER_CHECK_ARG(a.scratch_bytes >= rans::decode_scratch_bytes(a.streams_per_call),
                   "decode_record: ", a.scratch_bytes, " scratch bytes a call, the coder needs ",
                   rans::decode_scratch_bytes(a.streams_per_call));
  auto* st = static_cast<cudaStream_t>(a.stream);
  const int32_t R = g.R(), T = g.T, N8 = g.N8();
  LMTIER_CUDA_CHECK(cudaMemsetAsync(a.esc_count, 0, sizeof(int32_t), st));
  LMTIER_CUDA_CHECK(cudaMemsetAsync(a.esc_row, 0, sizeof(int32_t) * (size_t{2} * R * T + 1), st));
  decode_streams(a);
  decode_pre_symbols(g, a.sym, a.t32, a.lo, a.rowsum, a.esc_count, a.stream);
  if (a.num_escapes > 0)
    decode_escapes(g, a.sym, a.t32, a.escapes, a.num_escapes, a.lo, a.rowsum, a.esc_row, a.esc_col,
                   a.esc_hi, a.esc_scratch, a.stream);
  const size_t elem = 2;                     // bf16 / fp16
  const size_t mat = size_t{2} * a.p8 * N8;  // one (layer group, K/V)'s [2 P8][N8] of dcat
  for (int32_t r0 = 0; r0 < R; r0 += a.groups_per_batch) {
    const int32_t r1 = std::min(R, r0 + a.groups_per_batch);
    const PcaGeometry sub{(r1 - r0) * g.G, T, g.H, g.D, g.G};
    igemm::bgemm_s8(2 * (r1 - r0), T, N8, 2 * a.p8, a.lo + size_t{2} * r0 * T * N8,
                    a.dcat + 2 * r0 * mat, a.y, a.gemm_workspace, a.gemm_workspace_bytes, a.stream);
    decode_post(a.dtype, sub, a.y, a.rowsum + size_t{2} * r0 * T, a.esc_row + size_t{2} * r0 * T,
                a.esc_col, a.esc_hi, a.dcat + 2 * r0 * mat, a.f + size_t{2} * r0 * g.N(),
                a.mu + size_t{2} * r0 * g.N(), a.cos_t, a.sin_t,
                static_cast<char*>(a.out) + elem * r0 * g.G * 2 * T * g.H * g.D, a.stream);
  }
}

}  // namespace pca
}  // namespace lmtier
