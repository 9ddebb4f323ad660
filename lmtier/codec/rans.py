"""Interleaved rANS entropy coder for uint8 symbol streams: one native call per batch, CPU or CUDA.

The coder and its byte format are specified in ``csrc/include/lmtier/rans.h`` (rANS after Duda,
arXiv:1311.2540; 32 interleaved lanes per segment and 16-bit renormalization as in dietgpu). In short:
probability precision 12 bits (a *table* is 256 ``uint16`` frequencies summing to 4096), segments of
``2**seg_log2`` symbols coded by 32 lanes (one CUDA warp), a per-stream table of its own when the
static table lacks a symbol, raw storage of segments that coding would not shrink, and *table
switching* (stream format version 2): a stream with run length ``R`` (a multiple of 32) codes symbol
``i`` with static table ``table_id + i // R`` — e.g. one calibrated table per (head, channel) run of T
tokens inside one (layer, K/V) stream, so the per-stream framing (header, 128 bytes of lane states
per segment) is paid once per stream, not once per table. The CPU (threads)
and CUDA (one warp per segment) encoders produce **byte-identical** streams.

Entry points:

* :func:`build_table` / :func:`table_from_symbols` — normalize counts to a table (the C++ routine,
  identical to what the encoders use for their fallback tables).
* :func:`entropy_bits` — ideal coded size of symbols under a table (for ratio measurements).
* :func:`encode` / :func:`decode` — convenience: allocate, run, check, return.
* :func:`encode_into` / :func:`decode_into` — the hot path: caller-provided output, scratch, offsets and
  status buffers; nothing allocated but the small descriptor array; asynchronous on CUDA.
* :func:`decode_descriptors` — decode from a prebuilt descriptor array (already on the device for
  CUDA) and tables already where the coder reads them: nothing built, uploaded or allocated
  (:class:`lmtier.codec.decoder.ChunkDecoder`).

Arrays are NumPy arrays or torch tensors; CUDA tensors select the CUDA kernels (all buffers of a call
on one device). Errors in the data (corrupted / truncated / hostile streams, missing tables) raise
:class:`ValueError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmtier import _C
from lmtier.codec.native_args import (
    addr_len,
    device_bytes,
    is_cuda,
    is_torch,
    keep_alive,
    order_after_current,
    stream_handle,
    sync_stream,
    torch_module,
)
from lmtier.codec.spans import Spans

__all__ = [
    "PROB_BITS",
    "PROB_SCALE",
    "LANES",
    "DEFAULT_SEG_LOG2",
    "ADAPTIVE_TABLE",
    "HEADER",
    "HEADER_BYTES",
    "MAX_RUN_LEN",
    "STATUS_NAMES",
    "ENCODE_DESC",
    "DECODE_DESC",
    "StreamInfo",
    "EncodedBatch",
    "build_table",
    "table_from_symbols",
    "entropy_bits",
    "max_encoded_bytes",
    "max_batch_encoded_bytes",
    "encode_scratch_bytes",
    "decode_scratch_bytes",
    "stream_info",
    "bounded_stream_info",
    "stream_headers",
    "encode",
    "encode_into",
    "decode",
    "decode_into",
    "decode_descriptors",
    "RUN_LUT_BYTES",
    "build_run_luts",
    "build_tables_ok",
    "check_run_luts",
    "min_stream_bytes",
]

_R = _C.rans
PROB_BITS: int = _R.PROB_BITS
PROB_SCALE: int = _R.PROB_SCALE
LANES: int = _R.LANES
LANES_LOG2: int = LANES.bit_length() - 1
"""A stream header's ``lanes`` field: log2 of its interleaved states."""
MIN_SEG_LOG2: int = _R.MIN_SEG_LOG2
MAX_SEG_LOG2: int = _R.MAX_SEG_LOG2
DEFAULT_SEG_LOG2: int = _R.DEFAULT_SEG_LOG2
ADAPTIVE_TABLE: int = _R.ADAPTIVE_TABLE
HEADER_BYTES: int = _R.HEADER_BYTES
MAGIC: int = _R.MAGIC
"""A stream header's ``magic`` field."""
VERSION: int = _R.VERSION
"""The stream format version a header names (``version``)."""
MAX_STREAM_SYMBOLS: int = _R.MAX_STREAM_SYMBOLS
MAX_RUN_LEN: int = 32 * 0xFFFF
RUN_LUT_BYTES: int = _R.RUN_LUT_BYTES
"""Bytes of one table's decode lookups for table-switching streams (:func:`build_run_luts`)."""

STATUS_NAMES = {
    0: "ok",
    1: "truncated stream",
    2: "bad stream header",
    3: "bad or unknown table",
    4: "decoded symbols exceed the destination capacity",
    5: "inconsistent segment table",
    6: "corrupt rANS payload (integrity check failed)",
    7: "stream address not 4-byte aligned",
    8: "stream longer than MAX_STREAM_SYMBOLS",
    9: "scratch buffer too small",
    10: "output buffer too small",
}

