"""The versioned binary codec record: one compressed canonical chunk (never pickle).

A record is a fixed 64-byte little-endian header, a section index, opaque metadata, and the payload.
The payload holds ``num_layers * sections_per_layer`` byte *sections* (e.g. per layer: the K and V
rANS symbol streams and their scales — what a section holds is the level's business), layer-major
and in index order, so a reader can decode layer by layer as sections arrive. Sections start at
4-byte aligned payload offsets (rANS streams need that), the payload at a 16-byte aligned record
offset. The bytes depend only on the sections, so the CPU and CUDA encoders — which produce
byte-identical rANS streams — produce identical records.

Header (version 2, 64 bytes)::

    off size field
      0    4 magic            b"LMKC"
      4    2 version          FORMAT_VERSION (2; version 1 records held rANS v1 streams)
      6    2 header_bytes     64
      8    1 level_id         codec level (lmtier.codec.levels); 0..255
      9    1 dtype            DType code of the decoded elements
     10    2 sections_per_layer  S >= 1
     12    4 table_id         id of the static rANS table set used (0xFFFFFFFF: none)
     16    4 num_layers       L  \
     20    4 num_planes       P   | geometry of the canonical chunk
     24    4 num_tokens       T   | [L][P][T][H][D]
     28    4 num_heads        H   |
     32    4 head_size        D  /
     36    4 meta_bytes       bytes of opaque metadata after the index
     40    8 payload_bytes    bytes of payload
     48    8 flags            0; unknown bits are rejected
     56    8 checksum         xxh3-64 (seed 0) of bytes [0, 56) and [64, record end)

Then ``index``: L*S entries of (uint64 offset, uint64 length), offsets from the payload start,
ascending and non-overlapping; then ``meta`` zero-padded to 16 bytes; then the payload. Record end =
64 + 16*L*S + round_up(meta_bytes, 16) + payload_bytes; trailing bytes after it (e.g. disk block
padding) are ignored.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from lmtier.geometry import DTypeCode as DType
from lmtier.tiers.buffers import AlignedBuffer

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "NO_TABLE",
    "DType",
    "RecordInfo",
    "Record",
    "record_size",
    "pack",
    "pack_into",
    "pack_back_to_back",
    "pack_runs",
    "unpack",
    "check_checksum",
    "verify",
]

MAGIC = b"LMKC"
FORMAT_VERSION = 2  # 2: sections are rANS stream version 2 (table switching)
HEADER_BYTES = 64
NO_TABLE = 0xFFFFFFFF
MAX_SECTIONS = 1 << 24
_HEADER = struct.Struct("<4sHHBBHIIIIIIIQQQ")
assert _HEADER.size == HEADER_BYTES
_INDEX = np.dtype([("offset", "<u8"), ("length", "<u8")])


@dataclass(frozen=True)
class RecordInfo:
    """What a record says about itself (everything in the header but sizes and checksum)."""

    level_id: int
    num_layers: int
    num_planes: int
    num_tokens: int
    num_heads: int
    head_size: int
    dtype: DType = DType.BFLOAT16
    sections_per_layer: int = 1
    table_id: int = NO_TABLE

    def __post_init__(self) -> None:
        for name, lo, hi in (
            ("level_id", 0, 255),
            ("num_layers", 1, 2**32 - 1),
            ("num_planes", 1, 2**32 - 1),
            ("num_tokens", 0, 2**32 - 1),
            ("num_heads", 1, 2**32 - 1),
            ("head_size", 1, 2**32 - 1),
            ("sections_per_layer", 1, 0xFFFF),
            ("table_id", 0, 2**32 - 1),
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
                raise ValueError(f"RecordInfo.{name} must be an integer in [{lo}, {hi}], got {v!r}")
        object.__setattr__(self, "dtype", DType(self.dtype))
        if self.num_layers * self.sections_per_layer > MAX_SECTIONS:
            raise ValueError(f"at most {MAX_SECTIONS} sections per record")

    @property
    def num_sections(self) -> int:
        return self.num_layers * self.sections_per_layer


def _r4(n: int | np.ndarray) -> int | np.ndarray:
    return (n + 3) & ~3


def _r16(n: int) -> int:
    return (n + 15) & ~15


def _nbytes(x: Any) -> int:
    return memoryview(x).nbytes if not hasattr(x, "nbytes") else int(x.nbytes)


def _layout(info: RecordInfo, lengths: Sequence[int], meta_len: int) -> tuple[np.ndarray, int, int]:
    if len(lengths) != info.num_sections:
        raise ValueError(f"got {len(lengths)} sections, the geometry needs L*S = {info.num_sections}")
    n = np.asarray(lengths, np.int64).reshape(-1)
    if (n < 0).any():
        raise ValueError(f"negative section length {int(n.min())}")
    ends = np.cumsum(_r4(n))  # each section's 4-byte aligned end
    idx = np.zeros(info.num_sections, _INDEX)
    idx["offset"][1:], idx["length"] = ends[:-1], n
    payload_start = HEADER_BYTES + 16 * info.num_sections + _r16(meta_len)
    return idx, payload_start, int(ends[-1]) if n.size else 0


def record_size(info: RecordInfo, section_lengths: Sequence[int], meta_bytes: int = 0) -> int:
    """Bytes :func:`pack` produces for sections of these lengths."""
    _, start, payload = _layout(info, section_lengths, meta_bytes)
    return start + payload


def _as_bytes_view(x: Any) -> memoryview:
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise ValueError("sections must be host memory (copy CUDA buffers to the host first)")
        x = x.contiguous().numpy()
    return memoryview(np.ascontiguousarray(x).view(np.uint8).reshape(-1) if isinstance(x, np.ndarray) else x).cast("B")


def pack_into(buf: Any, info: RecordInfo, sections: Sequence[Any], meta: bytes = b"") -> int:
    """Write the record into ``buf`` (writable, >= record_size bytes); returns bytes written."""
    views = [_as_bytes_view(s) for s in sections]
    meta_v = _as_bytes_view(meta)
    idx, start, payload = _layout(info, [v.nbytes for v in views], meta_v.nbytes)
    out = _out_array(buf, start + payload)
    _write_index(out, idx, meta_v, start)
    for (off, n), v in zip(idx.tolist(), views):
        out[start + off : start + off + n] = np.frombuffer(v, np.uint8)
        out[start + off + n : start + _r4(off + n)] = 0
    _seal(out, info, meta_v.nbytes, start, payload)
    return start + payload


def pack_back_to_back(
    info: RecordInfo, data: np.ndarray, offsets: Any, meta: bytes = b"", *, scratch: bool = False
) -> bytes | memoryview:
    """``pack(info, [data[offsets[i]:offsets[i + 1]] for i in range(N)], meta)`` — the same bytes —
    with one copy of the payload when every section but the last has a length that is a multiple of
    4 (a :func:`lmtier.codec.rans.encode` batch: its streams lie back to back at 4-byte aligned
    offsets, the record's layout), else section by section: :func:`pack_runs` of one run.

    Args:
        info: the record header.
        data: 1-D uint8 host array holding the sections.
        offsets: ``[N + 1]`` non-decreasing ints (host), section ``i`` = ``data[offsets[i]:offsets[i + 1]]``.
        meta: the record's metadata bytes.
        scratch: as for :func:`pack_runs`.

    Raises:
        ValueError: ``data`` not uint8, offsets not non-decreasing or past ``data``, a section count
            the geometry does not have.
    """
    return pack_runs(info, [(data, offsets)], meta, what="pack_back_to_back", scratch=scratch)


def _run(data: Any, offsets: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A checked run of :func:`pack_runs`: (uint8 ``data``, int64 ``offsets``)."""
    off = np.asarray(offsets, np.int64).reshape(-1)
    data = np.frombuffer(memoryview(data).cast("B"), np.uint8) if not isinstance(data, np.ndarray) else data
    data = data.reshape(-1)
    if data.dtype != np.uint8:
        raise ValueError(f"{what}: data must be uint8, got {data.dtype}")
    if off.size < 1 or (np.diff(off) < 0).any() or off[0] < 0 or off[-1] > data.size:
        raise ValueError(f"{what}: bad offsets {off.tolist()[:8]} for {data.size} bytes")
    return data, off


def pack_runs(
    info: RecordInfo,
    runs: Sequence[tuple[Any, Any]],
    meta: bytes = b"",
    *,
    what: str = "pack_runs",
    scratch: bool = False,
) -> bytes | memoryview:
    """:func:`pack` of sections given as runs of back-to-back sections — the same bytes. Run ``k`` is
    ``(data, offsets)``: its ``len(offsets) - 1`` sections are ``data[offsets[i]:offsets[i + 1]]``; the
    record's sections are the runs' in order. A run whose sections but the last have lengths that are
    multiples of 4 lies in ``data`` as in the record and is copied at once (a coder call's streams);
    other runs section by section. The record's bytes are copied into the returned ``bytes`` with the
    GIL released (the new object's page faults included: ``lmtier._C.bytes_of``).

    Args:
        info: the record header.
        runs: ``(data, offsets)`` pairs: ``data`` a 1-D uint8 host array (or bytes-like), ``offsets``
            ``[n + 1]`` non-decreasing ints within it (``[0, 0]``: none; ``[0] * (n + 1)``: ``n`` empty
            sections).
        meta: the record's metadata bytes.
        scratch: False: the record as a new ``bytes``. True: a read-only ``memoryview`` of the buffer
            this thread assembled it in (:func:`_scratch`), no copy: valid until this thread packs
            its next record. For a codec tier handing the record to its inner tier's ``put``, which
            is done reading it when it returns (:meth:`lmtier.tiers.base.Tier.put`).

    Raises:
        ValueError: ``data`` not uint8, offsets not non-decreasing or past ``data``, a section count
            the geometry does not have.
    """
    checked = [_run(d, o, what) for d, o in runs]
    meta_v = _as_bytes_view(meta)
    lengths = np.concatenate([np.diff(o) for _, o in checked]) if checked else np.zeros(0, np.int64)
    idx, start, payload = _layout(info, lengths, meta_v.nbytes)
    out = _scratch(start + payload)
    _write_index(out, idx, meta_v, start)
    rec_off, first = idx["offset"], 0
    for data, off in checked:
        n = off.size - 1
        if n and not (np.diff(off)[:-1] % 4).any():  # laid out as in the record: one copy
            at, used = start + int(rec_off[first]), int(off[-1] - off[0])
            out[at : at + used] = data[int(off[0]) : int(off[-1])]
            out[at + used : start + _r4(int(rec_off[first]) + used)] = 0
        else:
            for i, (a, b) in enumerate(zip(off[:-1].tolist(), off[1:].tolist())):
                at = start + int(rec_off[first + i])
                out[at : at + b - a] = data[a:b]
                out[at + b - a : start + _r4(int(rec_off[first + i]) + b - a)] = 0
        first += n
    _seal(out, info, meta_v.nbytes, start, payload)
    return memoryview(out).toreadonly() if scratch else _bytes_of(out)


def _bytes_of(out: np.ndarray) -> bytes:
    """``out.tobytes()``, copied with the GIL released (``lmtier._C.bytes_of``)."""
    from lmtier import _C

    return _C.bytes_of(out)


def _out_array(buf: Any, total: int) -> np.ndarray:
    out = np.frombuffer(memoryview(buf).cast("B"), np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
    if out.size < total:
        raise ValueError(f"buffer of {out.size} bytes, the record needs {total}")
    if out.dtype != np.uint8:
        raise ValueError("buffer must be bytes")
    return out


def _write_index(out: np.ndarray, idx: np.ndarray, meta_v: memoryview, start: int) -> None:
    """The section index, the metadata and its zero pad up to the payload."""
    o = HEADER_BYTES
    out[o : o + idx.nbytes] = idx.view(np.uint8)
    o += idx.nbytes
    out[o : o + meta_v.nbytes] = np.frombuffer(meta_v, np.uint8)
    out[o + meta_v.nbytes : start] = 0


def _seal(out: np.ndarray, info: RecordInfo, meta_bytes: int, start: int, payload: int) -> None:
    """The header, then the checksum over the header's first 56 bytes and everything after it."""
    head = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        info.level_id,
        int(info.dtype),
        info.sections_per_layer,
        info.table_id,
        info.num_layers,
        info.num_planes,
        info.num_tokens,
        info.num_heads,
        info.head_size,
        meta_bytes,
        payload,
        0,
        0,
    )
    out[:HEADER_BYTES] = np.frombuffer(head, np.uint8)
    h = xxhash.xxh3_64()
    h.update(memoryview(out[:56]))
    h.update(memoryview(out[HEADER_BYTES : start + payload]))
    out[56:64] = np.frombuffer(struct.pack("<Q", h.intdigest()), np.uint8)


_SCRATCH_MAX = 64 << 20
"""Records up to this many bytes are assembled in a per-thread buffer that is kept (see :func:`_scratch`):
at most this much memory per thread that packs records."""
_local = threading.local()


def _scratch(total: int) -> np.ndarray:
    """A writable uint8 array of ``total`` bytes in which :func:`pack` assembles a record before its
    one copy into the returned ``bytes``: this thread's kept buffer (its pages already touched) when
    the record fits :data:`_SCRATCH_MAX`, else a fresh one; page-aligned. Assembling in a fresh buffer
    and then copying touches two sets of new pages, and a page fault per 4 KiB costs more than the
    copy."""
    if total > _SCRATCH_MAX:
        return _page_aligned(total)
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < total:  # grows geometrically: records that grow step by step
        size = 0 if buf is None else buf.size
        buf = _local.buf = _page_aligned(min(_SCRATCH_MAX, max(total, 2 * size, 1 << 20)))
    return buf[:total]


def _page_aligned(n: int) -> np.ndarray:
    """A uint8 array of ``n`` bytes starting on a 4 KiB page (:class:`~lmtier.tiers.buffers.AlignedBuffer`;
    the disk tier writes whole pages of such a payload straight from it, :mod:`lmtier.tiers.disk.records`)."""
    return np.frombuffer(AlignedBuffer(n).mv, np.uint8, count=n)


def pack(info: RecordInfo, sections: Sequence[Any], meta: bytes = b"") -> bytes:
    """Serialize a record. ``sections``: L*S host byte buffers (bytes, NumPy, CPU tensors), layer-major.
    A batch encoded by :func:`lmtier.codec.rans.encode` maps to sections as ``batch.stream(i)``."""
    views = [_as_bytes_view(s) for s in sections]
    out = _scratch(record_size(info, [v.nbytes for v in views], _as_bytes_view(meta).nbytes))
    pack_into(out, info, views, meta)
    return _bytes_of(out)


@dataclass(frozen=True)
class Record:
    """A parsed record; sections are zero-copy views into the source buffer."""

    info: RecordInfo
    meta: memoryview
    payload: memoryview
    index: np.ndarray  # [L*S] (offset, length)
    payload_offset: int  # record-relative offset of the payload (16-byte aligned)
    nbytes: int  # record end

    def section(self, layer: int, s: int = 0) -> memoryview:
        S = self.info.sections_per_layer
        if not (0 <= layer < self.info.num_layers and 0 <= s < S):
            raise IndexError(f"section ({layer}, {s}) outside [{self.info.num_layers}, {S}]")
        off, n = self.index[layer * S + s].tolist()
        return self.payload[off : off + n]

    def layer_span(self, layer: int) -> tuple[int, int]:
        """(record offset, bytes) of all of ``layer``'s sections — what a layer-by-layer reader fetches."""
        S = self.info.sections_per_layer
        first = self.index[layer * S]
        last = self.index[layer * S + S - 1]
        start = int(first["offset"])
        return self.payload_offset + start, int(last["offset"] + last["length"]) - start

    def section_offsets(self) -> np.ndarray:
        """Record-relative offsets of all sections (int64 [L*S]), e.g. for one batched GPU decode."""
        return self.index["offset"].astype(np.int64) + self.payload_offset

    def section_lengths(self) -> np.ndarray:
        return self.index["length"].astype(np.int64)


def _parse(buf: Any) -> tuple[RecordInfo, np.ndarray, int, int, memoryview, int]:
    mv = _as_bytes_view(buf)
    if mv.nbytes < HEADER_BYTES:
        raise ValueError(f"codec record truncated: {mv.nbytes} bytes, the header alone is {HEADER_BYTES}")
    (
        magic,
        version,
        header_bytes,
        level,
        dtype,
        S,
        table_id,
        nl,
        np_,
        nt,
        nh,
        hd,
        meta_bytes,
        payload_bytes,
        flags,
        _checksum,
    ) = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ValueError(f"not a codec record: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise ValueError(f"unsupported codec record version {version} (this reader knows {FORMAT_VERSION})")
    if header_bytes != HEADER_BYTES:
        raise ValueError(f"corrupted codec record: header_bytes {header_bytes}")
    if flags != 0:
        raise ValueError(f"codec record has unknown flags {flags:#x}")
    try:
        dt = DType(dtype)
    except ValueError:
        raise ValueError(f"corrupted codec record: unknown dtype code {dtype}") from None
    nsec = nl * S
    if nl == 0 or S == 0 or np_ == 0 or nh == 0 or hd == 0 or nsec > MAX_SECTIONS:
        raise ValueError(f"corrupted codec record: geometry L={nl} P={np_} H={nh} D={hd} S={S}")
    if HEADER_BYTES + 16 * nsec > mv.nbytes:
        raise ValueError(
            f"codec record truncated: {mv.nbytes} bytes, the section index needs {HEADER_BYTES + 16 * nsec}"
        )
    start = HEADER_BYTES + 16 * nsec + _r16(meta_bytes)
    end = start + payload_bytes
    if end > mv.nbytes:
        raise ValueError(f"codec record truncated: {mv.nbytes} bytes, the header announces {end}")
    info = RecordInfo(level, nl, np_, nt, nh, hd, dt, S, table_id)
    idx = np.frombuffer(mv[HEADER_BYTES : HEADER_BYTES + 16 * nsec], _INDEX)
    offs = idx["offset"].astype(np.uint64)
    lens = idx["length"].astype(np.uint64)
    ends = offs + lens
    if (offs % 4).any() or (lens > payload_bytes).any() or (ends > payload_bytes).any() or (ends < offs).any():
        raise ValueError("corrupted codec record: a section lies outside the payload or is misaligned")
    if nsec > 1 and (offs[1:] < ends[:-1]).any():
        raise ValueError("corrupted codec record: sections overlap or are out of order")
    return info, idx, start, end, mv, _checksum


def verify(buf: Any) -> None:
    """Check the record's xxh3-64 checksum; raises ValueError on mismatch."""
    _, _, _, end, mv, checksum = _parse(buf)
    check_checksum(mv, end, checksum)


def check_checksum(mv: memoryview, end: int, checksum: int) -> None:
    """Check the record's xxh3-64 ``checksum`` (its header's) over its header's first 56 bytes and
    bytes ``[HEADER_BYTES, end)`` of ``mv`` (the record's bytes; ``end``: its payload's end).

    Raises:
        ValueError: a mismatch (a corrupted record)."""
    h = xxhash.xxh3_64()
    h.update(mv[:56])
    h.update(mv[HEADER_BYTES:end])
    if h.intdigest() != checksum:
        raise ValueError("codec record checksum mismatch (corrupted record)")


def unpack(buf: Any, *, verify_checksum: bool = True) -> Record:
    """Parse a record (zero copy). Raises ValueError on truncated / corrupted / foreign input.

    With ``verify_checksum=False`` only the structure is validated (for layer-by-layer decoding that
    starts before the whole record arrived; call :func:`verify` once it has)."""
    info, idx, start, end, mv, checksum = _parse(buf)
    if verify_checksum:
        check_checksum(mv, end, checksum)
    meta_at = HEADER_BYTES + 16 * info.num_sections
    meta_len = _HEADER.unpack_from(mv, 0)[12]
    return Record(info, mv[meta_at : meta_at + meta_len], mv[start:end], idx, start, end)
