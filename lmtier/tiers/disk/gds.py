"""GPUDirect Storage loads of the disk tier through kvikio (optional, needs libcuda).

:class:`KvikioLoader` decides once per tier whether loads into CUDA tensors use kvikio
(``kvikio.CuFile.pread`` straight into device memory) and reads a record's payload with it.
Modes (``DiskTier(use_kvikio=...)``): ``"auto"`` uses kvikio only when it imports, works and has
real GPUDirect Storage (not compat mode: in compat mode kvikio bounces through host memory
itself, and the checksum needs a host copy too, so O_DIRECT into a pinned buffer plus one H2D copy
— :class:`lmtier.tiers.device.PinnedBounce` — moves fewer bytes); ``"never"``; ``"always"``
(kvikio even in compat mode; an unusable kvikio raises ``RuntimeError`` at the first CUDA load).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from lmtier import record as rec
from lmtier.tiers.device import PinnedBounce

__all__ = ["KvikioLoader", "KVIKIO_MODES"]

log = logging.getLogger("lmtier.tiers.disk")

KVIKIO_MODES = ("auto", "never", "always")


class KvikioLoader:
    """kvikio for CUDA loads, probed lazily (see the module doc). Thread-safe.

    Args:
        mode: ``"auto"``, ``"never"`` or ``"always"``.

    Raises:
        ValueError: unknown mode.
    """

    def __init__(self, mode: str) -> None:
        if mode not in KVIKIO_MODES:
            raise ValueError(f"DiskTier: use_kvikio must be 'auto', 'never' or 'always', got {mode!r}")
        self.mode = mode
        self._kvikio: Any = None  # the module once probed OK; False once probed unusable
        self._lock = threading.Lock()

    def module(self) -> Any | None:
        """The kvikio module when CUDA loads should use it, else None.

        Raises:
            RuntimeError: mode ``"always"`` and kvikio does not import.
        """
        if self.mode == "never" or self._kvikio is False:
            return None
        with self._lock:
            if self._kvikio is None:
                self._kvikio = self._probe()
        return self._kvikio or None

    def disable(self, why: Exception) -> None:
        """A kvikio load failed: use the pinned bounce from now on (mode ``"always"`` re-raises)."""
        if self.mode == "always":
            raise why
        log.warning("kvikio load failed (%s); falling back to POSIX for CUDA loads", why)
        self._kvikio = False

    def _probe(self) -> Any:
        try:
            import kvikio  # noqa: PLC0415 - optional, needs libcuda
            import kvikio.defaults

            compat = getattr(kvikio.defaults, "is_compat_mode_preferred", lambda: True)()
        except Exception as e:  # ImportError, or a missing libcuda surfacing at import
            if self.mode == "always":
                raise RuntimeError(f"DiskTier: use_kvikio='always' but kvikio is unusable: {e}") from e
            log.info("kvikio unavailable (%s); CUDA loads go through a pinned bounce buffer", e)
            return False
        if compat and self.mode == "auto":
            # Without GPUDirect Storage kvikio bounces through host memory itself, and the
            # checksum needs a host copy too: POSIX O_DIRECT into a pinned buffer + one H2D
            # copy moves fewer bytes.
            log.info("kvikio in compat mode (no GPUDirect Storage); CUDA loads use O_DIRECT + pinned bounce")
            return False
        return kvikio

    @staticmethod
    def read_payload(kvikio: Any, path: str, hdr: rec.RecordHeader, out_u8: Any, pinned: PinnedBounce) -> int:
        """Read the payload of the record file ``path`` (header ``hdr``, already validated) into
        ``out_u8`` (``torch.uint8`` CUDA tensor of >= ``hdr.payload_bytes``) with kvikio, then
        verify it through a pinned host copy (the checksum runs on the host).

        Returns:
            ``hdr.payload_bytes``.

        Raises:
            lmtier.record.RecordError: short read or checksum mismatch (the caller deletes the file).
            Exception: kvikio/CUDA failures (the caller falls back, see :meth:`disable`).
        """
        n = hdr.payload_bytes
        with kvikio.CuFile(path, "r") as f:
            got = f.pread(out_u8[:n], size=n, file_offset=hdr.payload_offset).get()
        if got != n:
            raise rec.RecordError(f"short read ({got} bytes)")
        pool = pinned.pool()
        buf = pool.acquire(n)
        try:
            buf.tensor(n).copy_(out_u8[:n])
            rec.verify_payload(hdr, buf.mv[:n])
        finally:
            pool.release(buf)
        return n
