"""The self-describing record that the disk and remote tiers store (never pickle).

A record is a fixed 128-byte little-endian header followed by the chunk payload, starting at
``payload_offset`` bytes from the start of the record:

* **disk** records use ``payload_offset = 4096`` (:data:`DISK_PAYLOAD_OFFSET`): the header is
  zero-padded to one 4 KiB block so the payload is 4 KiB aligned in the file and can be moved
  with ``O_DIRECT`` / GPUDirect Storage straight into an aligned buffer; the file is then padded
  to a multiple of 4 KiB (the padding is not covered by the checksum and not part of the payload).
* **remote** (Redis/Valkey) values use the compact ``payload_offset = 128``
  (:data:`COMPACT_PAYLOAD_OFFSET`): nothing is aligned on the wire, so 3,968 bytes of padding per
  value would only cost bandwidth and memory.

Header layout (version 1, 128 bytes, all integers little-endian)::

    off size field
      0    4 magic            b"LMTR"
      4    2 version          FORMAT_VERSION (1)
      6    2 header_bytes     128 (size of this struct)
      8    4 flags            0 in version 1; unknown bits are rejected
     12    2 codec            codec id, 0 = naive (raw canonical chunk bytes)
     14    2 dtype_code       element dtype of the canonical chunk (lmtier.geometry.DTypeCode), 0 = unspecified
     16    4 payload_offset   bytes from record start to payload; 128 or a multiple of 4096
     20    4 reserved0        0
     24    8 payload_bytes    payload length in bytes
     32    8 payload_xxh3     xxh3-64 of the payload bytes (seed 0)
     40   32 key              the 32-byte chunk key (see lmtier.keys)
     72   16 namespace        16-byte namespace digest (all zero = unspecified)
     88    4 num_layers       geometry of the canonical chunk, 0 = unspecified ...
     92    4 num_planes       ... 2 for K,V; 1 for MLA
     96    4 num_tokens
    100    4 num_kv_heads
    104    4 head_size
    108    4 reserved1        0
    112    8 created_ns       wall-clock creation time, ns since the Unix epoch (informational)
    120    8 header_xxh3      xxh3-64 of bytes [0, 120)

The geometry fields are informational (the key's namespace already binds model, geometry, dtype
and codec, so a record can only be reached by a compatible reader); tiers that only know ``key``
and payload leave them zero. The payload checksum is xxh3-64 (Collet, xxHash spec,
https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md), computed over a memoryview with
no copy (tens of GB/s per core).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import xxhash

from lmtier.errors import LMTierError
from lmtier.geometry import KEY_BYTES, DTypeCode

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "DISK_PAYLOAD_OFFSET",
    "COMPACT_PAYLOAD_OFFSET",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "CODEC_NAIVE",
    "RecordError",
    "RecordHeader",
    "RecordMeta",
    "encode_header",
    "payload_hasher",
    "decode_header",
    "payload_checksum",
    "verify_payload",
]

MAGIC = b"LMTR"
FORMAT_VERSION = 1
HEADER_BYTES = 128
DISK_PAYLOAD_OFFSET = 4096
COMPACT_PAYLOAD_OFFSET = HEADER_BYTES
#: Largest payload a decoder accepts unless told otherwise (1 GiB). A 256-token chunk of a
#: 126-layer, 8-KV-head, 128-dim bf16 model is ~132 MB; anything far above is corruption.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
#: Largest payload_offset accepted (the header block plus future metadata must fit in 1 MiB).
MAX_PAYLOAD_OFFSET = 1 << 20
CODEC_NAIVE = 0
NAMESPACE_BYTES = 16
KNOWN_FLAGS = 0

_STRUCT = struct.Struct("<4sHHIHHIIQQ32s16sIIIIIIQQ")
assert _STRUCT.size == HEADER_BYTES, _STRUCT.size
_CHECKED_BYTES = HEADER_BYTES - 8  # header_xxh3 covers [0, 120)
_ZERO_NS = bytes(NAMESPACE_BYTES)


class RecordError(LMTierError, ValueError):
    """A record header or payload does not verify (bad magic/version/length/checksum/key)."""


@dataclass(frozen=True)
class RecordMeta:
    """Optional description of the payload stored in the header (0 = unspecified).

    Attributes:
        namespace: 16-byte namespace digest (model, geometry, dtype, codec, TP rank/size, salt).
        codec: codec id (0 = naive raw canonical bytes).
        dtype_code: :class:`lmtier.geometry.DTypeCode` of the elements (0 = unspecified).
        num_layers, num_planes, num_tokens, num_kv_heads, head_size: geometry of the canonical
            chunk ``[num_layers][num_planes][num_tokens][num_kv_heads][head_size]``.
    """

    namespace: bytes = _ZERO_NS
    codec: int = CODEC_NAIVE
    dtype_code: int = DTypeCode.UNSPECIFIED
    num_layers: int = 0
    num_planes: int = 0
    num_tokens: int = 0
    num_kv_heads: int = 0
    head_size: int = 0


DEFAULT_META = RecordMeta()


@dataclass(frozen=True)
class RecordHeader:
    """A decoded, verified record header. ``payload_offset``/``payload_bytes`` are in bytes."""

    version: int
    flags: int
    payload_offset: int
    payload_bytes: int
    payload_xxh3: int
    key: bytes
    meta: RecordMeta
    created_ns: int

    @property
    def record_bytes(self) -> int:
        """Bytes from record start to payload end (padding excluded)."""
        return self.payload_offset + self.payload_bytes


def payload_checksum(payload) -> int:
    """xxh3-64 (seed 0) of ``payload`` (any C-contiguous buffer: bytes, memoryview, ndarray).

    No copy is made. Returns an unsigned 64-bit int.
    """
    return xxhash.xxh3_64_intdigest(payload)


def payload_hasher() -> xxhash.xxh3_64:
    """A streaming :func:`payload_checksum`: ``update`` it with consecutive pieces of a payload (any
    C-contiguous buffers; the GIL is released while it hashes), then ``intdigest()`` equals
    ``payload_checksum`` of the whole payload."""
    return xxhash.xxh3_64()


def encode_header(
    key: bytes,
    payload_bytes: int,
    payload_xxh3: int,
    *,
    payload_offset: int = DISK_PAYLOAD_OFFSET,
    meta: RecordMeta = DEFAULT_META,
    created_ns: int | None = None,
) -> bytes:
    """Build the 128-byte header of a record.

    Args:
        key: 32-byte chunk key.
        payload_bytes: payload length in bytes (>= 0).
        payload_xxh3: :func:`payload_checksum` of the payload.
        payload_offset: :data:`DISK_PAYLOAD_OFFSET` (4096, disk) or
            :data:`COMPACT_PAYLOAD_OFFSET` (128, remote); any other value must be a multiple of 4096.
        meta: optional namespace/codec/geometry description.
        created_ns: creation time in ns since the epoch (default: now).

    Returns:
        ``bytes`` of length :data:`HEADER_BYTES`. The caller pads to ``payload_offset``.

    Raises:
        ValueError: on a malformed argument (wrong key/namespace length, bad offset, negative length).
    """
    if len(key) != KEY_BYTES:
        raise ValueError(f"encode_header: key must be {KEY_BYTES} bytes, got {len(key)}")
    if len(meta.namespace) != NAMESPACE_BYTES:
        raise ValueError(f"encode_header: namespace must be {NAMESPACE_BYTES} bytes, got {len(meta.namespace)}")
    if not _valid_offset(payload_offset):
        raise ValueError(f"encode_header: payload_offset {payload_offset} is not 128 or a multiple of 4096")
    if payload_bytes < 0:
        raise ValueError(f"encode_header: negative payload_bytes {payload_bytes}")
    if created_ns is None:
        created_ns = time.time_ns()
    body = _STRUCT.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        0,
        meta.codec,
        meta.dtype_code,
        payload_offset,
        0,
        payload_bytes,
        payload_xxh3,
        bytes(key),
        bytes(meta.namespace),
        meta.num_layers,
        meta.num_planes,
        meta.num_tokens,
        meta.num_kv_heads,
        meta.head_size,
        0,
        created_ns,
        0,
    )
    return body[:_CHECKED_BYTES] + struct.pack("<Q", xxhash.xxh3_64_intdigest(body[:_CHECKED_BYTES]))


def decode_header(
    buf,
    *,
    expected_key: bytes | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> RecordHeader:
    """Parse and verify the header at the start of ``buf`` (>= 128 bytes; extra bytes ignored).

    Checks, in order: length, magic, version, header size, header checksum, flags, payload
    offset, payload length (against ``max_payload_bytes``, before anyone allocates), and the key
    (if ``expected_key`` is given). The payload checksum is *not* checked here (see
    :func:`verify_payload`).

    Raises:
        RecordError: with a message naming the failed check.
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_BYTES:
        raise RecordError(f"truncated header: {len(mv)} bytes < {HEADER_BYTES}")
    head = mv[:HEADER_BYTES]
    (
        magic,
        version,
        header_bytes,
        flags,
        codec,
        dtype_code,
        payload_offset,
        _r0,
        payload_bytes,
        payload_xxh3,
        key,
        namespace,
        num_layers,
        num_planes,
        num_tokens,
        num_kv_heads,
        head_size,
        _r1,
        created_ns,
        header_xxh3,
    ) = _STRUCT.unpack(head)
    if magic != MAGIC:
        raise RecordError(f"bad magic {magic!r} (expected {MAGIC!r}): not an lmtier record")
    if version != FORMAT_VERSION:
        raise RecordError(f"unsupported record format version {version} (this build reads {FORMAT_VERSION})")
    if header_bytes != HEADER_BYTES:
        raise RecordError(f"bad header size {header_bytes} (expected {HEADER_BYTES})")
    actual = xxhash.xxh3_64_intdigest(head[:_CHECKED_BYTES])
    if actual != header_xxh3:
        raise RecordError(f"header checksum mismatch (stored {header_xxh3:#018x}, computed {actual:#018x})")
    if flags & ~KNOWN_FLAGS:
        raise RecordError(f"unknown flags {flags:#x}")
    if not _valid_offset(payload_offset):
        raise RecordError(f"bad payload offset {payload_offset}")
    if payload_bytes > max_payload_bytes:
        raise RecordError(f"payload length {payload_bytes} exceeds the limit {max_payload_bytes}")
    if expected_key is not None and key != bytes(expected_key):
        raise RecordError(f"key mismatch: record holds {key.hex()}, expected {bytes(expected_key).hex()}")
    meta = RecordMeta(namespace, codec, dtype_code, num_layers, num_planes, num_tokens, num_kv_heads, head_size)
    return RecordHeader(version, flags, payload_offset, payload_bytes, payload_xxh3, key, meta, created_ns)


def verify_payload(header: RecordHeader, payload) -> None:
    """Check ``payload`` (exactly ``header.payload_bytes`` bytes) against the header.

    Raises:
        RecordError: wrong length (truncated/overlong) or checksum mismatch.
    """
    n = memoryview(payload).nbytes
    if n != header.payload_bytes:
        raise RecordError(f"payload length {n} != {header.payload_bytes} stated in the header (truncated?)")
    actual = xxhash.xxh3_64_intdigest(payload)
    if actual != header.payload_xxh3:
        raise RecordError(f"payload checksum mismatch (stored {header.payload_xxh3:#018x}, computed {actual:#018x})")


def _valid_offset(off: int) -> bool:
    return off == COMPACT_PAYLOAD_OFFSET or (0 < off <= MAX_PAYLOAD_OFFSET and off % 4096 == 0)
