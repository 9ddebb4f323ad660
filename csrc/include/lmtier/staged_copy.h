// lmtier — pipelined store/load between a CUDA paged KV cache and pinned host chunks.
//
// Store: for each piece (a range of layers of one chunk — contiguous in the layer-major canonical
// layout) the gather kernel writes the piece into a device staging ring slot on `kernel_stream`,
// then the copy engine moves it to the host chunk on `copy_stream`. Events order each ring slot's
// reuse, so the gather of piece i+1 overlaps the DMA of piece i and the SMs are held only for the
// device-to-device gather (microseconds), never for PCIe. Load is the mirror image.
// All enqueueing happens here in C++: a whole batch costs a few microseconds of host time.
#pragma once

#ifdef LMTIER_WITH_CUDA
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "lmtier/paged_copy.h"

namespace lmtier {

class StagedCopier {
 public:
  // desc.layer_ptrs must be a device array that outlives this object. vec_bytes as paged_copy_cuda.
  StagedCopier(const PagedKVDesc& desc, int64_t tokens_per_chunk, int32_t layers_per_piece,
               int32_t ring_slots, int32_t vec_bytes, void* kernel_stream, void* copy_stream);
  ~StagedCopier();
  StagedCopier(const StagedCopier&) = delete;
  StagedCopier& operator=(const StagedCopier&) = delete;

  // slot_mapping: device int64 [num_chunks, tokens_per_chunk]; host_chunks: pinned host addresses.
  // The caller orders the two streams after its producer work before the call, and after the call
  // records completion on copy_stream (store) or kernel_stream (load): the last stream to touch
  // the data in each direction.
  void store(const int64_t* slot_mapping, const std::vector<uintptr_t>& host_chunks);
  void load(const int64_t* slot_mapping, const std::vector<uintptr_t>& host_chunks);
  // Layer-major load of pieces [piece_begin, piece_end) of every chunk: piece p of all chunks is
  // enqueued before piece p + 1 of any, so an event recorded on kernel_stream after the call for
  // pieces [0, p + 1) completes once layers [0, last layer of piece p] of every chunk are in the
  // cache (a layer-by-layer load the forward can wait on per layer). Same ordering contract as
  // load.
  void load_pieces(const int64_t* slot_mapping, const std::vector<uintptr_t>& host_chunks,
                   int32_t piece_begin, int32_t piece_end);

  int64_t chunk_bytes() const { return chunk_bytes_; }
  int32_t num_pieces() const { return static_cast<int32_t>(pieces_.size()); }
  // First layer of piece p (pieces are consecutive layer ranges of layers_per_piece layers).
  int32_t piece_first_layer(int32_t p) const { return pieces_.at(p).first_layer; }

 private:
  struct Piece {
    int32_t first_layer;
    int32_t num_layers;
  };
  struct DeviceGuard {  // makes the copier's device current for one call
    explicit DeviceGuard(int device);
    ~DeviceGuard();
    int device_;
    int prev_ = -1;
  };
  void run(CopyDirection dir, const int64_t* slots, const std::vector<uintptr_t>& host);
  // Piece p of chunk c through the next ring slot (store: gather then D2H; load: H2D then scatter).
  void copy_piece(CopyDirection dir, const int64_t* slots, const std::vector<uintptr_t>& host,
                  size_t c, const Piece& p);

  PagedKVDesc desc_;
  int64_t tokens_;
  int64_t chunk_bytes_;
  int64_t layer_bytes_;
  int32_t vec_bytes_;
  std::vector<Piece> pieces_;
  int32_t ring_;
  int32_t next_ = 0;
  uint8_t* staging_ = nullptr;     // [ring][piece_bytes] device
  uint64_t* ring_ptrs_ = nullptr;  // [ring] device: address of each ring slot
  int64_t piece_bytes_ = 0;
  cudaStream_t kernel_stream_;
  cudaStream_t copy_stream_;
  std::vector<cudaEvent_t> free_;    // ring slot may be overwritten
  std::vector<cudaEvent_t> filled_;  // ring slot holds a complete piece
  int device_ = 0;
};

}  // namespace lmtier
#endif