# Descriptor layouts shared with csrc/include/lmtier/rans.h (static_asserted there).
ENCODE_DESC = np.dtype([("src", "<u8"), ("num_symbols", "<u8"), ("table_id", "<u4"), ("run_len", "<u4")])
DECODE_DESC = np.dtype([("src", "<u8"), ("src_bytes", "<u8"), ("dst", "<u8"), ("dst_capacity", "<u8")])
assert ENCODE_DESC.itemsize == 24 and DECODE_DESC.itemsize == 32


def _as_u8_np(x: Any) -> np.ndarray:
    if is_torch(x):
        x = x.detach().cpu().contiguous().numpy()
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype != np.uint8:
        raise ValueError(f"symbols must be uint8, got {a.dtype}")
    return a.reshape(-1)


def _tables_np(tables: Any) -> np.ndarray:
    if tables is None:
        return np.zeros((0, 256), np.uint16)
    if is_torch(tables):
        tables = tables.detach().cpu().numpy()
    t = np.ascontiguousarray(np.asarray(tables))
    if t.ndim == 1:
        t = t.reshape(1, -1)
    if t.ndim != 2 or t.shape[1] != 256:
        raise ValueError(f"tables must be [num_tables, 256], got {t.shape}")
    if t.dtype != np.uint16:
        if t.size and (t.min() < 0 or t.max() > PROB_SCALE):
            raise ValueError("table frequencies must be in [0, 4096]")
        t = t.astype(np.uint16)
    if t.shape[0] > 0xFFFF:
        raise ValueError("at most 65535 static tables")
    return t


def _raise_status(status: np.ndarray, what: str) -> None:
    if not np.count_nonzero(status):  # every stream ok: the common case, one C call
        return
    bad = np.flatnonzero(status)
    first = ", ".join(f"stream {int(i)}: {STATUS_NAMES.get(int(status[i]), int(status[i]))}" for i in bad[:8])
    more = f" (+{bad.size - 8} more)" if bad.size > 8 else ""
    raise ValueError(f"rans {what} failed for {bad.size} stream(s): {first}{more}")


# ---------------------------------------------------------------------------------------------------
# Tables and measurement


def build_table(counts: Any, *, alphabet_size: int = 0) -> np.ndarray:
    """Normalize symbol counts to a rANS table.

    Parameters
    ----------
    counts : array-like, shape [256] (or shorter), non-negative integers
        Symbol occurrence counts (e.g. a calibration histogram).
    alphabet_size : int, keyword-only
        Symbols ``0 .. alphabet_size-1`` get frequency >= 1 even when their count is 0, so the
        table can code any symbol of the alphabet (a static table without fallback).

    Returns
    -------
    np.ndarray, uint16, shape [256], sum 4096. Deterministic; the same C++ routine
    (``normalize_counts`` in rans.h) builds the encoders' per-stream fallback tables.
    """
    c = np.zeros(256, np.uint64)
    a = np.asarray(counts).reshape(-1)
    if a.size > 256:
        raise ValueError("counts has more than 256 entries")
    if a.size and (a < 0).any():
        raise ValueError("counts must be non-negative")
    c[: a.size] = a.astype(np.uint64)
    if int(c.sum(dtype=np.float64)) >= 1 << 51:
        raise ValueError("counts sum must be < 2**51")
    if not 0 <= alphabet_size <= 256:
        raise ValueError("alphabet_size must be in [0, 256]")
    out = np.zeros(256, np.uint16)
    if not _R.normalize_counts(c.ctypes.data, int(alphabet_size), out.ctypes.data):
        raise ValueError("no symbol present: counts are all zero and alphabet_size is 0")
    return out


def table_from_symbols(symbols: Any, *, alphabet_size: int = 0) -> np.ndarray:
    """:func:`build_table` of the histogram of ``symbols`` (uint8 array or tensor)."""
    s = _as_u8_np(symbols)
    return build_table(np.bincount(s, minlength=256), alphabet_size=alphabet_size)


def entropy_bits(symbols: Any, table: Any) -> float:
    """Ideal coded size in bits of ``symbols`` under ``table``: sum of -log2(freq[s] / 4096).

    ``inf`` when a symbol has frequency 0 (the encoder would then use a per-stream table). The real
    coded size adds per segment 128 bytes of lane states plus < 2 bytes of renormalization slack,
    4 bytes of segment table, and per stream 16 bytes of header (+ up to 544 bytes of own table).
    """
    s = _as_u8_np(symbols)
    t = _tables_np(table)[0].astype(np.float64)
    hist = np.bincount(s, minlength=256).astype(np.float64)
    used = hist > 0
    if (t[used] == 0).any():
        return math.inf
    return float(-(hist[used] * np.log2(t[used] / PROB_SCALE)).sum())


