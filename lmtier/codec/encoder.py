"""Encoding host chunks on a GPU: :class:`DeviceEncoder` (the codec tier's write path on CUDA workers).

:func:`lmtier.codec.chunk.encode_chunk` runs entirely on the device when it is given a CUDA tensor
(native quantize, batched rANS encode; the record comes back in host memory, byte-identical to the
CPU encoder's). The tier manager hands a codec tier's ``put`` the chunk's *host* copy (a CPU-pool
slot), whose CPU encode is far slower than the engine stores chunks (benchmarks/RESULTS.md). A
:class:`DeviceEncoder` copies such a chunk into a device buffer and encodes it there.

* **Slots** (a small pool, one per concurrent caller — the tier manager's write-through threads —
  at most ``max_idle_slots`` kept idle): a device buffer of one chunk (``uint8 [raw_bytes]``) and a
  non-default CUDA stream (``torch.cuda.Stream()``: from torch's per-device pool of streams, which
  other code of the process may draw from too), so encodes do not queue behind the model's compute
  stream (the default stream); a stream shared with other work costs speed, not correctness.
* **One encode** (under the slot's stream as the current stream): async H2D of the chunk into the
  slot's buffer, then :func:`~lmtier.codec.chunk.encode_chunk` on it (its kernels and allocations
  on that stream; it synchronizes the stream before reading the coder's results back), then a sync
  of that stream before the slot is reused or freed — so no buffer is released while a copy or
  kernel still uses it, and the host chunk may be reused once :meth:`DeviceEncoder.encode` returns.
* **Lazy**: construction touches nothing on CUDA (a CPU-only process may build one); the first
  :meth:`~DeviceEncoder.encode` checks that ``lmtier._C`` was built with CUDA (else the device
  copy would be encoded by ``encode_chunk``'s CPU fallback) and creates the first slot.

Thread-safe: slots are handed out under a lock, one caller at a time per slot.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import chunk as cchunk
from .levels import Level

__all__ = ["DeviceEncoder"]


class _Slot:
    """One caller's device buffer (``uint8 [raw_bytes]``) and CUDA stream."""

    def __init__(self, device: torch.device, raw_bytes: int) -> None:
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device=device)
            with torch.cuda.stream(self.stream):  # allocated on the stream that uses it
                self.buf = torch.empty(raw_bytes, dtype=torch.uint8, device=device)


