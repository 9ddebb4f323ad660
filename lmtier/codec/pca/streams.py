"""The rANS streams of a PCA record, on the host or a CUDA device: the streams of as many (layer group,
K/V) pairs as the coder's 16-bit table ids allow go into one coder call (:func:`batches`), queued on
the current stream and synchronized once, instead of one :func:`lmtier.codec.rans.encode` /
:func:`~lmtier.codec.rans.decode` per stream (one synchronization and a few warps each).

Table layout (the record format's): stream ``i`` of ``S`` codes its ``N`` runs with tables ``i * N ..
(i + 1) * N - 1`` of the level's ``[S * N, 256]`` tables. A coder call takes a slice of them, so the
stream's header names its first table *within its call's slice*: :func:`table_base`, ``(i % B) * N``
with ``B`` = :func:`streams_per_call`. The decoder checks every header against it, so a stream laid
out otherwise (another call split, an older record) is refused, never decoded with other tables.
"""

from __future__ import annotations

import contextlib
import threading
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from lmtier import cuda_streams
from lmtier.codec import rans
from lmtier.codec.native_args import device_bytes
from lmtier.codec.spans import Spans

__all__ = [
    "encode",
    "encode_runs",
    "QueuedEncode",
    "decode",
    "queue_spans",
    "QueuedStreams",
    "upload",
    "host_arrays",
    "check_spans",
    "check_decoded",
    "run_length",
    "streams_per_call",
    "table_base",
    "batches",
]

_ROW_ALIGN = 256
"""Each call's output region starts at a multiple of this many bytes (the coder needs 4)."""


