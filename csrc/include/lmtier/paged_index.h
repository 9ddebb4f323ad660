// lmtier — index arithmetic shared by the CPU and CUDA paged copies, so both move exactly the
// same bytes (bit-identical results by construction).
#pragma once

#include <cstdint>

#include "lmtier/paged_copy.h"

#include "lmtier/hd.h"

namespace lmtier {

// A row is one (chunk, layer, plane, token, head): head_size elements.
struct RowCoord {
  int64_t chunk, layer, plane, token, head;
};

// row index in canonical order: ((((c * L + l) * P + p) * T + t) * H + h)
LMTIER_HD RowCoord decompose_row(int64_t row, const PagedKVDesc& d, int64_t T) {
  RowCoord rc;
  rc.head = row % d.num_heads;
  row /= d.num_heads;
  rc.token = row % T;
  row /= T;
  rc.plane = row % d.num_planes;
  row /= d.num_planes;
  rc.layer = row % d.num_layers;
  rc.chunk = row / d.num_layers;
  return rc;
}

// Byte offset of the row inside its canonical chunk.
LMTIER_HD int64_t canonical_row_offset_bytes(const RowCoord& rc, const PagedKVDesc& d, int64_t T) {
  const int64_t row_in_chunk =
      ((rc.layer * d.num_planes + rc.plane) * T + rc.token) * d.num_heads + rc.head;
  return row_in_chunk * d.head_size * d.elem_bytes;
}

// Byte offset of channel 0 of the row inside its layer's paged view, for a valid slot.
LMTIER_HD int64_t paged_row_offset_bytes(const RowCoord& rc, int64_t slot, const PagedKVDesc& d) {
  const PlaneStrides& s = d.planes[rc.plane];
  const int64_t block = slot / d.block_size;
  const int64_t in_block = slot - block * d.block_size;
  return (s.offset + block * s.block + rc.head * s.head + in_block * s.token) * d.elem_bytes;
}

}  // namespace lmtier
