"""The part every codec tier shares (:class:`RecordTier`): a decorator that stores each chunk of a
disk or remote tier as a *record* (bytes of its own format, not the chunk's canonical bytes) under a
key derived from the chunk key, and forwards the rest of the :class:`~lmtier.tiers.base.Tier`
protocol to the tier it wraps.

Used by :class:`lmtier.tiers.codec.CodecTier` (the CacheGen-style levels) and
:class:`lmtier.tiers.codec_pca.PCACodecTier` (the PCA levels); each adds its own ``put``,
``get_into`` and ``get_many_into``.

* **Keys.** The inner tier holds a chunk's record under ``key XOR pad``, with ``pad =
  BLAKE2b-256(person="lmtier-serde", salt)`` (:func:`key_pad`). The salt names everything a reader
  needs to decode the record (serde, record format version, level id, table set or model data), so
  records that cannot be decoded alike live in disjoint key spaces of a shared disk directory or
  Redis (chunk keys are BLAKE2b outputs: a raw key equal to a derived key would need two chunk hashes
  differing by exactly the pad). The derivation is its own inverse (:meth:`RecordTier.outer_key`),
  so the inner tier's evictions reach the wrapper's listeners under chunk keys.
* **Forwarding.** ``contains``, ``contains_many``, ``delete``, ``forget`` go to the inner tier under
  the derived key; ``usage``, ``tenant_budgets``, ``tenant_stats``, ``batches_contains`` and
  ``batches_gets`` are the inner tier's; ``event_counts`` merges the inner tier's counts with the
  wrapper's (the wrapper's win a shared name); ``close`` closes the inner tier.
* **GPU encode fallback.** A subclass that encodes host chunks on a GPU keeps its
  :class:`~lmtier.codec.encoder.DeviceEncoder` in ``_gpu``; :meth:`RecordTier._encode_on` runs the
  GPU encode and, when it raises anything but the input's faults, counts it
  (``gpu_encode_fallbacks``), encodes on the CPU, and the first turns GPU encoding off for the tier
  with one warning (:meth:`RecordTier._gpu_failed`).
* **Puts and gets.** The steps both formats take around their own encode and decode: a payload of
  exactly one chunk (:meth:`RecordTier._chunk_source`), the record stored and counted
  (:meth:`RecordTier._store_record`), the records of a batch read with one inner
  ``get_many_into`` where the inner tier batches gets (:meth:`RecordTier.get_many_into`, over the
  subclass's ``_record_buffer`` and ``_decode``), and a decode's outcome counted, a record that does
  not decode deleted (:meth:`RecordTier._decoded`).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from lmtier.codec.chunk import CodecRecordError
from lmtier.codec.quant import CodecInputError
from lmtier.geometry import CODEC_DTYPE_NAMES, TORCH_KV_DTYPES
from lmtier.tiers.base import KEY_BYTES, Eviction, Tier, TierUsage
from lmtier.tiers.buffers import host_view
from lmtier.tiers.device import is_cuda_tensor

if TYPE_CHECKING:
    from lmtier.codec.encoder import DeviceEncoder

__all__ = ["CACHEGEN_SALT", "CODEC_KV_DTYPES", "RecordTier", "check_record_geometry", "dtype_name", "key_pad"]

_PERSON = b"lmtier-serde"
CACHEGEN_SALT = b"cachegen"
"""The first bytes of every codec tier's salt (the serde's name)."""


CODEC_KV_DTYPES = {n: TORCH_KV_DTYPES[n] for n in CODEC_DTYPE_NAMES}  # from lmtier.geometry
"""Namespace ``kv_dtype`` names the codec tiers take."""


def check_record_geometry(
    shape: Sequence[int], dtype: Any, bad: Callable[[str], Exception], no_dtype: Callable[[str], str]
) -> tuple[tuple[int, ...], torch.dtype]:
    """``(shape, torch dtype)`` of a codec tier's chunks: ``shape`` ``(L, 2, T, H, D)`` of positive
    sizes, ``dtype`` (a torch dtype or a ``kv_dtype`` name) one of :data:`CODEC_KV_DTYPES`.

    Raises:
        What ``bad(why)`` returns (the caller's ConfigError naming its key): a shape that is not five
        positive sizes, a dtype the codec does not take (``why`` = ``no_dtype(its name)``), one plane
        (MLA).
    """
    try:
        shp = tuple(int(v) for v in shape)
    except TypeError:
        raise bad(f"chunk shape {shape!r} is not (L, P, T, H, D)") from None
    if len(shp) != 5 or min(shp) <= 0:
        raise bad(f"chunk shape {shp} is not (L, P, T, H, D) with positive sizes")
    name = dtype_name(dtype)
    dt = CODEC_KV_DTYPES.get(name)
    if dt is None:
        raise bad(no_dtype(name))
    if shp[1] != 2:
        raise bad(f"the codec needs separate K and V planes (kv_planes=2), the chunk has {shp[1]} (MLA?)")
    return shp, dt


def dtype_name(dtype: Any) -> str:
    """The name of a torch dtype without ``torch.`` (``bfloat16``), or ``str(dtype)`` of anything
    else (a :class:`lmtier.keys.Namespace` ``kv_dtype`` name passes through): what the codec tiers'
    geometry checks look up and name in errors."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    return str(dtype)


def key_pad(salt: bytes) -> int:
    """The XOR pad of a record key space: ``BLAKE2b-256(person="lmtier-serde", salt)`` as a
    little-endian integer (32 bytes)."""
    return int.from_bytes(hashlib.blake2b(salt, digest_size=KEY_BYTES, person=_PERSON).digest(), "little")


class RecordTier(Tier):
    """Base of the codec tiers (see the module doc): ``inner`` holds the records, under keys padded
    with :func:`key_pad` of ``salt``.

    Subclasses call ``RecordTier.__init__`` once everything that fixes the salt is known (it registers
    the eviction listener on ``inner``), implement ``put``, ``get_into`` and the abstract
    ``_record_buffer`` and ``_decode``, and set ``raw_bytes`` (a chunk's bytes), ``max_record_bytes``
    (the bound on a record's bytes: the build checks that a disk tier holds one,
    :func:`lmtier.tiers.factory.build_tiers`) and ``level`` (its ``name`` is logged).

    Attributes:
        inner: the wrapped tier. name: the inner tier's name (hit counters and logs read ``disk`` /
            ``remote``).
    """

    _log: ClassVar[logging.Logger] = logging.getLogger("lmtier.tiers")
    """The subclass's logger (its module's)."""
    _gpu: DeviceEncoder | None = None
    """The encoder of host chunks on a GPU, None: the CPU (set by a subclass before ``__init__``)."""

    def __init__(self, inner: Tier, *, salt: bytes) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self._pad = key_pad(salt)
        self._lock = threading.Lock()
        inner.add_eviction_listener(self._on_inner_evicted)

    # ---- keys --------------------------------------------------------------------------------

    def inner_key(self, key: bytes) -> bytes:
        """The key the record has in the inner tier (32 bytes, see the module doc).

        Raises:
            ValueError: ``key`` is not 32 bytes.
        """
        key = bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"{type(self).__name__}: key must be {KEY_BYTES} bytes, got {len(key)}")
        return (int.from_bytes(key, "little") ^ self._pad).to_bytes(KEY_BYTES, "little")

    def outer_key(self, inner_key: bytes) -> bytes:
        """The chunk key whose record the inner tier holds under ``inner_key`` (the inverse of
        :meth:`inner_key`)."""
        return self.inner_key(inner_key)  # XOR with the pad is its own inverse

    # ---- Tier (forwarded) --------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return bool(self.inner.contains(self.inner_key(key)))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """The inner tier's ``contains_many`` (one round trip where the inner tier batches)."""
        return [bool(f) for f in self.inner.contains_many([self.inner_key(k) for k in keys])]

    def batches_contains(self) -> bool:
        return self.inner.batches_contains()

    def batches_gets(self) -> bool:
        return self.inner.batches_gets()

    def delete(self, key: bytes) -> bool:
        return bool(self.inner.delete(self.inner_key(key)))

    def forget(self, key: bytes) -> bool:
        return bool(self.inner.forget(self.inner_key(key)))

    def usage(self) -> TierUsage:
        """The inner tier's usage (bytes of records, not of the chunks they encode)."""
        return self.inner.usage()

    @property
    def tenant_budgets(self) -> Any:
        return self.inner.tenant_budgets

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        return self.inner.tenant_stats()

    def event_counts(self) -> dict[str, int]:
        return {**self.inner.event_counts(), **super().event_counts()}

    def close(self) -> None:
        """Free the GPU encoder, stop listening to the inner tier and close it."""
        with self._lock:
            gpu, self._gpu = self._gpu, None
        if gpu is not None:
            gpu.close()
        self.inner.remove_eviction_listener(self._on_inner_evicted)
        self.inner.close()

    @property
    def encode_device(self) -> torch.device | None:
        """The CUDA device host payloads are encoded on; None: the CPU (none configured, or GPU
        encoding turned off after a failure)."""
        gpu = self._gpu
        return None if gpu is None else gpu.device

    def _gpu_failed(self, key: bytes, gpu: DeviceEncoder, err: Exception) -> None:
        """Count a GPU encode fallback; the first turns GPU encoding off for this tier, frees the
        encoder's idle slots and logs the one warning."""
        with self._lock:
            self.counters["gpu_encode_fallbacks"] += 1
            first = self._gpu is gpu
            if first:
                self._gpu = None
        if first:
            gpu.close()
            self._log.warning(
                "%s: encoding chunk %s on %s failed (%r); encoded on the CPU, and this tier encodes on the CPU "
                "from now on (counter gpu_encode_fallbacks)",
                self.name,
                bytes(key).hex()[:16],
                gpu.device,
                err,
            )

    def _encode_on(
        self,
        key: bytes,
        src: torch.Tensor,
        encode: Callable[[], bytes | memoryview],
        on_gpu: Callable[[Any], bytes | memoryview],
    ) -> tuple[bytes | memoryview, bool]:
        """``(record, encoded on the GPU)`` of the flat uint8 chunk ``src``: ``on_gpu(encoder)`` for a
        host ``src`` while GPU encoding is on, else ``encode()`` (where ``src`` lives). A GPU encode that
        raises anything but :class:`~lmtier.codec.quant.CodecInputError`, ``ValueError`` or ``TypeError``
        (the input's faults: the CPU would refuse it too, so they are raised) falls back to ``encode()``
        and turns GPU encoding off (:meth:`_gpu_failed`)."""
        gpu = self._gpu
        if gpu is not None and not src.is_cuda:
            try:
                return on_gpu(gpu), True
            except (CodecInputError, ValueError, TypeError):
                raise
            except Exception as e:  # noqa: BLE001 - OOM, CUDA errors, a CPU build: encode on the CPU
                self._gpu_failed(key, gpu, e)
        return encode(), False

    def _chunk_source(self, key: bytes, payload: Any) -> torch.Tensor | None:
        """``payload`` as a flat uint8 tensor of exactly one chunk (``raw_bytes``), or None: not a
        buffer or another size (logged, counted ``put_failures``)."""
        try:
            src = self._source(payload)
        except (TypeError, ValueError) as e:
            self._log.warning("put %s: %s; not stored", bytes(key).hex()[:16], e)
            self._count("put_failures")
            return None
        if src.numel() != self.raw_bytes:
            self._log.warning(
                "put %s: payload of %d bytes, a chunk of %s is %d; not stored",
                bytes(key).hex()[:16],
                src.numel(),
                self.shape,
                self.raw_bytes,
            )
            self._count("put_failures")
            return None
        return src

    def _cannot_encode(self, key: bytes, err: Exception) -> bool:
        """A chunk the level cannot encode (``err``: NaN/inf KV, ...): logged, counted ``put_failures``;
        returns False (``put``'s result)."""
        self._log.warning(
            "put %s: level %r cannot encode this chunk (%s); not stored", bytes(key).hex()[:16], self.level.name, err
        )
        self._count("put_failures")
        return False

    def _store_record(self, key: bytes, record: bytes | memoryview, on_gpu: bool, **kw: Any) -> bool:
        """Put ``record`` into the inner tier under ``key``'s derived key (``kw``: the inner put's,
        ``tenant=``); counts ``puts``, ``raw_bytes_in``, ``record_bytes_out`` and ``gpu_encodes``
        (``on_gpu``), or ``put_failures``. Returns the inner put's result."""
        ok = bool(self.inner.put(self.inner_key(key), memoryview(record), **kw))
        if ok:
            self._count("puts")
            self._count("raw_bytes_in", self.raw_bytes)
            self._count("record_bytes_out", len(record))
            if on_gpu:
                self._count("gpu_encodes")
        else:
            self._count("put_failures")
        return ok

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *, stream: Any = None) -> list[int | None]:
        """``get_into`` of several chunks: when the inner tier batches gets
        (:meth:`~lmtier.tiers.base.Tier.batches_gets`), their records are read with one
        ``inner.get_many_into`` and then decoded one by one, else each is read and decoded in turn.

        Args:
            keys: 32-byte chunk keys.
            outs: one destination per key, as for ``get_into`` (host buffers or CUDA tensors).
            stream: as for the subclass's ``get_into`` (every ``out`` CUDA).

        Returns:
            Per key: the chunk's byte count, or None.

        Raises:
            ValueError: ``keys`` and ``outs`` differ in length; ``stream`` with a host ``out``.
        """
        dsts = self._destinations(keys, outs, stream, self.raw_bytes)
        res: list[int | None] = [None] * len(keys)
        group = max(1, len(dsts) if self.inner.batches_gets() else 1)
        for g in range(0, len(dsts), group):
            part = dsts[g : g + group]
            with contextlib.ExitStack() as stack:
                bufs = [stack.enter_context(self._record_buffer(dst)) for _, dst in part]
                ikeys = [self.inner_key(keys[i]) for i, _ in part]
                got = self.inner.get_many_into(ikeys, [mem for _, mem in bufs])
                items = [
                    (keys[i], ikey, buf, n, dst)
                    for (i, dst), ikey, (buf, _), n in zip(part, ikeys, bufs, got, strict=True)
                ]
                for (i, _), r in zip(part, self._decode_many(items, stream), strict=True):
                    res[i] = r
        return res

    def _decode_many(
        self, items: Sequence[tuple[bytes, bytes, Any, int | None, torch.Tensor]], stream: Any
    ) -> list[int | None]:
        """``_decode`` of each ``(key, inner key, buffer, n, dst)`` of one batched read, in order (a
        subclass may queue them all on the device before waiting once)."""
        return [self._decode(key, ikey, buf, n, dst, stream) for key, ikey, buf, n, dst in items]

    @abc.abstractmethod
    def _record_buffer(self, dst: torch.Tensor) -> contextlib.AbstractContextManager[tuple[Any, Any]]:
        """A context yielding ``(buffer, writable memory of max_record_bytes)`` that a record for
        ``dst`` is read into (handed to ``_decode`` as ``buffer``)."""

    @abc.abstractmethod
    def _decode(self, key: bytes, ikey: bytes, buf: Any, n: int | None, dst: torch.Tensor, stream: Any) -> int | None:
        """Decode the record of ``n`` bytes in ``buf`` into ``dst`` (None ``n``: the inner miss),
        through :meth:`_decoded`."""

    def _decoded(self, key: bytes, ikey: bytes, n: int | None, decode: Callable[[], None]) -> int | None:
        """Run ``decode()`` (which writes the chunk into the destination only once the record
        verified) for the record of ``n`` bytes (None: the inner miss, counted ``misses``). A
        :class:`~lmtier.codec.chunk.CodecRecordError` deletes the record (``corrupt_deleted``) and
        reports its key to the eviction listeners, any other exception leaves it (``decode_failures``;
        a device error); both are misses. Returns the chunk's byte count (a hit) or None."""
        if n is None:
            self._count("misses")
            return None
        try:
            decode()
        except CodecRecordError as e:
            self._log.warning("%s: record of chunk %s is unusable (%s); deleted", self.name, bytes(key).hex()[:16], e)
            self._count("corrupt_deleted")
            self._count("misses")
            self.inner.delete(ikey)
            self._on_inner_evicted(Eviction(self.inner.name, (ikey,)))  # gone: a scheduler stops claiming it
            return None
        except Exception as e:  # noqa: BLE001 - a device error etc.: a miss, the record stays
            self._log.warning(
                "%s: decoding chunk %s failed: %r; treated as a miss", self.name, bytes(key).hex()[:16], e
            )
            self._count("decode_failures")
            self._count("misses")
            return None
        self._count("hits")
        return self.raw_bytes

    def _destinations(self, keys: Sequence[bytes], outs: Sequence[Any], stream: Any, nbytes: int):
        """``[(index, flat uint8 destination)]`` of the ``outs`` that can take a chunk of ``nbytes``
        (the others are logged and left out: their get is a miss).

        Raises:
            ValueError: ``keys`` and ``outs`` differ in length; ``stream`` with a host ``out``.
        """
        if len(keys) != len(outs):
            raise ValueError(f"{type(self).__name__}.get_many_into: {len(keys)} keys, {len(outs)} outs")
        dsts: list[tuple[int, torch.Tensor]] = []
        for i, (key, out) in enumerate(zip(keys, outs, strict=True)):
            try:
                dst = self._dest(out)
            except (TypeError, ValueError) as e:
                self._log.warning("get_into %s: %s", bytes(key).hex()[:16], e)
                continue
            if dst.numel() < nbytes:
                self._log.warning("get_into: out has %d bytes < chunk %d", dst.numel(), nbytes)
                continue
            if stream is not None and not dst.is_cuda:
                raise ValueError(f"{type(self).__name__}.get_into: stream= needs a CUDA out")
            dsts.append((i, dst))
        return dsts

    def _on_inner_evicted(self, ev: Eviction) -> None:
        """The inner tier's eviction, to this tier's listeners under chunk keys, ``payloads=None``
        (the inner tier's bytes are records, not chunks)."""
        failed = self._notify_evicted(Eviction(self.name, tuple(self.outer_key(k) for k in ev.keys)))
        if failed:
            self._count("evict_listener_errors", failed)

    # ---- helpers -----------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> int:
        """Add ``n`` to counter ``name``; returns its new value."""
        with self._lock:
            self.counters[name] += n
            return self.counters[name]

    @staticmethod
    def _source(payload: Any) -> torch.Tensor:
        """A flat uint8 tensor over the payload (zero copy for writable host buffers and tensors).

        Raises:
            ValueError: a non-contiguous tensor. TypeError / ValueError: not a buffer.
        """
        if isinstance(payload, torch.Tensor):
            if not payload.is_contiguous():
                raise ValueError("payload tensor is not contiguous")
            return payload.detach().reshape(-1).view(torch.uint8)
        mv = host_view(payload, writable=False)
        if mv.readonly:
            return torch.from_numpy(np.frombuffer(mv, np.uint8).copy())
        return torch.frombuffer(mv, dtype=torch.uint8) if mv.nbytes else torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _dest(out: Any) -> torch.Tensor:
        """A flat uint8 tensor over ``out`` (a host buffer or a CUDA tensor; zero copy).

        Raises:
            ValueError: a non-contiguous tensor. TypeError / ValueError: not a writable buffer.
        """
        if is_cuda_tensor(out) or isinstance(out, torch.Tensor):
            if not out.is_contiguous():
                raise ValueError("out tensor is not contiguous")
            return out.detach().reshape(-1).view(torch.uint8)
        mv = host_view(out, writable=True)
        return torch.frombuffer(mv, dtype=torch.uint8) if mv.nbytes else torch.empty(0, dtype=torch.uint8)
