"""The device adapter of the host tiers: CUDA tensors in and out through pinned bounce buffers.

The disk and Redis tiers move bytes between host memory and a file or a socket, and they
checksum them on the host. They accept CUDA tensors as ``payload`` / ``out`` all the same, through
one :class:`PinnedBounce` each:

* **store** (:meth:`PinnedBounce.host_payload`): a CUDA payload is copied (synchronously) into a
  pooled page-locked buffer, and the tier's host path reads it from there;
* **load** (:meth:`PinnedBounce.get_into`): the tier's host path reads into a pooled page-locked
  buffer as large as ``out`` (page aligned: O_DIRECT reads land in it directly), then one
  host-to-device copy (synchronous) fills ``out``.

Host buffers pass straight through (:func:`lmtier.tiers.buffers.host_view`, no copy). The pinned
pool is created on first use, so processes that never hand a CUDA tensor to a tier never allocate
page-locked memory. The disk tier's GPUDirect Storage path (kvikio straight into device memory,
used in ``"auto"`` mode only with real GDS) is the disk tier's own decision and lives there
(:mod:`lmtier.tiers.disk.records`); it falls back to this adapter.

torch is imported lazily, only for CUDA tensors.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from lmtier.tiers.buffers import BouncePool, host_view

__all__ = ["is_cuda_tensor", "cuda_nbytes", "flat_u8", "PinnedBounce"]


def is_cuda_tensor(obj: Any) -> bool:
    """True for a torch tensor on a CUDA device (checked without importing torch)."""
    return type(obj).__module__.startswith("torch") and bool(getattr(obj, "is_cuda", False))


def cuda_nbytes(t: Any) -> int:
    """Bytes of a torch tensor (``numel * element_size``)."""
    return t.numel() * t.element_size()


def flat_u8(t: Any) -> Any:
    """A contiguous torch tensor (any dtype, any device) as a flat ``torch.uint8`` view (no copy).

    Raises:
        TypeError: not contiguous.
    """
    import torch

    if not t.is_contiguous():
        raise TypeError("CUDA tensor is not contiguous")
    return t.detach().reshape(-1).view(torch.uint8)


class PinnedBounce:
    """Pinned bounce buffers between CUDA tensors and a host tier's byte paths. Thread-safe.

    Args:
        max_cached: pinned buffers kept for reuse (the largest first); more are freed on release.
    """

    def __init__(self, *, max_cached: int = 2) -> None:
        self._max_cached = max_cached
        self._pool: BouncePool | None = None
        self._lock = threading.Lock()

    def pool(self) -> BouncePool:
        """The pinned :class:`~lmtier.tiers.buffers.BouncePool` (created on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = BouncePool(max_cached=self._max_cached, pinned=True)
            return self._pool

    @contextlib.contextmanager
    def host_payload(self, payload: Any) -> Iterator[memoryview]:
        """A flat read-only-or-writable ``uint8`` host view of ``payload`` for the ``with`` block.

        Args:
            payload: a contiguous CUDA tensor (any dtype; copied into a pinned buffer first) or any
                host buffer :func:`~lmtier.tiers.buffers.host_view` takes (no copy).

        Raises:
            TypeError: non-contiguous or unsupported ``payload``.
        """
        if not is_cuda_tensor(payload):
            yield host_view(payload, writable=False)
            return
        src = flat_u8(payload)
        n = src.numel()
        pool = self.pool()
        buf = pool.acquire(n)
        try:
            if n:
                buf.tensor(n).copy_(src)
            yield buf.mv[:n]
        finally:
            pool.release(buf)

    def get_into(self, out: Any, read_host: Callable[[memoryview], int | None]) -> int | None:
        """Fill ``out`` with ``read_host``'s bytes.

        Args:
            out: a contiguous CUDA tensor (any dtype, written as bytes) or a writable host buffer.
            read_host: ``read_host(mv) -> n | None``: the tier's host read into the writable
                ``uint8`` memoryview ``mv`` (``out`` itself for host buffers; a page-aligned pinned
                buffer of ``out``'s size for CUDA tensors), returning the bytes read or None.

        Returns:
            ``read_host``'s result; for CUDA tensors ``out[:n]`` holds the bytes once this returns.

        Raises:
            TypeError: non-contiguous or read-only ``out``.
        """
        if not is_cuda_tensor(out):
            return read_host(host_view(out, writable=True))
        dst = flat_u8(out)
        cap = dst.numel()
        pool = self.pool()
        buf = pool.acquire(cap)
        try:
            n = read_host(buf.mv[:cap])
            if n is not None and n:
                dst[:n].copy_(buf.tensor(n))
            return n
        finally:
            pool.release(buf)

    def close(self) -> None:
        """Free the cached pinned buffers."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
