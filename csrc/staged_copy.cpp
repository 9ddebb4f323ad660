// lmtier — StagedCopier (see staged_copy.h).
#ifdef LMTIER_WITH_CUDA
#include "lmtier/staged_copy.h"

#include <algorithm>

#include "lmtier/common.h"

namespace lmtier {

StagedCopier::StagedCopier(const PagedKVDesc& desc, int64_t tokens_per_chunk,
                           int32_t layers_per_piece, int32_t ring_slots, int32_t vec_bytes,
                           void* kernel_stream, void* copy_stream)
    : desc_(desc),
      tokens_(tokens_per_chunk),
      vec_bytes_(vec_bytes),
      ring_(ring_slots),
      kernel_stream_(static_cast<cudaStream_t>(kernel_stream)),
      copy_stream_(static_cast<cudaStream_t>(copy_stream)) {
  validate_desc(desc, tokens_per_chunk, vec_bytes);
  LMTIER_CHECK_ARG(tokens_per_chunk > 0, "tokens_per_chunk must be > 0");
  LMTIER_CHECK_ARG(layers_per_piece >= 1 && layers_per_piece <= desc.num_layers,
                   "layers_per_piece must be in [1, num_layers], got ", layers_per_piece);
  LMTIER_CHECK_ARG(ring_slots >= 2, "ring_slots must be >= 2, got ", ring_slots);
  LMTIER_CHECK_ARG(kernel_stream != nullptr && copy_stream != nullptr,
                   "StagedCopier needs two non-default streams");
  chunk_bytes_ = canonical_chunk_bytes(desc, tokens_per_chunk);
  layer_bytes_ = chunk_bytes_ / desc.num_layers;
  for (int32_t l0 = 0; l0 < desc.num_layers; l0 += layers_per_piece)
    pieces_.push_back({l0, std::min(layers_per_piece, desc.num_layers - l0)});
  piece_bytes_ = static_cast<int64_t>(layers_per_piece) * layer_bytes_;
  LMTIER_CUDA_CHECK(cudaGetDevice(&device_));
  LMTIER_CUDA_CHECK(
      cudaMalloc(reinterpret_cast<void**>(&staging_), static_cast<size_t>(piece_bytes_) * ring_));
  LMTIER_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ring_ptrs_), sizeof(uint64_t) * ring_));
  std::vector<uint64_t> addrs(ring_);
  for (int32_t r = 0; r < ring_; ++r)
    addrs[r] = reinterpret_cast<uint64_t>(staging_ + r * piece_bytes_);
  LMTIER_CUDA_CHECK(
      cudaMemcpy(ring_ptrs_, addrs.data(), sizeof(uint64_t) * ring_, cudaMemcpyHostToDevice));
  free_.resize(ring_);
  filled_.resize(ring_);
  for (int32_t r = 0; r < ring_; ++r) {
    LMTIER_CUDA_CHECK(cudaEventCreateWithFlags(&free_[r], cudaEventDisableTiming));
    LMTIER_CUDA_CHECK(cudaEventCreateWithFlags(&filled_[r], cudaEventDisableTiming));
  }
}

StagedCopier::~StagedCopier() {
  // Pending copies may still use the ring: wait for both streams before freeing.
  cudaStreamSynchronize(kernel_stream_);
  cudaStreamSynchronize(copy_stream_);
  for (auto e : free_) cudaEventDestroy(e);
  for (auto e : filled_) cudaEventDestroy(e);
  cudaFree(ring_ptrs_);
  cudaFree(staging_);
}

void StagedCopier::store(const int64_t* slots, const std::vector<uintptr_t>& host) {
  run(CopyDirection::kGather, slots, host);
}

void StagedCopier::load(const int64_t* slots, const std::vector<uintptr_t>& host) {
  run(CopyDirection::kScatter, slots, host);
}

void StagedCopier::load_pieces(const int64_t* slots, const std::vector<uintptr_t>& host,
                               int32_t piece_begin, int32_t piece_end) {
  LMTIER_CHECK_ARG(0 <= piece_begin && piece_begin <= piece_end && piece_end <= num_pieces(),
                   "piece range [", piece_begin, ", ", piece_end, ") outside [0, ", num_pieces(),
                   "]");
  for (size_t c = 0; c < host.size(); ++c)
    LMTIER_CHECK_ARG(host[c] != 0, "host chunk ", c, " is null");
  DeviceGuard guard(device_);
  for (int32_t p = piece_begin; p < piece_end; ++p)
    for (size_t c = 0; c < host.size(); ++c)
      copy_piece(CopyDirection::kScatter, slots, host, c, pieces_[p]);
}

void StagedCopier::run(CopyDirection dir, const int64_t* slots,
                       const std::vector<uintptr_t>& host) {
  for (size_t c = 0; c < host.size(); ++c)
    LMTIER_CHECK_ARG(host[c] != 0, "host chunk ", c, " is null");
  DeviceGuard guard(device_);
  for (size_t c = 0; c < host.size(); ++c)
    for (const Piece& p : pieces_) copy_piece(dir, slots, host, c, p);
}

StagedCopier::DeviceGuard::DeviceGuard(int device) : device_(device) {
  LMTIER_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device_) LMTIER_CUDA_CHECK(cudaSetDevice(device_));
}

StagedCopier::DeviceGuard::~DeviceGuard() {
  if (prev_ != device_) cudaSetDevice(prev_);
}

void StagedCopier::copy_piece(CopyDirection dir, const int64_t* slots,
                              const std::vector<uintptr_t>& host, size_t c, const Piece& p) {
  const bool gather = dir == CopyDirection::kGather;
  // The stream that consumes a ring slot last frees it: the copy stream for stores, the kernel
  // stream for loads.
  cudaStream_t producer = gather ? kernel_stream_ : copy_stream_;
  cudaStream_t consumer = gather ? copy_stream_ : kernel_stream_;
  const int32_t r = next_;
  next_ = (next_ + 1) % ring_;
  const int64_t nbytes = static_cast<int64_t>(p.num_layers) * layer_bytes_;
  uint8_t* stage = staging_ + r * piece_bytes_;
  uint8_t* hostp = reinterpret_cast<uint8_t*>(host[c]) + p.first_layer * layer_bytes_;
  LMTIER_CUDA_CHECK(cudaStreamWaitEvent(producer, free_[r], 0));
  PagedKVDesc sub = desc_;
  sub.num_layers = p.num_layers;
  sub.layer_ptrs = desc_.layer_ptrs + p.first_layer;
  ChunkBatch b{1, tokens_, slots + static_cast<int64_t>(c) * tokens_, ring_ptrs_ + r};
  if (gather) {
    paged_copy_cuda(dir, sub, b, vec_bytes_, 0, nullptr, kernel_stream_);
  } else {
    LMTIER_CUDA_CHECK(cudaMemcpyAsync(stage, hostp, nbytes, cudaMemcpyHostToDevice, copy_stream_));
  }
  LMTIER_CUDA_CHECK(cudaEventRecord(filled_[r], producer));
  LMTIER_CUDA_CHECK(cudaStreamWaitEvent(consumer, filled_[r], 0));
  if (gather) {
    LMTIER_CUDA_CHECK(cudaMemcpyAsync(hostp, stage, nbytes, cudaMemcpyDeviceToHost, copy_stream_));
  } else {
    paged_copy_cuda(dir, sub, b, vec_bytes_, 0, nullptr, kernel_stream_);
  }
  LMTIER_CUDA_CHECK(cudaEventRecord(free_[r], consumer));
}

}  // namespace lmtier
#endif
