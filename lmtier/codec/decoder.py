"""Reusable decode state for codec records: :class:`ChunkDecoder` (the hot path of every record load).

:func:`lmtier.codec.chunk.decode_chunk` and :class:`lmtier.tiers.codec.CodecTier` decode through
a :class:`ChunkDecoder` — one per (geometry, dtype, level, static table set, device) — which keeps
everything a decode needs from one call to the next:

* **Tables**: the static rANS table set goes to each device once (:func:`device_tables`, cached per
  (table set, device) for the life of the :class:`~lmtier.codec.chunk.StaticTables` object and
  counted by :func:`table_uploads`), never per call.
* **Slots** (:class:`DecodeSlot`, a small pool: one per concurrent caller, at most
  ``max_idle_slots`` kept idle): a page-aligned host record buffer of ``max_record_bytes`` (pinned
  for CUDA decoders — the tier reads the record straight into it), and, preallocated once per slot,
  the rANS decode descriptors (destinations fixed; only the sources change per record), the symbol
  / side / chunk work buffers, the status block and, on CUDA, the record's device copy, the coder's
  scratch and a CUDA stream of the slot's own (a non-default stream from torch's pool).
* **One host sync per chunk** (CUDA): on the slot's stream, async H2D of the descriptors and the
  record, one batched rANS decode, one native dequantize into the slot's chunk buffer, one D2H of
  the status block (rANS status + decoded lengths + dequantize flags), then a sync of that stream
  alone. Only once the host has checked every status is the chunk copied into the caller's ``out``
  — so ``out`` is written only for a record that passed every check, and concurrent callers (the
  tier manager's I/O threads) overlap on their own streams.

Where the chunk lands (CUDA ``out``): by default :meth:`ChunkDecoder.decode` returns once ``out``
holds the chunk (the copy into ``out`` first waits for the caller's current stream, which may still
be reading ``out``; then the slot's stream is synchronized). With ``stream=s`` it returns as soon
as the record is verified, with the copy into ``out`` ordered before any work queued on ``s``
afterwards (``s`` waits for the slot's stream; nothing else about ``out`` may be assumed on the
host). Until ``s`` reaches that copy the slot's stream waits for it, so a later decode that gets
the same slot queues behind ``s``'s earlier work.

CPU decoders run the same steps with host buffers (the native multi-threaded CPU rANS decoder and
dequantizer, or the torch reference :mod:`lmtier.codec.quant` where :data:`~lmtier.codec.chunk.USE_NATIVE`
is False or the level is not native); all paths give bit-identical chunks.

Thread-safe: slots are handed out under a lock, one caller at a time per slot.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from lmtier.tiers.buffers import AlignedBuffer

from . import chunk as cchunk
from . import format as fmt
from . import quant, rans
from .levels import Level, get_level
from .quant import CodecInputError

__all__ = ["ChunkDecoder", "DecodeSlot", "device_tables", "shared_decoder", "table_uploads"]

# ------------------------------------------------------------------------------------------------
# static tables on the device, uploaded once

_TABLES_LOCK = threading.Lock()
_TABLES: dict[tuple[int, str], tuple[weakref.ref, torch.Tensor]] = {}
_UPLOADS = [0]


def table_uploads() -> int:
    """How many static table sets :func:`device_tables` has copied to a device so far (process-wide;
    tests use it to check that decoding never re-uploads tables)."""
    with _TABLES_LOCK:
        return _UPLOADS[0]


def _drop_tables(key: tuple[int, str]) -> None:
    with _TABLES_LOCK:
        _TABLES.pop(key, None)


def device_tables(tables: cchunk.StaticTables, device: Any) -> torch.Tensor:
    """The table set's ``[N, 256]`` uint16 frequencies as a flat uint8 CUDA tensor (``N * 512``
    bytes) on ``device`` — uploaded on the first call for this (table set object, device) and
    cached while the :class:`~lmtier.codec.chunk.StaticTables` object lives (its arrays are treated
    as immutable). The upload is complete when this returns (usable from any stream)."""
    dev = torch.device(device)
    key = (id(tables), str(dev))
    with _TABLES_LOCK:
        hit = _TABLES.get(key)
        if hit is not None and hit[0]() is tables:
            return hit[1]
        src = torch.from_numpy(np.ascontiguousarray(tables.tables).view(np.uint8).reshape(-1))
        with torch.cuda.device(dev):
            t = src.to(dev)
            torch.cuda.current_stream(dev).synchronize()
        _TABLES[key] = (weakref.ref(tables), t)
        weakref.finalize(tables, _drop_tables, key)
        _UPLOADS[0] += 1
        return t


# ------------------------------------------------------------------------------------------------
# slots


def _ctl_bytes(n: int) -> int:
    """Status block of ``n`` sections: decoded lengths int64 [n] | rANS status int32 [n] | dequantize
    status int32 [1], padded to 16 bytes."""
    return (12 * n + 4 + 15) // 16 * 16


class DecodeSlot:
    """One caller's preallocated decode state (see the module doc); get one with
    :meth:`ChunkDecoder.slot`.

    Attributes:
        record: writable, page-aligned ``uint8`` memoryview of the host record buffer
            (``>= max_record_bytes``; pinned for CUDA decoders). A record read into it is decoded
            without a further host copy.
        stream: the slot's ``torch.cuda.Stream`` (None for CPU decoders).
    """

    def __init__(self, dec: ChunkDecoder) -> None:
        self.owner = dec
        cuda = dec.device.type == "cuda"
        n = dec.num_sections
        self._host = AlignedBuffer(dec.max_record_bytes, pinned=cuda)
        self.record = self._host.mv[: self._host.nbytes]
        self.record_address = self._host.address
        self._record_t = self._host.tensor(self._host.nbytes)
        self._record_np = np.frombuffer(self.record, np.uint8)
        self.stream = torch.cuda.Stream(device=dec.device) if cuda else None
        with dec._on(self.stream):

            def mk(nb: int) -> torch.Tensor:
                return torch.empty(max(1, nb), dtype=torch.uint8, device=dec.device)

            self.rec_dev = mk(dec.max_record_bytes) if cuda else None
            self.sym = mk(dec.sym_bytes)
            self.side = mk(dec.side_bytes)
            self.work = torch.empty(dec.shape, dtype=dec.dtype, device=dec.device)  # 16-byte aligned
            self.ctl = torch.zeros(_ctl_bytes(n), dtype=torch.uint8, device=dec.device)
            self.scratch = mk(rans.decode_scratch_bytes(n)) if cuda else None
            self.desc_dev = mk(n * rans.DECODE_DESC.itemsize) if cuda else None
        self.lens = self.ctl[: 8 * n].view(torch.int64)
        self.status = self.ctl[8 * n : 12 * n].view(torch.int32)
        self.nstatus = self.ctl[12 * n : 12 * n + 4].view(torch.int32)
        if cuda:
            self.ctl_host = torch.zeros(_ctl_bytes(n), dtype=torch.uint8, pin_memory=True)
            self._desc_t = torch.zeros(n * rans.DECODE_DESC.itemsize, dtype=torch.uint8, pin_memory=True)
            self.desc = self._desc_t.numpy().view(rans.DECODE_DESC)
        else:
            self.ctl_host = self.ctl
            self.desc = np.zeros(n, rans.DECODE_DESC)
        sym_addr, side_addr = self.sym.data_ptr(), self.side.data_ptr()
        self.desc["dst"] = np.where(dec.to_side, side_addr, sym_addr) + dec.offsets
        self.desc["dst_capacity"] = dec.lengths
        self._native_batch = None  # lmtier.codec.native.NativeBatch over (work, sym, side), built on first use
        if cuda:
            self.stream.synchronize()

    def native_batch(self, nat: Any) -> Any:
        """The prebuilt native dequantize batch (one descriptor upload, on first use)."""
        if self._native_batch is None:
            d = self.owner
            with d._on(self.stream):
                self._native_batch = nat.make_batch(
                    [self.work],
                    [self.sym[: nat.symbol_bytes(d.shape)]],
                    [self.side[: nat.side_bytes(d.level, d.shape)]],
                )
            if self.stream is not None:
                self.stream.synchronize()
        return self._native_batch

    def close(self) -> None:
        self._host.close()


# ------------------------------------------------------------------------------------------------
# the decoder

_OWN_TABLES = object()  # ChunkDecoder.decode's default: the decoder's own table set


class ChunkDecoder:
    """Decode codec records of one geometry, dtype, level and table set into buffers on ``device``.

    Args:
        shape: canonical chunk shape ``(L, 2, T, H, D)`` the records must have.
        dtype: ``torch.bfloat16`` / ``torch.float16`` (or their names) the records must hold.
        level: the codec level the records must have (name, id or :class:`Level`).
        tables: the static table set records coded with one must use (None: records must use
            per-stream tables); records coded with another set are :class:`CodecRecordError`.
        device: where ``out`` lives (``"cpu"`` or a CUDA device).
        num_threads: CPU decoder threads (0: the coder's default); unused on CUDA.
        max_idle_slots: idle :class:`DecodeSlot` kept for reuse (more are created while that many
            callers decode at once, and freed when they return).

    Raises:
        ValueError / TypeError: bad shape, dtype or level.
    """

    def __init__(
        self,
        *,
        shape: Sequence[int],
        dtype: Any,
        level: str | int | Level,
        tables: cchunk.StaticTables | None = None,
        device: Any = "cpu",
        num_threads: int = 0,
        max_idle_slots: int = 4,
    ) -> None:
        self.shape = cchunk._shape(shape)
        self.dtype = cchunk._dtype(dtype)
        self.level = get_level(level)
        self.tables = tables
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_threads = int(num_threads)
        self.max_idle_slots = int(max_idle_slots)
        self.raw_bytes = math.prod(self.shape) * 2
        self.max_record_bytes = cchunk.max_record_bytes(self.shape, self.level)
        self.to_side, self.offsets, self.lengths = cchunk.section_layout(self.level, self.shape)
        self.num_sections = len(self.lengths)
        self.sym_bytes, self.side_bytes = cchunk.decoded_buffer_bytes(self.level, self.shape)
        self._free: list[DecodeSlot] = []
        self._lock = threading.Lock()
        self.slots_created = 0

    # ---- slots -------------------------------------------------------------------------------

    def _on(self, stream: Any):
        """Context: this decoder's device and ``stream`` current (a no-op on the CPU)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        if stream is not None:
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    def acquire(self) -> DecodeSlot:
        """A free slot (a new one when all are in use); hand it back with :meth:`release`."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self.slots_created += 1
        return DecodeSlot(self)

    def release(self, slot: DecodeSlot) -> None:
        """Return ``slot`` to the pool (freed when ``max_idle_slots`` are already idle)."""
        with self._lock:
            if len(self._free) < self.max_idle_slots:
                self._free.append(slot)
                return
        slot.close()

    @contextlib.contextmanager
    def slot(self) -> Iterator[DecodeSlot]:
        """``with decoder.slot() as s:`` read a record into ``s.record``, then ``decode(..., slot=s)``."""
        s = self.acquire()
        try:
            yield s
        finally:
            self.release(s)

    def close(self) -> None:
        """Free the idle slots (slots in use are freed when released)."""
        with self._lock:
            free, self._free = self._free, []
            self.max_idle_slots = 0
        for s in free:
            s.close()

    # ---- decode ------------------------------------------------------------------------------

    def decode(
        self,
        record: Any,
        out: torch.Tensor,
        *,
        slot: DecodeSlot | None = None,
        stream: Any = None,
        tables: Any = _OWN_TABLES,
    ) -> None:
        """Verify ``record`` and decode it into ``out``.

        Args:
            record: the record in host memory (bytes-like, NumPy, CPU uint8 tensor; trailing bytes
                ignored) — ideally ``slot.record[:n]``, which saves a host copy on CUDA.
            out: contiguous tensor on this decoder's device, ``>=`` the chunk's bytes (any dtype,
                written as bytes; the chunk lands in its first ``L*2*T*H*D*2`` bytes).
            slot: a slot of this decoder the caller holds (None: one is taken for the call).
            stream: CUDA only: return once the record is verified, with the copy into ``out``
                ordered before later work on this ``torch.cuda.Stream`` (see the module doc);
                None: return once ``out`` holds the chunk.
            tables: the static table set records coded with one must use, when it is not this
                decoder's :attr:`tables` (e.g. one of a :class:`lmtier.codec.autotables.AutoTables`'
                sets, chosen by the record's ``table_id``); None: the record must use per-stream tables.

        ``out`` is written only after the whole record decoded and passed every check.

        Raises:
            CodecRecordError: the record is unusable (checksum, structure, level, geometry, dtype,
                table set, rANS status, symbol count, symbol range).
            TypeError / ValueError: bad ``out`` (not a tensor, other device, too small,
                non-contiguous), a slot of another decoder, ``stream`` with a CPU decoder.
        """
        dst = cchunk._dest(out, self.raw_bytes)
        buf = cchunk._host_u8(record)
        rec, _lv, tab = cchunk.parse_record(
            buf,
            expected_shape=self.shape,
            dtype=self.dtype,
            level=self.level,
            tables=self.tables if tables is _OWN_TABLES else tables,
        )
        self.decode_parsed(buf, rec, tab, dst, slot=slot, stream=stream)

    def decode_parsed(
        self,
        buf: np.ndarray,
        rec: fmt.Record,
        tables: cchunk.StaticTables | None,
        dst: torch.Tensor,
        *,
        slot: DecodeSlot | None = None,
        stream: Any = None,
    ) -> None:
        """:meth:`decode` of a record :func:`lmtier.codec.chunk.parse_record` already verified
        (``buf``: its host bytes, 4-byte aligned; ``tables``: the set it uses or None; ``dst``: flat
        uint8 ``[raw_bytes]`` view of ``out``)."""
        if dst.device != self.device:
            raise ValueError(f"out is on {dst.device}, this decoder decodes on {self.device}")
        if stream is not None and self.device.type != "cuda":
            raise ValueError("stream= is for CUDA decoders")
        if slot is not None and slot.owner is not self:
            raise ValueError("slot belongs to another decoder")
        with contextlib.ExitStack() as stack:
            s = stack.enter_context(self.slot()) if slot is None else slot
            try:
                self._run(s, buf, rec, tables, dst, stream)
            except BaseException:
                if s.stream is not None:  # nothing of this call may still run when the slot is reused
                    with contextlib.suppress(Exception):
                        s.stream.synchronize()
                raise

    def _tables(self, tables: cchunk.StaticTables | None) -> tuple[int, int]:
        """(address, count) of the table set where the decoder reads it (0, 0 without one)."""
        if tables is None:
            return 0, 0
        n = int(tables.tables.shape[0])
        if self.device.type == "cuda":
            return device_tables(tables, self.device).data_ptr(), n
        return tables.tables.ctypes.data, n

    def _run(
        self,
        slot: DecodeSlot,
        buf: np.ndarray,
        rec: fmt.Record,
        tables: cchunk.StaticTables | None,
        dst: torch.Tensor,
        stream: Any,
    ) -> None:
        cuda = self.device.type == "cuda"
        n = self.num_sections
        lv, shp, dt = cchunk.record_level(self.level, rec), self.shape, self.dtype
        t_addr, num_tables = self._tables(tables)
        caller = torch.cuda.current_stream(self.device) if cuda and stream is None else stream
        nat = cchunk._native()
        if nat is not None and not nat.supported(lv, shp, self.device):
            nat = None
        keep = None
        with self._on(slot.stream):
            desc = slot.desc
            if cuda:
                nb = rec.nbytes
                if nb <= slot.rec_dev.numel():
                    if buf.ctypes.data != slot.record_address:
                        slot._record_np[:nb] = buf[:nb]
                    slot.rec_dev[:nb].copy_(slot._record_t[:nb], non_blocking=True)
                    base = slot.rec_dev.data_ptr()
                else:  # longer than any record encode_chunk makes (metadata, gaps): a one-off upload
                    keep = torch.from_numpy(np.array(buf[:nb])).to(self.device)
                    base = keep.data_ptr()
            else:
                base = buf.ctypes.data
            desc["src"] = base + rec.section_offsets()
            desc["src_bytes"] = rec.section_lengths()
            if cuda:
                slot.desc_dev.copy_(slot._desc_t, non_blocking=True)
                rans.decode_descriptors(
                    slot.desc_dev,
                    n,
                    t_addr,
                    num_tables,
                    out_lengths=slot.lens,
                    status=slot.status,
                    scratch=slot.scratch,
                    stream=slot.stream,
                )
            else:
                rans.decode_descriptors(
                    desc, n, t_addr, num_tables, out_lengths=slot.lens, status=slot.status, num_threads=self.num_threads
                )
            if nat is not None:  # into the slot's chunk buffer; range flags into nstatus
                nat.dequantize_batch(slot.native_batch(nat), lv, status=slot.nstatus, num_threads=self.num_threads)
            else:
                slot.nstatus.zero_()
            if cuda:
                slot.ctl_host.copy_(slot.ctl, non_blocking=True)
                slot.stream.synchronize()  # the one host sync of the decode
            keep = None  # the one-off upload (if any) is done
            ctl = slot.ctl_host.numpy()
            got = ctl[: 8 * n].view(np.int64)
            st = ctl[8 * n : 12 * n].view(np.int32)
            nst = ctl[12 * n : 12 * n + 4].view(np.int32)
            self._check(st, got)
            if nat is not None:
                try:
                    nat.check_status(nst, "dequantize")
                except CodecInputError as e:
                    raise cchunk.CodecRecordError(f"codec record: {e}") from None
                kv = slot.work
            else:
                try:
                    kv = quant.dequantize(slot.sym[: self.sym_bytes], slot.side[: self.side_bytes], lv, shp, dt)
                except CodecInputError as e:
                    raise cchunk.CodecRecordError(f"codec record: {e}") from None
            # verified: now (and only now) write out
            if cuda:
                slot.stream.wait_stream(caller)  # the caller's stream may still read out
            dst.view(dt).view(shp).copy_(kv)
            if cuda:
                if stream is None:
                    slot.stream.synchronize()
                else:
                    stream.wait_stream(slot.stream)

    def _check(self, st: np.ndarray, got: np.ndarray) -> None:
        """The coder's per-stream status and symbol counts (host copies) -> CodecRecordError."""
        bad = np.flatnonzero(st)
        if bad.size:
            i = int(bad[0])
            S = cchunk.sections_per_layer(self.level)
            raise cchunk.CodecRecordError(
                f"codec record: rANS stream of layer {i // S}, section {i % S} failed: "
                f"{rans.STATUS_NAMES.get(int(st[i]), int(st[i]))} ({bad.size} bad stream(s))"
            )
        short = np.flatnonzero(got != self.lengths)
        if short.size:
            i = int(short[0])
            raise cchunk.CodecRecordError(
                f"codec record: section {i} decoded to {int(got[i])} symbols, expected {int(self.lengths[i])}"
            )


# ------------------------------------------------------------------------------------------------
# decoders shared by decode_chunk

_SHARED_LOCK = threading.Lock()
_SHARED: OrderedDict[tuple, tuple[Any, ChunkDecoder]] = OrderedDict()
_SHARED_MAX = 4


def shared_decoder(
    *,
    shape: Sequence[int],
    dtype: Any,
    level: str | int | Level,
    tables: cchunk.StaticTables | None,
    device: Any,
    num_threads: int = 0,
) -> ChunkDecoder:
    """A process-wide :class:`ChunkDecoder` for these arguments (the last 4 used are kept; the
    table set is keyed by identity), so repeated :func:`~lmtier.codec.chunk.decode_chunk` calls
    reuse slots and uploaded tables."""
    shp = cchunk._shape(shape)
    dt = cchunk._dtype(dtype)
    lv = get_level(level)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (shp, dt, lv.level_id, None if tables is None else id(tables), str(dev), int(num_threads))
    with _SHARED_LOCK:
        hit = _SHARED.get(key)
        if hit is not None and (tables is None or hit[0]() is tables):
            _SHARED.move_to_end(key)
            return hit[1]
        dec = ChunkDecoder(
            shape=shp, dtype=dt, level=lv, tables=tables, device=dev, num_threads=num_threads, max_idle_slots=2
        )
        _SHARED[key] = (None if tables is None else weakref.ref(tables), dec)
        while len(_SHARED) > _SHARED_MAX:
            _SHARED.popitem(last=False)
        return dec