def max_encoded_bytes(num_symbols: int, seg_log2: int = DEFAULT_SEG_LOG2) -> int:
    """Worst-case encoded bytes of one stream."""
    return int(_R.max_encoded_bytes(int(num_symbols), int(seg_log2)))


def max_batch_encoded_bytes(num_streams: int, total_symbols: int, seg_log2: int = DEFAULT_SEG_LOG2) -> int:
    """Worst-case encoded bytes of a batch of ``num_streams`` streams of ``total_symbols`` symbols."""
    return int(_R.max_batch_encoded_bytes(int(num_streams), int(total_symbols), int(seg_log2)))


def encode_scratch_bytes(num_streams: int, total_symbols: int, seg_log2: int = DEFAULT_SEG_LOG2) -> int:
    """Scratch bytes :func:`encode_into` needs (CPU and CUDA alike; about total_symbols + 1.5 KiB/stream)."""
    return int(_R.encode_scratch_bytes(int(num_streams), int(total_symbols), int(seg_log2)))


def decode_scratch_bytes(num_streams: int) -> int:
    """Scratch bytes :func:`decode_into` needs on CUDA (48 per stream + 512)."""
    return int(_R.decode_scratch_bytes(int(num_streams)))


HEADER = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "u1"),
        ("flags", "u1"),
        ("seg_log2", "u1"),
        ("lanes", "u1"),
        ("table_id", "<u2"),
        ("run_words", "<u2"),
        ("num_symbols", "<u4"),
    ]
)
"""A stream's 16-byte header (csrc/include/lmtier/rans.h); ``run_words``: the table-switching run in
units of 32 symbols (0: one table)."""
assert HEADER.itemsize == HEADER_BYTES


@dataclass(frozen=True)
class StreamInfo:
    """Header fields of one encoded stream (see rans.h)."""

    num_symbols: int
    table_id: int
    adaptive: bool
    seg_log2: int
    num_segments: int
    run_len: int = 0  # table switching: symbol i uses table table_id + i // run_len (0: one table)