def run_length(tokens: int) -> int:
    """``T32``: a chunk's token count rounded up to the coder's lanes: the length of each component's
    run of symbols (one table each) in a PCA record's streams."""
    return -(-tokens // rans.LANES) * rans.LANES


def streams_per_call(n: int) -> int:
    """``B``: streams of ``n`` tables each that one coder call codes: its table ids (16 bits, below
    :data:`lmtier.codec.rans.ADAPTIVE_TABLE`) reach ``B * n - 1``.

    Raises:
        ValueError: ``n`` < 1 or more tables than one stream can name."""
    if not 1 <= n <= rans.ADAPTIVE_TABLE:
        raise ValueError(f"a PCA stream of {n} tables: the coder's table ids name 1 .. {rans.ADAPTIVE_TABLE}")
    return rans.ADAPTIVE_TABLE // n


def table_base(i: int, n: int) -> int:
    """The table id stream ``i`` (of ``n`` tables) names in its header: its first table within its
    call's slice of the tables."""
    return (i % streams_per_call(n)) * n


def batches(num_streams: int, n: int) -> list[range]:
    """The coder calls of ``num_streams`` streams of ``n`` tables: consecutive stream ranges of at most
    :func:`streams_per_call` streams (call ``k`` takes tables ``k * B * n ..``)."""
    b = streams_per_call(n)
    return [range(lo, min(lo + b, num_streams)) for lo in range(0, num_streams, b)]


def _on(dev: torch.device):
    """The native coder launches on the current device: make ``dev`` current (host tensors: no-op)."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _tables(tables: torch.Tensor | np.ndarray, dev: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(tables)) if isinstance(tables, np.ndarray) else tables
    if t.dtype != torch.uint16 or t.dim() != 2 or t.shape[1] != 256:
        raise ValueError(f"rANS tables must be uint16 [num_tables, 256], got {t.dtype} {tuple(t.shape)}")
    return t.to(dev).contiguous()


def encode(
    sym: torch.Tensor, tables: torch.Tensor | np.ndarray, run_len: int, num_threads: int = 0
) -> list[np.ndarray]:
    """Encoded bytes (host uint8 arrays) of each row of ``sym``: :func:`encode_runs`' streams one by one.

    Args:
        sym: uint8 ``[S, N * run_len]`` on the host or a CUDA device, row ``i`` coded with ``tables[i *
            N : (i + 1) * N]``, one table per run of ``run_len`` symbols (a positive multiple of 32).
        tables: uint16 ``[S * N, 256]`` (a tensor, moved to ``sym``'s device, or a NumPy array).
        num_threads: host coder threads (0: its default; CUDA: ignored).

    Raises:
        ValueError: a coder status other than ok (bad tables), or ``tables`` not ``S`` streams' worth.
    """
    return [data[a:b] for data, off in encode_runs(sym, tables, run_len, num_threads) for a, b in zip(off, off[1:])]


def encode_runs(
    sym: torch.Tensor, tables: torch.Tensor | np.ndarray, run_len: int, num_threads: int = 0
) -> list[tuple[np.ndarray, list[int]]]:
    """The streams of :func:`encode` as one run per coder call (:func:`batches`), what
    :func:`lmtier.codec.format.pack_runs` copies at once: ``(data, offsets)`` with stream ``i`` of the
    call at ``data[offsets[i]:offsets[i + 1]]`` (host uint8; the calls' data are views of one buffer).
    Arguments and errors as :func:`encode`."""
    q = QueuedEncode(sym, tables, run_len, num_threads)
    (checks,) = host_arrays(q.checks)
    return q.runs(checks)[0]


class QueuedEncode:
    """The coder calls of :func:`encode_runs` queued (CUDA: on the current stream, the calls side by
    side on this thread's side streams, joined back), nothing read back yet: the host reads
    :attr:`checks` (with whatever else it needs from the device, in one copy), then :meth:`runs`
    copies the streams out.

    Args:
        As :func:`encode`.

    Raises:
        ValueError: ``tables`` not ``S`` streams' worth (the coder's status: from :meth:`runs`).
    """

    def __init__(
        self, sym: torch.Tensor, tables: torch.Tensor | np.ndarray, run_len: int, num_threads: int = 0
    ) -> None:
        s_count, length = sym.shape
        dev = sym.device
        self._dev, self._s_count = dev, s_count
        self.calls: list[range] = []
        self.checks = torch.zeros(0, dtype=torch.int64, device=dev)
        """int64 on ``sym``'s device: per call its output offsets ``[B + 1]``, then the streams'
        status (int32 pairs)."""
        with _on(dev):
            tables = _tables(tables, dev)
            if s_count == 0:
                return
            if tables.shape[0] % s_count or length != tables.shape[0] // s_count * run_len:
                raise ValueError(
                    f"{tables.shape[0]} tables for {s_count} streams of {length} symbols in runs of {run_len}"
                )
            n = tables.shape[0] // s_count
            calls = self.calls = batches(s_count, n)
            b = self._b = len(calls[0])
            bound = -(-rans.max_batch_encoded_bytes(b, b * length) // _ROW_ALIGN) * _ROW_ALIGN
            out = self._out = torch.empty(len(calls), bound, dtype=torch.uint8, device=dev)
            checks = self.checks = torch.zeros(len(calls) * (b + 1) + -(-s_count // 2), dtype=torch.int64, device=dev)
            offsets = checks[: len(calls) * (b + 1)].view(len(calls), b + 1)
            status = checks[len(calls) * (b + 1) :].view(torch.int32)[:s_count]
            rows = sym.contiguous().view(-1)  # each stream a byte range of one buffer: no tensor per stream
            # one scratch per call, all alive until the calls joined: the calls run at the same time, as
            # the decode's (a call's time is its longest segment's, so the lone last call would double
            # the encode)
            if dev.type == "cuda":
                scratch = [torch.empty(rans.encode_scratch_bytes(len(c), len(c) * length), dtype=torch.uint8,
                                       device=dev) for c in calls]  # fmt: skip
            else:  # the host coder's calls run in turn: one scratch
                scratch = [torch.empty(rans.encode_scratch_bytes(b, b * length), dtype=torch.uint8)] * len(calls)
            with _side_by_side(dev, len(calls)) as streams_of:
                # the current stream's call last: each call uploads its descriptors with a copy that
                # waits for the current stream, which then holds none of the other calls
                for k, (c, sc, stream) in enumerate(zip(calls, scratch, streams_of[1:] + streams_of[:1], strict=True)):
                    rans.encode_into(
                        Spans((rows,), np.zeros(len(c), np.int64), np.arange(c.start, c.stop) * length,
                              np.full(len(c), length)),
                        [table_base(i, n) for i in c],
                        tables[c.start * n : c.stop * n],
                        out=out[k],
                        offsets=offsets[k],
                        status=status[c.start : c.stop],
                        scratch=sc,
                        run_lens=run_len,
                        num_threads=num_threads,
                        stream=stream,
                    )  # fmt: skip

    def runs(
        self, checks: np.ndarray, extra: tuple[torch.Tensor, ...] = ()
    ) -> tuple[list[tuple[np.ndarray, list[int]]], list[np.ndarray]]:
        """``(runs, extra)``: the runs of :func:`encode_runs`, and each tensor of ``extra`` (contiguous,
        on the streams' device) as a host NumPy array of its dtype and shape. CUDA: all copied into
        one page-locked buffer, one synchronization.

        Args:
            checks: the host copy of :attr:`checks`.

        Raises:
            ValueError: a coder status other than ok (bad tables)."""
        if not self.calls:
            return [], list(host_arrays(*extra))
        calls, b, s_count = self.calls, self._b, self._s_count
        rans._raise_status(checks[len(calls) * (b + 1) :].view(np.int32)[:s_count], "encode")
        offs = checks[: len(calls) * (b + 1)].reshape(len(calls), b + 1)
        used = [int(offs[k, len(c)]) for k, c in enumerate(calls)]
        firsts = np.cumsum([0] + used[:-1])
        if self._dev.type == "cuda":  # into page-locked memory (torch's caching host allocator): DMA
            sizes = [t.numel() * t.element_size() for t in extra]
            places = np.cumsum([-(-sum(used) // 8) * 8] + [-(-z // 8) * 8 for z in sizes])
            host = torch.empty(int(places[-1]), dtype=torch.uint8, pin_memory=True)
            for k, (f, u) in enumerate(zip(firsts, used)):
                host[f : f + u].copy_(self._out[k, :u], non_blocking=True)
            for t, at, z in zip(extra, places, sizes):
                host[at : at + z].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            torch.cuda.current_stream(self._dev).synchronize()
            flat = host.numpy()
            more = [host[at : at + z].view(t.dtype).reshape(t.shape).numpy() for t, at, z in zip(extra, places, sizes)]
        else:
            flat = torch.cat([self._out[k, :u] for k, u in enumerate(used)]).numpy()
            more = list(host_arrays(*extra))
        parts = zip(calls, firsts, used, strict=True)
        runs = [(flat[f : f + u], offs[k, : len(c) + 1].tolist()) for k, (c, f, u) in enumerate(parts)]
        return runs, more


def host_arrays(*ts: torch.Tensor) -> list[np.ndarray]:
    """NumPy arrays of tensors: CUDA ones copied into page-locked memory (torch's caching host
    allocator: DMA, not staged copies) on the current stream, one synchronization for all."""
    out, devs = [], {t.device for t in ts if t.device.type == "cuda"}
    for t in ts:
        out.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) if t.is_cuda else t)
    for d in devs:
        torch.cuda.current_stream(d).synchronize()
    return [t.numpy() for t in out]


def decode(
    sections: list,
    tables: torch.Tensor | np.ndarray,
    length: int,
    device: torch.device,
    num_threads: int = 0,
    *,
    run_luts: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 ``[S, length]`` on ``device`` (the host or a CUDA device): the symbols of encoded streams
    (host bytes-like, each its own buffer) with the table layout of :func:`encode`. Packs them into one
    region and decodes it with :func:`queue_spans` (a record's streams are one region already: use that;
    ``run_luts`` as there).

    Raises:
        ValueError: as :func:`queue_spans` and :meth:`QueuedStreams.result`.
    """
    sizes = [memoryview(s).nbytes for s in sections]
    starts = np.concatenate([[0], np.cumsum([-(-z // 4) * 4 for z in sizes])]).astype(np.int64)
    region = np.zeros(int(starts[-1]), np.uint8)
    for st, sec, z in zip(starts, sections, sizes):
        region[st : st + z] = np.frombuffer(sec, np.uint8)
    sizes_ = np.asarray(sizes, np.int64)
    return queue_spans(region, starts[:-1], sizes_, tables, length, device, num_threads, run_luts=run_luts).result()


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 copy of host array ``a``'s bytes on CUDA ``device``, queued on its current stream without
    waiting (:func:`lmtier.codec.native_args.device_bytes`)."""
    return device_bytes(a, device)


class QueuedStreams(NamedTuple):
    """Decoded symbols of :func:`queue_spans` (on a CUDA device: still being decoded on the stream that
    was current) with the coder's per-stream ``status`` (int32 ``[S]``) and symbol ``counts`` (int64
    ``[S]``) beside them, not yet checked: :meth:`verify` them before the symbols are trusted."""

    symbols: torch.Tensor
    status: torch.Tensor
    counts: torch.Tensor
    length: int
    stream: Any = None
    """CUDA: the stream the decode was queued on (:meth:`result` reads the checks after its work)."""

    def verify(self, status: np.ndarray, counts: np.ndarray) -> None:
        """Check the host copies of :attr:`status` and :attr:`counts`.

        Raises:
            ValueError: a stream that did not decode, or decoded to another count than ``length``."""
        check_decoded(status, counts, self.length)

    def result(self) -> torch.Tensor:
        """The symbols, once :meth:`verify` passed on this device's values (waits for the decode, on
        the stream it was queued on whatever stream is current)."""
        with contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream):
            self.verify(self.status.cpu().numpy(), self.counts.cpu().numpy())
        return self.symbols


def queue_spans(
    region: Any,
    starts: Any,
    sizes: Any,
    tables: torch.Tensor | np.ndarray,
    length: int,
    device: torch.device,
    num_threads: int = 0,
    *,
    uploaded: torch.Tensor | None = None,
    run_luts: torch.Tensor | None = None,
) -> QueuedStreams:
    """The symbols, uint8 ``[S, length]`` on ``device`` (the host or a CUDA device), of the ``S``
    encoded streams at ``region[starts[i] : starts[i] + sizes[i]]`` (host bytes-like; ``starts``
    4-byte aligned, as a record's sections are) with the table layout of :func:`encode`: their decode
    queued on ``device``'s current stream without waiting for it (the host decodes at once), the
    coder's status and counts not yet checked (:meth:`QueuedStreams.result` checks them and hands
    out the symbols).

    Args:
        uploaded: CUDA ``device`` only: uint8 ``region`` already on the device (from byte 0; e.g. one
            upload of a whole record), read in place. None: the streams' bytes are uploaded
            (:func:`upload`).
        run_luts: CUDA ``device`` only: :func:`lmtier.codec.rans.build_run_luts` of ``tables`` (the
            coder reads them instead of building each run's lookups); None: none.

    Raises:
        ValueError: a stream whose header is not one, announces another count than ``length`` or one
            its bytes cannot hold (checked before anything is allocated), names another first table
            than :func:`table_base` or another table run than ``length / N`` (laid out otherwise); a
            misaligned or out-of-region span (negative sizes included); ``uploaded`` shorter than the
            spans, or not on ``device``.
    """
    starts, sizes = np.asarray(starts, np.int64).reshape(-1), np.asarray(sizes, np.int64).reshape(-1)
    if starts.size != sizes.size:
        raise ValueError(f"{starts.size} stream starts and {sizes.size} sizes")
    with _on(device):
        return _queue(region, starts, sizes, _tables(tables, device), length, device, num_threads, uploaded, run_luts)


def _queue(
    region: Any,
    starts: np.ndarray,
    sizes: np.ndarray,
    tables: torch.Tensor,
    length: int,
    device: torch.device,
    num_threads: int,
    uploaded: torch.Tensor | None,
    run_luts: torch.Tensor | None = None,
) -> QueuedStreams:
    s_count, cuda = len(starts), device.type == "cuda"
    current = cuda_streams.current(device) if cuda else None  # the stream the decode is queued on
    if s_count == 0:
        none = torch.empty(0, dtype=torch.int64, device=device)
        return QueuedStreams(
            torch.empty(0, length, dtype=torch.uint8, device=device), none.int(), none, length, current
        )
    if tables.shape[0] % s_count:
        raise ValueError(f"{tables.shape[0]} tables for {s_count} streams")
    n = tables.shape[0] // s_count
    rans.check_run_luts(run_luts, tables.shape[0])
    host = np.frombuffer(region, np.uint8)
    check_spans(host, starts, sizes, length, n)  # before anything is allocated
    lo, hi = int(starts.min()), int((starts + sizes).max())
    if cuda:
        if uploaded is None:  # lo is 4-byte aligned (checked above), so every span keeps its alignment
            src, base_addr = upload(host[lo:hi], device), lo
        elif uploaded.device != device or uploaded.dtype != torch.uint8 or uploaded.numel() < hi:
            raise ValueError(f"uploaded region: {uploaded.dtype} of {uploaded.numel()} on {uploaded.device}, "
                             f"the spans need uint8 of {hi} bytes on {device}")  # fmt: skip
        else:
            src, base_addr = uploaded, 0
    else:  # read in place; the coder needs 4-byte aligned addresses
        src, base_addr = host[lo:hi], lo
        if src.ctypes.data % 4:
            src = src.copy()
    out = torch.empty(s_count, length, dtype=torch.uint8, device=device)
    got = torch.zeros(s_count, dtype=torch.int64, device=device)
    status = torch.zeros(s_count, dtype=torch.int32, device=device)
    calls = batches(s_count, n)
    desc = np.empty(s_count, rans.DECODE_DESC)  # one descriptor per stream, built at once
    desc["src"] = (src.data_ptr() if cuda else src.ctypes.data) + (starts - base_addr)
    desc["src_bytes"], desc["dst"], desc["dst_capacity"] = sizes, out.data_ptr() + length * np.arange(s_count), length
    descs = upload(desc, device) if cuda else desc  # every call's descriptors, one copy
    # one scratch per call, all alive until the calls joined: the calls run at the same time
    scratch = [torch.empty(rans.decode_scratch_bytes(len(c)), dtype=torch.uint8, device=device) if cuda else None
               for c in calls]  # fmt: skip
    with _side_by_side(device, len(calls)) as streams_of:
        for c, sc, stream in zip(calls, scratch, streams_of, strict=True):
            rans.decode_descriptors(
                descs[c.start * rans.DECODE_DESC.itemsize :] if cuda else desc[c.start :],
                len(c),
                tables[c.start * n].data_ptr(),
                len(c) * n,
                out_lengths=got[c.start : c.stop],
                status=status[c.start : c.stop],
                scratch=sc,
                num_threads=num_threads,
                stream=stream,
                run_luts=None if run_luts is None else run_luts[c.start * n :],
            )
    # src, scratch and descs are freed here with work still queued that reads them: their memory goes
    # back to torch's pool for the current stream only, which waits for every call before later work
    return QueuedStreams(out, status, got, length, current)


def check_decoded(status: np.ndarray, counts: np.ndarray, length: int) -> None:
    """Check a decode's host copies of the coder's per-stream ``status`` (int32) and symbol ``counts``
    (int64) against the ``length`` symbols every stream must decode to.

    Raises:
        ValueError: a stream that did not decode, or decoded to another count than ``length``."""
    rans._raise_status(status, "decode")
    if (counts != length).any():
        raise ValueError(f"rANS streams of {sorted(set(counts.tolist()))} symbols, {length} expected")


def check_spans(host: np.ndarray, starts: np.ndarray, sizes: np.ndarray, length: int, n: int) -> None:
    """Check the ``S`` stream spans ``host[starts[i] : starts[i] + sizes[i]]`` (uint8; int64 ``starts``,
    ``sizes``) of streams of ``n`` tables decoding to ``length`` symbols each, before a decode reads them.

    Raises:
        ValueError: as :func:`queue_spans` (every header read, none decoded)."""
    if (starts < 0).any() or (sizes < 0).any() or (sizes > host.size - starts).any() or (starts % 4).any():
        raise ValueError(f"stream spans outside the region of {host.size} bytes or not 4-byte aligned")
    if _headers_as_laid_out(host, starts, sizes, length, n):
        return
    heads = rans.stream_headers(host, starts, sizes)
    if (heads["num_symbols"] != length).any():
        raise ValueError(f"rANS streams of {sorted(set(heads['num_symbols'].tolist()))} symbols, {length} expected")
    base = table_base(np.arange(len(starts)), n)
    if (heads["table_id"] != base).any():
        i = int(np.flatnonzero(heads["table_id"] != base)[0])
        raise ValueError(f"stream {i} names table {int(heads['table_id'][i])}, its layout needs {int(base[i])}")
    run = 32 * heads["run_words"].astype(np.int64)
    bad_run = ((heads["flags"] & 1) == 0) & (run != length // n)  # an adaptive stream codes with its own table
    if bad_run.any():
        i = int(np.flatnonzero(bad_run)[0])
        raise ValueError(f"stream {i} switches tables every {int(run[i])} symbols, its layout needs {length // n}")


def _headers_as_laid_out(host: np.ndarray, starts: np.ndarray, sizes: np.ndarray, length: int, n: int) -> bool:
    """Whether every stream's 16-byte header is exactly the one :func:`encode` writes for this layout
    (static tables switched every ``length / n`` symbols from table :func:`table_base`, ``length``
    symbols, the first stream's valid segment size) and its bytes can hold its segments: the common
    case, checked with a few whole-array operations (``check_spans`` runs at every decode, holding
    the GIL). False: :func:`check_spans` checks the headers field by field (and names what is wrong)."""
    s = len(starts)
    if s == 0 or n <= 0 or not 0 <= length <= rans.MAX_STREAM_SYMBOLS or (sizes < rans.HEADER_BYTES).any():
        return False
    if length % n or (length // n) % 32 or length // n // 32 > 0xFFFF:
        return False
    raw = host[starts[:, None] + np.arange(rans.HEADER_BYTES)]  # [S, 16]
    seg_log2 = int(raw[0, 6])
    if not rans.MIN_SEG_LOG2 <= seg_log2 <= rans.MAX_SEG_LOG2:
        return False
    if not np.array_equal(raw, _laid_out_headers(s, length, n, seg_log2)):
        return False
    return bool((sizes >= rans.min_stream_bytes(-(-length // (1 << seg_log2)))).all())


@lru_cache(maxsize=32)
def _laid_out_headers(s: int, length: int, n: int, seg_log2: int) -> np.ndarray:
    """The 16-byte headers (uint8 ``[S, 16]``, read-only) :func:`encode` writes for ``s`` streams of
    this layout (:func:`_headers_as_laid_out`)."""
    want = np.zeros(s, rans.HEADER)
    want["magic"], want["version"], want["seg_log2"], want["lanes"] = (
        rans.MAGIC,
        rans.VERSION,
        seg_log2,
        rans.LANES_LOG2,
    )
    want["table_id"] = table_base(np.arange(s), n)
    want["run_words"], want["num_symbols"] = length // n // 32, length
    out = want.view(np.uint8).reshape(s, rans.HEADER_BYTES)
    out.flags.writeable = False
    return out


_local = threading.local()


@contextlib.contextmanager
def _side_by_side(device: torch.device, calls: int):
    """The streams ``calls`` coder calls run on, yielded in order: None each on the host; on a CUDA
    device the current stream for the first and this thread's side streams for the others (from
    torch's pool: one may be another thread's or the current one, when the events keep the order and
    those calls run in turn), which start after the work queued so far on the current stream and
    which the current stream waits for on leaving (so the calls run at the same time). A call's time
    is one warp's work on its longest segment however few streams it has, and :func:`batches` splits
    a record's ``2R`` streams as 63 and 1 (``N`` = 1,024): in turn, the lone stream's call would
    double the decode."""
    if device.type != "cuda":
        yield [None] * calls
        return
    main = cuda_streams.current(device)
    if calls == 1:
        yield [main]
        return
    sides = _local.__dict__.setdefault("sides", {}).setdefault(device, [])
    while len(sides) < calls - 1:
        sides.append(torch.cuda.Stream(device=device))
    forked = torch.cuda.Event()
    forked.record(main)
    for s in sides[: calls - 1]:
        s.wait_event(forked)
    try:
        yield [main, *sides[: calls - 1]]
    finally:
        for s in sides[: calls - 1]:
            joined = torch.cuda.Event()
            joined.record(s)
            main.wait_event(joined)