class DeviceEncoder:
    """Encode host chunks of one geometry on one CUDA device (see the module doc).

    Args:
        shape: canonical chunk shape ``(L, 2, T, H, D)``.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        level: the codec level (a checked :class:`~lmtier.codec.levels.Level`); None for an encoder
            used through :meth:`run` only (another record format).
        device: a CUDA device with its index (``torch.device("cuda", 0)``, ``"cuda:0"``). Not
            touched before the first :meth:`encode`.
        max_idle_slots: slots kept while idle (more are made while more callers encode at once).

    Raises:
        ValueError: ``device`` is not ``cuda:N``; ``max_idle_slots`` < 0.
    """

    def __init__(
        self,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        level: Level | None,
        device: torch.device | str,
        max_idle_slots: int = 4,
    ) -> None:
        dev = torch.device(device)
        if dev.type != "cuda" or dev.index is None:
            raise ValueError(f"DeviceEncoder: device must be a CUDA device with its index (cuda:N), got {device!r}")
        if max_idle_slots < 0:
            raise ValueError(f"DeviceEncoder: max_idle_slots must be >= 0, got {max_idle_slots}")
        self.device = dev
        self.shape = tuple(int(v) for v in shape)
        self.dtype = dtype
        self.level = level
        self.raw_bytes = math.prod(self.shape) * torch.empty(0, dtype=dtype).element_size()
        self.max_idle_slots = int(max_idle_slots)
        self._idle: list[_Slot] = []
        self._checked = False
        self._closed = False
        self._lock = threading.Lock()

    def encode(
        self, src: torch.Tensor, *, tables: cchunk.StaticTables | None, scratch: bool = False
    ) -> bytes | memoryview:
        """Encode one chunk on :attr:`device`; returns its record, the same bytes as
        ``encode_chunk(src, ...)`` on the CPU.

        Args:
            src: the chunk's canonical bytes, a contiguous host ``torch.uint8`` tensor of
                :attr:`raw_bytes` (pinned or pageable; read until this returns).
            tables: the static table set to code with (None: per-stream tables).
            scratch: as for :func:`~lmtier.codec.chunk.encode_chunk`.

        Returns:
            The record in host memory, complete (nothing of it is still in flight): ``bytes``, or
            with ``scratch`` a view of this thread's packing buffer.

        Raises:
            RuntimeError: ``lmtier._C`` was built without CUDA (checked before anything touches the
                device); the encoder is closed.
            ValueError: ``src`` is not a host uint8 tensor of one chunk.
            torch.OutOfMemoryError, RuntimeError (CUDA errors), CodecInputError (KV the level
                cannot represent), ValueError: what :func:`~lmtier.codec.chunk.encode_chunk` and
                torch raise. After any of them no slot in a doubtful state is reused.
        """
        if self.level is None:
            raise ValueError("DeviceEncoder.encode: built without a level (use run)")
        level = self.level
        return self.run(
            src,
            lambda buf: cchunk.encode_chunk(
                buf, shape=self.shape, dtype=self.dtype, level=level, tables=tables, scratch=scratch
            ),
        )

    def run(self, src: torch.Tensor, encode: Callable[[torch.Tensor], Any]) -> Any:
        """Copy the host chunk ``src`` into a slot's device buffer and return ``encode(buffer)``,
        run with the slot's stream as the current stream (the slot and stream handling of
        :meth:`encode`, for another record format: :class:`lmtier.tiers.codec_pca.PCACodecTier`).

        Args:
            src: as for :meth:`encode`.
            encode: takes the device buffer (``uint8 [raw_bytes]`` on :attr:`device`, valid until it
                returns) and returns the record in host memory (``bytes`` or a host buffer).

        Raises:
            What :meth:`encode` raises (``encode``'s errors instead of ``encode_chunk``'s).
        """
        if src.is_cuda or src.dtype != torch.uint8 or src.numel() != self.raw_bytes or not src.is_contiguous():
            raise ValueError(
                f"DeviceEncoder.encode: src must be a contiguous host uint8 tensor of {self.raw_bytes} bytes, got "
                f"{src.dtype} [{src.numel()}] on {src.device}"
            )
        slot = self._acquire()
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(slot.stream):
                slot.buf.copy_(src, non_blocking=True)  # ordered before the encode's kernels (same stream)
                record = encode(slot.buf)
            slot.stream.synchronize()  # the copy and every kernel done before the slot is reused
        except BaseException:
            _drain(slot)
            raise
        self._release(slot)
        return record

    def close(self) -> None:
        """Free the idle slots; slots in use are freed when their encode returns. Later
        :meth:`encode` calls raise RuntimeError."""
        with self._lock:
            self._closed = True
            self._idle.clear()

    def idle_slots(self) -> int:
        """How many slots are kept idle now (tests)."""
        with self._lock:
            return len(self._idle)

    # ---- slots -------------------------------------------------------------------------------

    def _acquire(self) -> _Slot:
        with self._lock:
            if self._closed:
                raise RuntimeError("DeviceEncoder is closed")
            if self._idle:
                return self._idle.pop()
            checked = self._checked
        if not checked:
            from lmtier import _C

            if not _C.built_with_cuda():  # encode_chunk would silently encode the device copy on the CPU
                raise RuntimeError(f"lmtier._C was built without CUDA: cannot encode on {self.device}")
            with self._lock:
                self._checked = True
        return _Slot(self.device, self.raw_bytes)

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle_slots:
                self._idle.append(slot)


def _drain(slot: _Slot) -> None:
    """After a failed encode: wait for the slot's stream so its buffer is freed only once nothing
    uses it (the slot is then dropped, not reused); a sticky CUDA error raised again is ignored
    (the original error propagates)."""
    try:
        slot.stream.synchronize()
    except Exception:  # noqa: BLE001, S110 - the caller re-raises the first error
        pass
