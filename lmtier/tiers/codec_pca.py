"""A tier decorator that stores chunks as PCA codec records (``codec_level: pca_high`` /
``pca_default`` with ``codec_pca_model``; experimental, docs/codec.md "PCA levels").

:class:`PCACodecTier` wraps a disk or remote tier as :class:`lmtier.tiers.codec.CodecTier` does (the
shared part, keys, forwarding and evictions: :class:`lmtier.tiers.record_tier.RecordTier`), with
:mod:`lmtier.codec.pca`'s records: ``put`` encodes the chunk with :func:`lmtier.codec.pca.encode` at
the position the caller names, ``get_into`` decodes it with :func:`lmtier.codec.pca.decode`.

Decisions:

* **Positions.** A PCA record holds keys with RoPE undone at the chunk's positions, so ``put`` needs
  the position of the chunk's first token (:meth:`~lmtier.tiers.base.Tier.takes_position` is True;
  the tier manager passes ``position=``). A chunk of unknown position (None) is not stored: ``put``
  returns False, counter ``put_no_position`` (the first logged at warning, the others at debug);
  anything else that is not an ``int >= 0`` raises ValueError, as at every tier that takes positions.
  ``get_into`` takes no position: the record carries its start and decodes at
  it; the chunk key fixes the chunk, so a record put at a wrong position costs quality, never another
  chunk's KV.
* **Keys.** ``key XOR pad`` with ``pad = BLAKE2b-256(person="lmtier-serde", "cachegen" || format
  version || PCA level id || PCA record layout (:data:`lmtier.codec.pca.codec.LAYOUT_VERSION`) ||
  "pca-model" || the model file's 16-byte digest)``
  (:func:`lmtier.tiers.record_tier.key_pad`): records of another model file, of the other PCA level,
  of the CacheGen levels (other level ids, salts of another length) and naive chunks are in disjoint
  key spaces: misses, never decoded (and never deleted as corrupt).
* **Size.** A record never exceeds :func:`lmtier.codec.pca.codec.max_record_bytes` of the model and
  the chunk's token count; ``get_into`` reads into a page-aligned host buffer of that size (as many
  idle ones kept as were in use at once, within :data:`_IDLE_BYTES` of resident pages); a larger
  record cannot be valid.
* **Failures.** ``get_into`` returns None (a miss) on any failure; ``out`` is written only once the
  whole record decoded and its chunk has this tier's dtype and shape. A record that fails to decode
  (:class:`~lmtier.codec.chunk.CodecRecordError`: checksum, structure, counts, another model's) or
  that decodes to another geometry or dtype is deleted (counter ``corrupt_deleted``); other
  failures (a device error) leave it (``decode_failures``). ``put`` returns False for payloads that
  are not one chunk, NaN/inf KV (:class:`~lmtier.codec.quant.CodecInputError`) and positions past
  :data:`lmtier.codec.pca.codec.MAX_POSITION` (``put_failures``).
* **Devices.** A CUDA payload is encoded on its device, on the caller's current stream. A host
  payload is encoded on ``encode_device`` when set (a :class:`~lmtier.codec.encoder.DeviceEncoder`'s
  slot: device buffer and non-default stream), else on the CPU; a GPU encode that raises anything
  but the input's faults (``CodecInputError``, ``ValueError``, ``TypeError``) falls back to the CPU
  and turns GPU encoding off for the tier (one warning, ``gpu_encode_fallbacks``;
  :meth:`RecordTier._gpu_failed <lmtier.tiers.record_tier.RecordTier._gpu_failed>`): the PCA CUDA
  path gives the CPU's bytes (``tests/test_gpu_codec_pca.py``), so records are the same either way.
  A CUDA ``out`` is decoded on its device, on a per-thread non-default stream of this tier. Without
  ``stream=`` the chunk is copied into ``out`` on another stream of the thread once its own decode ran
  (not after the records a batched read queued behind it), before ``get_into`` returns; with
  it (the connector's device-decode path: :mod:`lmtier.integration.vllm.fetch`), the chunk's copy into
  ``out`` is queued on ``stream`` after the decode, so it runs after ``out``'s earlier readers there
  (a reused staging buffer's scatter) and before any later work on ``stream``, as
  :class:`~lmtier.tiers.codec.CodecTier` orders it.
* **Types.** bf16/fp16 KV with K and V planes whose ``(L, H, D)`` are the model file's (``T``, the
  chunk size, is free); a level the model file holds. Anything else is a
  :class:`lmtier.config.ConfigError` at construction naming the key (``codec_pca_model``,
  ``codec_level`` or the serde key).

Thread-safe (encode keeps no shared state; record buffers come from a locked free list).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from lmtier import cuda_streams
from lmtier.codec import format as cformat
from lmtier.codec import pca
from lmtier.codec.chunk import CodecRecordError
from lmtier.codec.encoder import DeviceEncoder
from lmtier.codec.pca import codec as pca_codec
from lmtier.codec.pca.levels import PCA_LEVELS, PCALevel
from lmtier.codec.quant import CodecInputError
from lmtier.config import ConfigError
from lmtier.tiers.base import Tier, check_position
from lmtier.tiers.buffers import AlignedBuffer, round_up
from lmtier.tiers.record_tier import CACHEGEN_SALT, RecordTier, check_record_geometry

__all__ = ["PCACodecTier", "check_pca_geometry"]

log = logging.getLogger("lmtier.tiers.codec_pca")

_MODEL_SALT = b"pca-model"
_IDLE_BUFFERS = 4
"""Idle record buffers a tier keeps at least (one serves one concurrent ``get_into``)."""
_IDLE_BYTES = 256 << 20
"""Resident host memory of idle record buffers a tier keeps at most. Within it, it keeps as many as
were in use at once (a batched read holds one per chunk on each I/O thread), so a steady load
allocates none: a new buffer's first write faults its pages in, ~20x the record's copy into a reused
one (RESULTS §4.1z). A buffer is ``max_record_bytes`` of address space (~50 MB for a Llama-3.1-8B
chunk: every token exact), but only the pages records were written to are resident: each idle buffer
counts as the largest record read into it (:class:`_RecordBuffer`)."""
_QUEUED_DECODES = 4
"""Records of one batched read queued on the device ahead of the one delivered: enough to keep the
device busy while the host checks and queues the next, few enough that their decoded chunks (one
chunk's bytes each until delivered) stay a small share of device memory."""


def check_pca_geometry(
    shape: Sequence[int],
    dtype: Any,
    level: str | PCALevel,
    model: pca.PCAModel,
    *,
    config_key: str = "serde",
    config_value: str = "cachegen",
    model_path: str | None = None,
) -> tuple[tuple[int, ...], torch.dtype, PCALevel]:
    """Validate a chunk geometry for a PCA level of ``model``; returns ``(shape, torch dtype, level)``.

    Args:
        shape: ``(L, P, T, H, D)``, the namespace's canonical chunk shape (this rank's).
        dtype: a torch dtype or a :class:`lmtier.keys.Namespace` ``kv_dtype`` name.
        level: ``pca_high`` or ``pca_default`` (or its :class:`PCALevel`).
        model: the model data (:func:`lmtier.codec.pca.load`).
        config_key, config_value: the serde key that selected the codec (named in errors).
        model_path: the ``codec_pca_model`` value (named in errors).

    Raises:
        ConfigError: a level that is not a PCA level or that ``model`` lacks, a dtype other than
            bf16/fp16, one plane (MLA), non-positive sizes, ``(L, H, D)`` other than the model's.
        TypeError: ``model`` is not a :class:`~lmtier.codec.pca.PCAModel`.
    """
    if not isinstance(model, pca.PCAModel):
        raise TypeError(f"model must be a lmtier.codec.pca.PCAModel, got {type(model).__name__}")
    where = f"lmtier config: codec_pca_model={model_path!r} (PCA model {model.name!r}, id {model.model_id:#010x})"
    if isinstance(level, PCALevel):
        lv = level
    elif isinstance(level, str) and level in PCA_LEVELS:
        lv = PCA_LEVELS[level]
    else:
        raise ConfigError(f"lmtier config: codec_level={level!r}: not a PCA level {sorted(PCA_LEVELS)}")
    if lv.name not in model.levels:
        raise ConfigError(
            f"{where}: the model file has no level {lv.name!r} (it has {sorted(model.levels)}); "
            f"codec_level: {lv.name} needs a file calibrated with it"
        )

    def bad(why: str) -> ConfigError:
        return ConfigError(f"lmtier config: {config_key}={config_value!r}: {why}")

    need = f"PCA codec level {lv.name!r} needs a bfloat16/float16 KV cache, kv_dtype is "
    shp, dt = check_record_geometry(shape, dtype, bad, lambda name: need + name)
    nl, _, _, h, d = shp
    if (nl, h, d) != (model.num_layers, model.num_heads, model.head_size):
        raise ConfigError(
            f"{where}: the model file was calibrated for L={model.num_layers} layers, H={model.num_heads} KV "
            f"heads, D={model.head_size}; this cache's chunks are [L, 2, T, H, D] = {list(shp)}, L={nl} H={h} "
            f"D={d}. With tensor parallelism each rank holds H/tp KV heads, and a model's basis spans the "
            "heads it was calibrated on: calibrate the file for the served model with python -m lmtier.codec.pca "
            "--tensor-parallel-size <tp>"
        )
    return shp, dt, lv


class _RecordBuffer:
    """A tier's host record buffer (:class:`~lmtier.tiers.buffers.AlignedBuffer`) and what is known of
    its resident pages: the largest record read into it (``touched``, bytes) and how the read it is
    out for went (``outcome``: None not known yet, True a record, False a miss or failed read)."""

    def __init__(self, mem: AlignedBuffer) -> None:
        self.mem, self.mv = mem, mem.mv
        self.touched = 0
        self.outcome: bool | None = None

    def read(self, n: int | None) -> None:
        """Note the inner read's result: ``n`` bytes of a record, or None (a miss or a failed read,
        which may have written any part of the buffer)."""
        self.outcome = n is not None
        if n is not None:
            self.touched = max(self.touched, n)


class PCACodecTier(RecordTier):
    """Store chunks of one geometry in ``inner`` as PCA codec records (see the module doc).

    Args:
        inner: the tier holding the records (a :class:`~lmtier.tiers.disk.DiskTier`,
            :class:`~lmtier.tiers.redis.RedisTier`, ...). Closed by :meth:`close`.
        shape: canonical chunk shape ``(L, 2, T, H, D)``.
        dtype: ``torch.bfloat16`` / ``torch.float16`` or their names.
        level: ``"pca_high"`` or ``"pca_default"``.
        model: the model data (:func:`lmtier.codec.pca.load` of ``codec_pca_model``; one object may
            serve several tiers).
        config_key, config_value: the serde key that selected the codec (named in errors).
        model_path: the ``codec_pca_model`` value (named in errors).
        encode_device: None (host payloads are encoded on the CPU) or the CUDA device (``cuda:N``)
            host payloads are encoded on; not touched before the first put, a failure falls back to
            the CPU (module doc).

    Attributes:
        raw_bytes: bytes of one chunk; ``max_record_bytes``: the record bound (read buffer size).
        counters: ``puts``, ``put_failures``, ``put_no_position``, ``raw_bytes_in``,
            ``record_bytes_out``, ``hits``, ``misses``, ``corrupt_deleted``, ``decode_failures``,
            ``gpu_encodes``, ``gpu_encode_fallbacks``.

    Raises:
        ConfigError: see :func:`check_pca_geometry`.
        TypeError: ``model`` is not a PCAModel. ValueError: ``encode_device`` is not ``cuda:N``.
    """

    _log = log

    def __init__(
        self,
        inner: Tier,
        *,
        shape: Sequence[int],
        dtype: Any,
        level: str | PCALevel,
        model: pca.PCAModel,
        config_key: str = "serde",
        config_value: str = "cachegen",
        model_path: str | None = None,
        encode_device: torch.device | str | None = None,
    ) -> None:
        self.shape, self.dtype, self.level = check_pca_geometry(
            shape, dtype, level, model, config_key=config_key, config_value=config_value, model_path=model_path
        )
        self.model = model
        self._gpu: DeviceEncoder | None = None
        if encode_device is not None:
            self._gpu = DeviceEncoder(shape=self.shape, dtype=self.dtype, level=None, device=encode_device)
        self.raw_bytes = math.prod(self.shape) * self.dtype.itemsize
        self.max_record_bytes = pca_codec.max_record_bytes(model, self.shape[2])
        self._idle: list[_RecordBuffer] = []
        self._in_use = self._peak = 0  # record buffers handed out now, and at most so far
        self._local = threading.local()  # per thread: the CUDA decode streams
        layout = bytes([cformat.FORMAT_VERSION, self.level.level_id, pca_codec.LAYOUT_VERSION])
        salt = CACHEGEN_SALT + layout + _MODEL_SALT + model.digest
        super().__init__(inner, salt=salt)  # the key pad (lmtier.tiers.record_tier), the eviction listener

    def takes_position(self) -> bool:
        return True

    # ---- put ---------------------------------------------------------------------------------

    def put(self, key: bytes, payload: Any, *, position: int | None = None, **kw: Any) -> bool:
        """Encode ``payload`` (exactly one chunk's canonical bytes: bytes-like, NumPy, CPU or CUDA
        tensor) at ``position`` (the chunk's first token's, ``int >= 0``) and store the record.
        ``kw`` (``tenant=``) goes to the inner put.

        Returns:
            Whether the record was stored: False for an unknown position (``put_no_position``), a
            payload that is not one chunk, NaN/inf KV, a position past ``MAX_POSITION - T``, a failed
            inner put (``put_failures``).

        Raises:
            ValueError: ``key`` is not 32 bytes, or ``position`` neither None nor an ``int >= 0``
                (:func:`lmtier.tiers.base.check_position`).
        """
        self.inner_key(key)  # a bad key raises before anything is encoded
        position = check_position(position, f"{self.name}.put")
        if position is None:
            n = self._count("put_no_position")
            (log.warning if n == 1 else log.debug)(
                "%s: put %s without a position (%r): a PCA level stores a chunk only with the position of "
                "its first token; not stored (counter put_no_position; further ones logged at debug)",
                self.name,
                bytes(key).hex()[:16],
                position,
            )
            return False
        src = self._chunk_source(key, payload)
        if src is None:
            return False

        def encode(buf: torch.Tensor) -> memoryview:  # this thread's packing buffer: the inner put reads it
            chunk = buf.view(self.dtype).view(self.shape)
            return pca.encode(chunk, start=position, model=self.model, level=self.level, scratch=True)

        try:
            record, on_gpu = self._encode_on(key, src, lambda: encode(src), lambda gpu: gpu.run(src, encode))
        except (CodecInputError, ValueError, TypeError) as e:  # NaN/inf KV, a position past MAX_POSITION
            return self._cannot_encode(key, e)
        return self._store_record(key, record, on_gpu, **kw)

    # ---- get ---------------------------------------------------------------------------------

    def get_into(self, key: bytes, out: Any, *, stream: Any = None) -> int | None:
        """Fetch the record and decode the chunk into ``out`` (host buffer or CUDA tensor, >= one
        chunk's bytes). Returns the chunk's byte count, or None (miss, too small ``out``, any
        failure; records that fail to decode are deleted). ``out`` is written only once the record
        decoded to a chunk of this tier's geometry.

        Args:
            stream: CUDA ``out`` only, a ``torch.cuda.Stream``: return once the record decoded, with
                the chunk's copy into ``out`` queued on ``stream`` (after its earlier work, before any
                later). None (default): return once ``out`` holds the chunk.

        Raises:
            ValueError: ``stream`` with a host ``out``.
        """
        return self.get_many_into([key], [out], stream=stream)[0]

    def _decode(
        self, key: bytes, ikey: bytes, buf: _RecordBuffer, n: int | None, dst: torch.Tensor, stream: Any
    ) -> int | None:
        """Decode the record of ``n`` bytes in ``buf`` into ``dst`` (None ``n``: the inner miss); a
        record of another geometry or dtype is corrupt (deleted); ``buf``'s read was noted by
        :meth:`_decode_many`, the only caller."""

        def decode() -> None:
            with self._on_device(dst.device) as side:
                p = pca_codec.decode_queued(buf.mv[:n], model=self.model, device=dst.device)
                self._deliver(p.result(), dst, stream, side, p.ready)

        return self._decoded(key, ikey, n, decode)

    def _decode_many(
        self, items: Sequence[tuple[bytes, bytes, Any, int | None, torch.Tensor]], stream: Any
    ) -> list[int | None]:
        """The records of one batched read decoded on their CUDA device without a wait between them:
        up to :data:`_QUEUED_DECODES` records are queued (:func:`lmtier.codec.pca.codec.decode_queued`)
        ahead of the one whose result is taken, each then delivered (or refused) as :meth:`_decode`
        does. Every record buffer's read is noted first (:meth:`_RecordBuffer.read`)."""
        for item in items:
            item[2].read(item[3])
        devs = {dst.device for *_, dst in items}
        if len(items) < 2 or len(devs) != 1 or next(iter(devs)).type != "cuda":
            return super()._decode_many(items, stream)
        dev = next(iter(devs))
        with contextlib.ExitStack() as stack:
            try:
                side = stack.enter_context(self._on_device(dev))
            except Exception:  # noqa: BLE001 - no decode stream: each record alone, its failure a miss there
                return super()._decode_many(items, stream)

            def queue(item: tuple) -> Any:
                buf, n = item[2], item[3]
                try:
                    return None if n is None else pca_codec.decode_queued(buf.mv[:n], model=self.model, device=dev)
                except Exception as e:  # noqa: BLE001 - raised again by its record's _decoded
                    return e

            def finish(p: Any, dst: torch.Tensor) -> None:
                if isinstance(p, Exception):
                    raise p
                self._deliver(p.result(), dst, stream, side, p.ready)

            out: list[int | None] = []
            pending = [queue(it) for it in items[:_QUEUED_DECODES]]
            for j, (key, ikey, _, n, dst) in enumerate(items):
                out.append(self._decoded(key, ikey, n, functools.partial(finish, pending[j], dst)))
                pending[j] = None  # its chunk's memory is free once delivered
                if j + _QUEUED_DECODES < len(items):
                    pending.append(queue(items[j + _QUEUED_DECODES]))
            return out

    def _deliver(self, chunk: torch.Tensor, dst: torch.Tensor, stream: Any, side: Any, ready: Any = None) -> None:
        """Copy a decoded ``chunk`` into ``dst``: on ``stream`` after the decode (its ``ready`` event,
        else everything queued on its ``side`` stream) when both are given; else now, returning once
        it ran: on the host, or for a CUDA chunk on this thread's copy stream (:meth:`_copy_stream`)
        after ``ready`` (else after everything queued on ``side``), so not behind the records queued
        after it on ``side``.

        Raises:
            CodecRecordError: a chunk of another dtype or shape than this tier's (the record is corrupt)."""
        if chunk.dtype != self.dtype or tuple(chunk.shape) != self.shape:
            raise CodecRecordError(
                f"record of a {chunk.dtype} chunk {list(chunk.shape)}, this tier stores {self.dtype} {list(self.shape)}"
            )
        flat = chunk.reshape(-1).view(torch.uint8)
        if side is None:
            dst[: self.raw_bytes].copy_(flat)
            return
        if stream is None:
            cs = self._copy_stream(chunk.device)
            if ready is not None:
                cs.wait_event(ready)
            else:
                cs.wait_stream(side)
            with cuda_streams.use(cs):
                dst[: self.raw_bytes].copy_(flat)
            cs.synchronize()  # the chunk is in dst; its memory is free to reuse
            return
        if ready is not None:  # this chunk's decode only, not the records queued after it
            stream.wait_event(ready)
        else:
            stream.wait_stream(side)  # the decode's kernels, then dst's earlier readers on stream
        with cuda_streams.use(stream):
            dst[: self.raw_bytes].copy_(flat)
        flat.record_stream(stream)  # the chunk's memory is reused only after the copy ran

    def _thread_stream(self, kind: str, dev: torch.device) -> torch.cuda.Stream:
        """This thread's ``kind`` stream (``"decode"`` or ``"copy"``) on CUDA ``dev``: made on first
        use, never one of the thread's other streams (torch hands streams out of a pool, round robin)."""
        mine = self._local.__dict__.setdefault("streams", {})
        s = mine.get((kind, dev))
        if s is None:
            others = {v for (k, d), v in mine.items() if d == dev}
            s = torch.cuda.Stream(device=dev)
            while s in others:
                s = torch.cuda.Stream(device=dev)
            mine[(kind, dev)] = s
        return s

    def _copy_stream(self, dev: torch.device) -> torch.cuda.Stream:
        """This thread's stream on CUDA ``dev`` for copying decoded chunks out when no stream was given
        (nothing else is queued on it: the copy does not wait for later decodes)."""
        return self._thread_stream("copy", dev)

    @contextlib.contextmanager
    def _on_device(self, dev: torch.device):
        """For a CUDA ``dev``: that device current and this thread's decode stream on it current
        (yielded, to synchronize); for the host: nothing (None)."""
        if dev.type != "cuda":
            yield None
            return
        with cuda_streams.device(dev):
            s = self._thread_stream("decode", dev)
            with cuda_streams.use(s):
                yield s

    @contextlib.contextmanager
    def _record_buffer(self, dst: torch.Tensor):
        """``(buffer, its memory)``: a :class:`_RecordBuffer` (page-aligned host memory of
        ``max_record_bytes``), from the idle list or new (whatever ``dst``'s device: the record is
        decoded from the host); given back to the idle list as :meth:`_keeps` decides."""
        with self._lock:
            buf = self._idle.pop() if self._idle else None
            self._in_use += 1
            self._peak = max(self._peak, self._in_use)
        try:
            if buf is None:
                buf = _RecordBuffer(AlignedBuffer(self.max_record_bytes))
            buf.outcome = None
            yield buf, buf.mv
        finally:
            with self._lock:
                self._in_use -= 1
                if buf is not None and self._keeps(buf):
                    self._idle.append(buf)

    def _keeps(self, buf: _RecordBuffer) -> bool:
        """Whether ``buf``, given back, joins the idle list (under the lock): only after a record was
        read into it (a failed or missed read may have written any part of it), while the list holds
        fewer than were in use at once (at least :data:`_IDLE_BUFFERS`) and their resident bytes
        stay within :data:`_IDLE_BYTES`."""
        if buf.outcome is not True:
            return False
        if len(self._idle) >= max(_IDLE_BUFFERS, self._peak):
            return False
        return sum(round_up(b.touched) for b in self._idle) + round_up(buf.touched) <= _IDLE_BYTES

    def close(self) -> None:
        with self._lock:
            self._idle.clear()
        super().close()  # the GPU encoder, the inner tier