def _segments(h: np.ndarray) -> np.ndarray:
    """Segments of each stream of the :data:`HEADER` records ``h`` (int64)."""
    n = h["num_symbols"].astype(np.int64)
    return -(-n // (np.int64(1) << h["seg_log2"].astype(np.int64).clip(0, 62)))


def min_stream_bytes(segments: Any) -> Any:
    """The fewest bytes a stream of ``segments`` segments occupies (int or int64 array): its header,
    its segment-end table (4 bytes a segment) and, for every segment but the last, at least min(raw
    size, 32 final lane states) = 128 bytes (rans.h). A header announcing more segments than its
    bytes can hold is refused before a decoder allocates for it."""
    return HEADER_BYTES + 4 * segments + 128 * np.maximum(segments - 1, 0)


def _check_headers(h: np.ndarray, nbytes: np.ndarray | None) -> None:
    """Raise ValueError for the first of the :data:`HEADER` records ``h`` that is not a stream of this
    version, or (``nbytes``: each stream's bytes) whose count its bytes cannot hold (see
    :func:`bounded_stream_info`); the message names the stream when there are several."""
    flags = h["flags"]
    bad_kind = (
        (h["magic"] != MAGIC)
        | (h["version"] != VERSION)
        | ((flags & ~np.uint8(1)) != 0)
        | (h["lanes"] != LANES_LOG2)
        | (((flags & 1) != 0) & (h["run_words"] != 0))
    )
    bad_seg = (h["seg_log2"] < MIN_SEG_LOG2) | (h["seg_log2"] > MAX_SEG_LOG2)
    segs = _segments(h)
    need = min_stream_bytes(segs)
    bad_count = np.zeros(len(h), bool) if nbytes is None else (h["num_symbols"] > MAX_STREAM_SYMBOLS) | (need > nbytes)
    bad = np.flatnonzero(bad_kind | bad_seg | bad_count)
    if bad.size == 0:
        return
    i = int(bad[0])
    who = f"stream {i}: " if len(h) > 1 else ""
    if bad_kind[i]:
        raise ValueError(f"{who}not an lmtier rANS stream of this version (bad magic/version/flags)")
    if bad_seg[i]:
        raise ValueError(f"{who}bad segment size 2**{int(h['seg_log2'][i])}")
    raise ValueError(
        f"{who}rans stream claims {int(h['num_symbols'][i])} symbols ({int(segs[i])} segments), "
        f"which {int(nbytes[i])} bytes cannot hold (truncated or hostile)"
    )


def _one_header(buf: Any, nbytes: int | None) -> StreamInfo:
    """:class:`StreamInfo` of the header at the start of ``buf`` (host bytes-like or uint8 array),
    checked by :func:`_check_headers` (``nbytes``: the stream's bytes, None: the count unchecked)."""
    b = memoryview(_as_u8_np(buf) if not isinstance(buf, (bytes, bytearray, memoryview)) else buf).cast("B")
    if len(b) < HEADER_BYTES:
        raise ValueError("rans stream truncated: shorter than its 16-byte header")
    h = np.frombuffer(b, HEADER, count=1)
    _check_headers(h, None if nbytes is None else np.array([nbytes], np.int64))
    r = h[0]
    return StreamInfo(
        int(r["num_symbols"]),
        int(r["table_id"]),
        bool(int(r["flags"]) & 1),
        int(r["seg_log2"]),
        int(_segments(h)[0]),
        32 * int(r["run_words"]),
    )


def stream_info(buf: Any) -> StreamInfo:
    """Parse one encoded stream's header (host bytes). Raises ValueError if it is not one."""
    return _one_header(buf, None)


def bounded_stream_info(buf: Any) -> StreamInfo:
    """:func:`stream_info` of an encoded stream (host bytes-like, NumPy or torch uint8, CPU or CUDA:
    only its header is read) whose symbol count a decoder may allocate: the stream must hold its
    segment-end table (4 bytes per segment) and every segment but the last at least min(raw size, 32
    final lane states) = 128 bytes (rans.h), and at most :data:`MAX_STREAM_SYMBOLS` symbols.

    Raises:
        ValueError: not a stream's header, or a count its bytes cannot hold (truncated or hostile).
    """
    head = buf[:HEADER_BYTES]
    head = head.cpu().numpy() if is_torch(head) else head
    head = head if isinstance(head, (bytes, bytearray)) else np.ascontiguousarray(_as_u8_np(head))
    if is_torch(buf):
        nbytes = int(buf.numel() * buf.element_size())
    elif isinstance(buf, (bytes, bytearray, memoryview)):
        nbytes = memoryview(buf).nbytes
    else:
        nbytes = int(np.asarray(buf).nbytes)
    return _one_header(head, nbytes)


def stream_headers(region: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The :data:`HEADER` records of the encoded streams ``region[starts[i] : starts[i] + sizes[i]]``,
    checked as :func:`bounded_stream_info` checks one (a vectorized pass, for a record's many streams).

    Args:
        region: host uint8 ``[B]``; starts, sizes: int64 ``[S]``, spans inside ``region`` (the caller
            checks that).

    Raises:
        ValueError: naming the first stream shorter than a header, not a stream of this version, or
            announcing a count its bytes cannot hold.
    """
    if (sizes < HEADER_BYTES).any():
        i = int(np.flatnonzero(sizes < HEADER_BYTES)[0])
        raise ValueError(f"stream {i}: rans stream truncated: shorter than its 16-byte header")
    raw = region[starts[:, None] + np.arange(HEADER_BYTES)]  # [S, 16] gathered bytes
    h = np.ascontiguousarray(raw).view(HEADER).reshape(-1)
    _check_headers(h, sizes)
    return h


# ---------------------------------------------------------------------------------------------------
# Batch encode / decode


@dataclass(frozen=True)
class EncodedBatch:
    """Encoded streams back to back in ``data`` (uint8, same device as the input);
    stream i is ``data[offsets[i]:offsets[i+1]]`` (``offsets``: host int64 [N + 1])."""

    data: Any
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def stream(self, i: int) -> Any:
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]

    @property
    def nbytes(self) -> int:
        return int(self.offsets[-1])


def _run_lens(run_lens: Any, n: int) -> np.ndarray:
    if isinstance(run_lens, (int, np.integer)):
        r = np.full(n, int(run_lens), np.int64)
    else:
        r = np.asarray(run_lens, np.int64).reshape(-1)
        if r.size != n:
            raise ValueError(f"got {r.size} run lengths for {n} streams")
    if r.size and ((r < 0).any() or (r % LANES).any() or (r > MAX_RUN_LEN).any()):
        raise ValueError(f"run lengths must be 0 or positive multiples of {LANES} up to {MAX_RUN_LEN}")
    return r


def _table_ids(table_ids: Any, n: int) -> np.ndarray:
    if isinstance(table_ids, (int, np.integer)):
        return np.full(n, int(table_ids), np.int64)
    ids = np.asarray(table_ids, np.int64).reshape(-1)
    if ids.size != n:
        raise ValueError(f"got {ids.size} table ids for {n} streams")
    return ids


def _tables_addr(tables: Any, on_cuda: bool, device: Any, keep: list) -> tuple[int, int]:
    """Address and count of the 512-byte tables for a native call; copies they need go into ``keep``.

    CUDA calls take a device array (uploaded here when ``tables`` is on the host); CPU calls a host array.
    """
    if on_cuda and is_cuda(tables):
        return tables.data_ptr(), tables.numel() * tables.element_size() // 512
    t = _tables_np(tables)
    num_tables = t.shape[0]
    if on_cuda:
        tdev = device_bytes(t, device) if num_tables else None
        keep.append(tdev)
        return (tdev.data_ptr() if tdev is not None else 0), num_tables
    keep.append(t)
    return t.ctypes.data, num_tables


def encode_into(
    streams: Sequence[Any] | Spans,
    table_ids: Any,
    tables: Any,
    *,
    out: Any,
    offsets: Any,
    status: Any,
    scratch: Any,
    seg_log2: int = DEFAULT_SEG_LOG2,
    num_threads: int = 0,
    stream: Any = None,
    run_lens: Any = 0,
) -> None:
    """Encode a batch into caller-provided buffers, one native call (CUDA: asynchronous on ``stream``).

    Parameters
    ----------
    streams : sequence of N contiguous 1-D uint8 arrays/tensors (all CPU or all on one CUDA device), or
        :class:`~lmtier.codec.spans.Spans` (N byte ranges of a few such buffers)
    table_ids : int or [N] ints — static table per stream (< num_tables) or ``ADAPTIVE_TABLE``; with
        table switching the first table of the stream's runs
    run_lens : int or [N] ints — table switching: 0 (one table per stream, default) or a run length R
        (a positive multiple of 32); symbol i of stream k is coded with table ``table_ids[k] + i // R``
        (all of ``table_ids[k] .. table_ids[k] + ceil(len / R) - 1`` must be valid tables)
    tables : [num_tables, 256] uint16 — static tables (NumPy; uploaded per call on CUDA) or a CUDA
        tensor of ``num_tables * 512`` bytes already on the device
    out : uint8 buffer, >= ``max_batch_encoded_bytes(N, sum(len))`` bytes (smaller works if it fits)
    offsets : int64/uint64 [N + 1] — receives stream offsets into ``out``; offsets[N] = total bytes
    status : int32 [N] — receives per-stream status (0 = ok, see STATUS_NAMES)
    scratch : uint8 buffer of >= ``encode_scratch_bytes(N, sum(len), seg_log2)`` bytes
    All of out/offsets/status/scratch on the streams' device (host memory for CPU streams).
    """
    n = len(streams)
    ids = _table_ids(table_ids, n)
    desc = np.zeros(n, ENCODE_DESC)
    if isinstance(streams, Spans):
        on_cuda, dev = streams.on_cuda, streams.device
        desc["src"], desc["num_symbols"] = streams.addresses(), streams.nbytes
    else:
        on_cuda = n > 0 and is_cuda(streams[0])
        dev = streams[0].device if on_cuda else None
        for i, s in enumerate(streams):
            if is_cuda(s) != on_cuda:
                raise ValueError("streams must be all CPU or all CUDA")
            if (is_torch(s) and s.dtype.itemsize != 1) or (not is_torch(s) and np.asarray(s).dtype != np.uint8):
                raise ValueError(f"stream {i}: symbols must be uint8")
            desc[i]["src"], desc[i]["num_symbols"] = addr_len(s)
    desc["table_id"] = ids.astype(np.uint32) & 0xFFFFFFFF
    desc["run_len"] = _run_lens(run_lens, n).astype(np.uint32)
    keep: list[Any] = [desc]
    t_addr, num_tables = _tables_addr(tables, on_cuda, dev, keep)
    out_addr, out_bytes = addr_len(out)
    sc_addr, sc_bytes = addr_len(scratch)
    off_addr, off_bytes = addr_len(offsets)
    st_addr, st_bytes = addr_len(status)
    if off_bytes < 8 * (n + 1) or st_bytes < 4 * n:
        raise ValueError("offsets must hold N + 1 int64 and status N int32")
    desc_addr, handle = desc.ctypes.data, 0
    if on_cuda:
        ddesc = device_bytes(desc, dev)
        keep.append(ddesc)
        order_after_current(stream, dev)
        desc_addr, handle = ddesc.data_ptr(), stream_handle(stream, dev)
    _R.encode(
        on_cuda,
        desc_addr,
        n,
        t_addr,
        num_tables,
        seg_log2,
        out_addr,
        out_bytes,
        off_addr,
        st_addr,
        sc_addr,
        sc_bytes,
        num_threads,
        handle,
    )
    if on_cuda:
        keep_alive(keep, stream, dev)


def encode(
    streams: Sequence[Any] | Spans,
    table_ids: Any = ADAPTIVE_TABLE,
    tables: Any = None,
    *,
    seg_log2: int = DEFAULT_SEG_LOG2,
    num_threads: int = 0,
    stream: Any = None,
    run_lens: Any = 0,
) -> EncodedBatch:
    """Encode N uint8 streams (a sequence of arrays/tensors, or :class:`~lmtier.codec.spans.Spans`
    of a few buffers: the same bytes, one address lookup per buffer); returns an
    :class:`EncodedBatch` (synchronizes on CUDA).

    ``table_ids`` defaults to ``ADAPTIVE_TABLE`` (every stream codes with its own table);
    ``run_lens``: table switching, see :func:`encode_into`.
    Raises ValueError on bad tables / ids / dtypes.
    """
    spans = isinstance(streams, Spans)
    if not spans:
        streams = list(streams)
    n = len(streams)
    total = int(streams.nbytes.sum()) if spans else sum(addr_len(s)[1] for s in streams)
    bound = max_batch_encoded_bytes(n, total, seg_log2)
    sc_bytes = encode_scratch_bytes(n, total, seg_log2)
    if streams.on_cuda if spans else (n and is_cuda(streams[0])):
        torch = torch_module()
        dev = streams.device if spans else streams[0].device
        out = torch.empty(bound, dtype=torch.uint8, device=dev)
        scratch = torch.empty(sc_bytes, dtype=torch.uint8, device=dev)
        offsets = torch.empty(n + 1, dtype=torch.int64, device=dev)
        status = torch.empty(max(n, 1), dtype=torch.int32, device=dev)
        encode_into(
            streams,
            table_ids,
            tables,
            out=out,
            offsets=offsets,
            status=status,
            scratch=scratch,
            seg_log2=seg_log2,
            stream=stream,
            run_lens=run_lens,
        )
        sync_stream(stream, dev)
        st = status.cpu().numpy()[:n]
        off = offsets.cpu().numpy()
        _raise_status(st, "encode")
        return EncodedBatch(out[: int(off[-1])], off.astype(np.int64))
    if not spans:
        streams = [np.ascontiguousarray(_as_u8_np(s)) for s in streams]
    out = np.empty(bound, np.uint8)
    scratch = np.empty(sc_bytes, np.uint8)
    offsets = np.zeros(n + 1, np.int64)
    status = np.zeros(max(n, 1), np.int32)
    encode_into(
        streams,
        table_ids,
        tables,
        out=out,
        offsets=offsets,
        status=status,
        scratch=scratch,
        seg_log2=seg_log2,
        num_threads=num_threads,
        run_lens=run_lens,
    )
    _raise_status(status[:n], "encode")
    return EncodedBatch(out[: int(offsets[-1])], offsets)


def decode_into(
    sources: Sequence[Any],
    tables: Any,
    *,
    outs: Sequence[Any],
    out_lengths: Any,
    status: Any,
    scratch: Any = None,
    num_threads: int = 0,
    stream: Any = None,
) -> None:
    """Decode N encoded streams into caller-provided buffers, one native call (CUDA: async).

    ``sources[i]``: the encoded stream (1-D uint8, 4-byte aligned address; extra trailing bytes are
    ignored); ``outs[i]``: destination (its size is the capacity); ``out_lengths``: uint64/int64 [N]
    receives decoded symbol counts (valid where status == 0); ``status``: int32 [N]; ``scratch``
    (CUDA only): >= ``decode_scratch_bytes(N)`` bytes on the device. Hostile input never reads or
    writes outside the given buffers; it yields a nonzero status.
    """
    n = len(sources)
    if len(outs) != n:
        raise ValueError(f"got {len(outs)} outputs for {n} streams")
    on_cuda = n > 0 and is_cuda(sources[0])
    desc = np.zeros(n, DECODE_DESC)
    for i, (s, o) in enumerate(zip(sources, outs)):
        if is_cuda(s) != on_cuda or is_cuda(o) != on_cuda:
            raise ValueError("sources and outputs must be all CPU or all on one CUDA device")
        desc[i]["src"], desc[i]["src_bytes"] = addr_len(s)
        desc[i]["dst"], desc[i]["dst_capacity"] = addr_len(o)
    keep: list[Any] = [desc]
    t_addr, num_tables = _tables_addr(tables, on_cuda, sources[0].device if on_cuda else None, keep)
    descs, dev = desc, None
    if on_cuda:
        dev = sources[0].device
        descs = device_bytes(desc, dev)
        keep.append(descs)
        order_after_current(stream, dev)
    # one native call through decode_descriptors (it checks out_lengths / status / scratch)
    decode_descriptors(
        descs,
        n,
        t_addr,
        num_tables,
        out_lengths=out_lengths,
        status=status,
        scratch=scratch,
        num_threads=num_threads,
        stream=stream,
    )
    if on_cuda:
        keep_alive(keep, stream, dev)


def _check_cuda_tables(tables: Any, what: str) -> Any:
    """Raise ValueError unless ``tables`` is a contiguous CUDA uint16 ``[num_tables, 256]`` tensor
    (``what`` names the caller); returns the torch module."""
    torch = torch_module()
    if not is_cuda(tables) or tables.dtype != torch.uint16:
        raise ValueError(f"{what} needs the tables as a CUDA uint16 tensor")
    if tables.dim() != 2 or tables.shape[1] != 256 or not tables.is_contiguous():
        raise ValueError(f"tables must be contiguous [num_tables, 256], got {tuple(tables.shape)}")
    return torch


def build_run_luts(tables: Any, stream: Any = None) -> Any:
    """The decode lookups of static tables for CUDA decodes of table-switching streams.

    A warp decoding a stream that switches tables every run (``run_lens`` of :func:`encode_into`)
    otherwise builds each run's cdf and slot buckets from its 256 frequencies (``rans.h``'s
    ``kRunLutBytes`` layout); these are built once per table here and read by
    :func:`decode_descriptors` (``run_luts``): the same symbols and statuses, fewer instructions
    per run.

    Args:
        tables: uint16 ``[num_tables, 256]`` static tables, a contiguous CUDA tensor (as the
            decodes read them; tables that do not sum to 4096 get unspecified lookups, and their
            streams are refused by the decode as without lookups).
        stream: the CUDA stream to queue the build on (None: the current stream of their device).

    Returns:
        uint8 ``[num_tables, RUN_LUT_BYTES]`` on the tables' device, being built on ``stream``.

    Raises:
        ValueError: ``tables`` not a contiguous CUDA uint16 tensor of shape ``[num_tables, 256]``.
    """
    torch = _check_cuda_tables(tables, "build_run_luts")
    with torch.cuda.device(tables.device):  # the launch goes to the tables' GPU, whichever is current
        luts = torch.empty(tables.shape[0], RUN_LUT_BYTES, dtype=torch.uint8, device=tables.device)
        _R.build_run_luts(tables.data_ptr(), tables.shape[0], luts.data_ptr(), stream_handle(stream, tables.device))
    return luts


def build_tables_ok(tables: Any, stream: Any = None) -> Any:
    """The validity bitmap of static tables for CUDA decodes that read them (``decode_cuda``'s
    ``tables_ok`` in ``rans.h``): bit ``t % 32`` of word ``t // 32`` set when table ``t`` sums to
    4096. A decode given it does not read the tables again to check them; build it once for tables
    that do not change (a codec level's, uploaded once).

    Args:
        tables: uint16 ``[num_tables, 256]``, a contiguous CUDA tensor.
        stream: the CUDA stream to queue the check on (None: the current stream of their device).

    Returns:
        int32 ``[(num_tables + 31) // 32]`` on the tables' device, being written on ``stream``.

    Raises:
        ValueError: ``tables`` not a contiguous CUDA uint16 tensor of shape ``[num_tables, 256]``.
    """
    torch = _check_cuda_tables(tables, "build_tables_ok")
    with torch.cuda.device(tables.device):
        bits = torch.zeros(-(-tables.shape[0] // 32), dtype=torch.int32, device=tables.device)
        _R.tables_ok(tables.data_ptr(), tables.shape[0], bits.data_ptr(), stream_handle(stream, tables.device))
    return bits


def check_run_luts(run_luts: Any, num_tables: int) -> None:
    """Raise ValueError unless ``run_luts`` is None or shaped as :func:`build_run_luts` makes the decode
    lookups of ``num_tables`` tables: ``[num_tables, RUN_LUT_BYTES]``."""
    if run_luts is not None and tuple(run_luts.shape) != (num_tables, RUN_LUT_BYTES):
        raise ValueError(f"run_luts {tuple(run_luts.shape)} for {num_tables} tables")


def decode_descriptors(
    descs: Any,
    num_streams: int,
    tables_addr: int,
    num_tables: int,
    *,
    out_lengths: Any,
    status: Any,
    scratch: Any = None,
    num_threads: int = 0,
    stream: Any = None,
    run_luts: Any = None,
) -> None:
    """Decode ``num_streams`` streams described by a prebuilt :data:`DECODE_DESC` array, one native call.

    ``descs``: the descriptors — a host NumPy :data:`DECODE_DESC` array (CPU decode) or a CUDA uint8
    tensor of ``num_streams * 32`` bytes (CUDA decode, asynchronous on ``stream``, None: the current
    stream); every address in them must be of that side and stay valid until the decode finished.
    ``tables_addr`` / ``num_tables``: the ``[num_tables, 256]`` uint16 tables on the same side (0, 0:
    none). ``out_lengths`` int64 [N], ``status`` int32 [N], ``scratch`` (CUDA: >=
    ``decode_scratch_bytes(N)`` bytes): contiguous tensors/arrays on the same side. Same results and
    guarantees as :func:`decode_into`, without its per-call descriptor build and uploads.
    ``run_luts`` (CUDA only; None: none): uint8 on the device, from byte 0 the lookups of these
    ``num_tables`` tables (:func:`build_run_luts` of the same tables, or a slice of it from the first
    table on), read by table-switching streams.

    Raises:
        ValueError: out_lengths / status / descs / scratch too small or on the wrong side;
            ``run_luts`` with a CPU decode, shorter than ``num_tables`` lookups, or not on the
            descriptors' device.
    """
    n = int(num_streams)
    len_addr, len_bytes = addr_len(out_lengths)
    st_addr, st_bytes = addr_len(status)
    if len_bytes < 8 * n or st_bytes < 4 * n:
        raise ValueError("out_lengths must hold N int64 and status N int32")
    if is_cuda(descs):
        if descs.numel() * descs.element_size() < n * DECODE_DESC.itemsize:
            raise ValueError(f"descs holds fewer than {n} descriptors")
        if scratch is None:
            raise ValueError("CUDA decode needs scratch (decode_scratch_bytes(N) bytes on the device)")
        sc_addr, sc_bytes = addr_len(scratch)
        lut_addr = 0
        if run_luts is not None:
            if not is_cuda(run_luts) or run_luts.device != descs.device or not run_luts.is_contiguous():
                raise ValueError(f"run_luts must be contiguous on {descs.device}")
            if run_luts.numel() * run_luts.element_size() < int(num_tables) * RUN_LUT_BYTES:
                raise ValueError(f"run_luts hold fewer than the {num_tables} tables' lookups")
            lut_addr = run_luts.data_ptr()
        _R.decode(
            True,
            descs.data_ptr(),
            n,
            int(tables_addr),
            int(num_tables),
            len_addr,
            st_addr,
            sc_addr,
            sc_bytes,
            0,
            stream_handle(stream, descs.device),
            lut_addr,
        )
        return
    if run_luts is not None:
        raise ValueError("run_luts are CUDA decode lookups; a CPU decode takes none")
    d = np.asarray(descs)
    if d.dtype != DECODE_DESC or d.size < n or not d.flags.c_contiguous:
        raise ValueError(f"descs must be a contiguous DECODE_DESC array of >= {n} entries")
    _R.decode(False, d.ctypes.data, n, int(tables_addr), int(num_tables), len_addr, st_addr, 0, 0, int(num_threads), 0)


def decode(
    batch: EncodedBatch | Sequence[Any],
    tables: Any = None,
    *,
    lengths: Sequence[int] | None = None,
    num_threads: int = 0,
    stream: Any = None,
) -> list[Any]:
    """Decode encoded streams; returns one uint8 array (CPU) / tensor (CUDA) per stream.

    ``batch``: an :class:`EncodedBatch` or a sequence of encoded streams. ``lengths``: expected symbol
    counts (required for CUDA input unless read from the headers, which costs a device-to-host copy);
    a stream that decodes to a different count raises. Raises ValueError on any malformed stream.
    """
    sources = [batch.stream(i) for i in range(len(batch))] if isinstance(batch, EncodedBatch) else list(batch)
    n = len(sources)
    on_cuda = n > 0 and is_cuda(sources[0])
    if lengths is None:
        lengths = []
        for s in sources:
            info = bounded_stream_info(s)
            lengths.append(info.num_symbols)
    lengths = [int(x) for x in lengths]
    if len(lengths) != n:
        raise ValueError(f"got {len(lengths)} lengths for {n} streams")
    if on_cuda:
        torch = torch_module()
        dev = sources[0].device
        outs = [torch.empty(max(x, 0), dtype=torch.uint8, device=dev) for x in lengths]
        out_len = torch.zeros(n, dtype=torch.int64, device=dev)
        status = torch.zeros(max(n, 1), dtype=torch.int32, device=dev)
        scratch = torch.empty(decode_scratch_bytes(n), dtype=torch.uint8, device=dev)
        decode_into(sources, tables, outs=outs, out_lengths=out_len, status=status, scratch=scratch, stream=stream)
        sync_stream(stream, dev)
        st = status.cpu().numpy()[:n]
        got = out_len.cpu().numpy()
    else:
        srcs = []
        for s in sources:
            a = _as_u8_np(s) if not isinstance(s, (bytes, bytearray, memoryview)) else np.frombuffer(s, np.uint8)
            if a.ctypes.data % 4:
                a = a.copy()  # numpy allocations are aligned
            srcs.append(a)
        sources = srcs
        outs = [np.empty(max(x, 0), np.uint8) for x in lengths]
        got = np.zeros(n, np.int64)
        st = np.zeros(max(n, 1), np.int32)
        decode_into(sources, tables, outs=outs, out_lengths=got, status=st, num_threads=num_threads)
        st = st[:n]
    _raise_status(st, "decode")
    for i in range(n):
        if int(got[i]) != lengths[i]:
            raise ValueError(f"rans decode: stream {i} holds {int(got[i])} symbols, expected {lengths[i]}")
    return outs
