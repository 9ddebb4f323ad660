"""Host buffers for the tiers' I/O: flat byte views, page-aligned buffers and a pool of them.

Used by the disk and Redis tiers (I/O into caller buffers and bounce buffers), the codec tier
(record scratch) and :mod:`lmtier.tiers.device` (pinned bounce buffers for CUDA tensors).
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

__all__ = ["PAGE_BYTES", "round_up", "host_view", "address_of", "copy_into", "AlignedBuffer", "BouncePool"]

PAGE_BYTES = 4096


def round_up(n: int, align: int = PAGE_BYTES) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def copy_into(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for byte views of one length, with the GIL released (NumPy's copy; a
    memoryview slice assignment holds it, stalling every other thread for a large record).

    Raises:
        ValueError: lengths that differ (as NumPy's broadcast)."""
    if src.nbytes:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def host_view(obj, *, writable: bool) -> memoryview:
    """A flat, C-contiguous ``uint8`` memoryview of a host buffer (no copy).

    Accepts bytes/bytearray/memoryview/mmap, NumPy arrays and CPU torch tensors.

    Raises:
        TypeError: CUDA tensor, non-contiguous or (if ``writable``) read-only buffer.
    """
    if type(obj).__module__.startswith("torch"):
        import torch

        if obj.is_cuda:
            raise TypeError("host_view: CUDA tensor; use a bounce buffer")
        if not obj.is_contiguous():
            raise TypeError("host_view: tensor is not contiguous")
        obj = obj.detach().reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise TypeError("host_view: buffer is not C-contiguous")
    if writable and mv.readonly:
        raise TypeError("host_view: buffer is read-only")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def address_of(mv: memoryview) -> int:
    """Start address of a memoryview (read-only ones too); 0 for an empty view."""
    if mv.nbytes == 0:
        return 0
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


class AlignedBuffer:
    """A page-aligned host buffer of ``nbytes`` (rounded up to 4 KiB); ``.mv`` is a writable view.

    ``pinned=True`` allocates page-locked memory through torch (``cudaHostAlloc``), for copies
    to/from CUDA tensors; torch's caching host allocator hands out sub-page offsets for small sizes,
    so one extra page is allocated and the buffer starts at its first page boundary. Otherwise an
    anonymous ``mmap`` (page aligned).
    """

    def __init__(self, nbytes: int, *, pinned: bool = False) -> None:
        self.nbytes = round_up(max(nbytes, 1))
        self.pinned = pinned
        self._map = None
        self._tensor = None
        if pinned:
            import torch

            base = torch.empty(self.nbytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
            skip = -base.data_ptr() % PAGE_BYTES
            self._tensor = base[skip : skip + self.nbytes]  # the view keeps the allocation alive
            self.mv = memoryview(self._tensor.numpy())
        else:
            self._map = mmap.mmap(-1, self.nbytes)
            self.mv = memoryview(self._map)
        self.address = address_of(self.mv)
        if self.address % PAGE_BYTES:  # an invariant of both branches above
            raise RuntimeError(f"AlignedBuffer: {self.address:#x} is not page aligned")

    def tensor(self, nbytes: int):
        """A ``torch.uint8`` CPU tensor viewing bytes ``[0, nbytes)``."""
        import torch

        if self._tensor is not None:
            return self._tensor[:nbytes]
        return (
            torch.frombuffer(self.mv, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        )

    def close(self) -> None:
        self.mv.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still exported; freed when it goes away
                pass
        self._tensor = None


class BouncePool:
    """Reusable page-aligned buffers (no allocation on the hot path once warm).

    ``acquire(n)`` returns a buffer of >= ``n`` bytes (new ones are rounded up to 1 MiB);
    ``release`` keeps at most ``max_cached`` buffers, preferring the largest.
    """

    def __init__(self, *, max_cached: int = 4, pinned: bool = False) -> None:
        self._free: list[AlignedBuffer] = []
        self._lock = threading.Lock()
        self._max_cached = max_cached
        self._pinned = pinned

    def acquire(self, nbytes: int) -> AlignedBuffer:
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free.remove(best)
                return best
        return AlignedBuffer(round_up(nbytes, (1 << 20) if nbytes > (1 << 20) else PAGE_BYTES), pinned=self._pinned)

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: -b.nbytes)
            drop = self._free[self._max_cached :]
            del self._free[self._max_cached :]
        for b in drop:
            b.close()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for b in free:
            b.close()
