"""The Mooncake tier's registered bounce region (one anonymous mapping and a first-fit allocator of
its extents, so that a client call that outlives its timeout only ever writes into an extent still
reserved for it) and the batches of records that move through it."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import threading
import time
from typing import Any

import numpy as np

from lmtier.tiers.buffers import address_of, round_up

__all__ = ["ALIGN", "Batch", "BounceRegion", "copy_out"]

ALIGN = 64
"""Records in the region start on cache lines (bytes)."""


class BounceRegion:
    """The registered bounce region and a first-fit allocator of its extents (64-byte aligned).

    An extent handed to a client call is released by :meth:`release` only once that call returned
    (a timed-out call releases from its future's done callback)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = round_up(nbytes)
        self.map = mmap.mmap(-1, self.nbytes)
        self.mv = memoryview(self.map)
        self.address = address_of(self.mv)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted, coalesced
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout_s: float) -> int | None:
        """Offset of a free extent of ``n`` bytes, waiting up to ``timeout_s``; None if none freed up."""
        n = round_up(max(n, 1), ALIGN)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, (off, size) in enumerate(self._free):
                    if size >= n:
                        if size == n:
                            del self._free[i]
                        else:
                            self._free[i] = (off + n, size - n)
                        return off
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def release(self, off: int, n: int) -> None:
        n = round_up(max(n, 1), ALIGN)
        with self._cond:
            free = sorted([*self._free, (off, n)])
            merged: list[tuple[int, int]] = []
            for o, s in free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self._free = merged
            self._cond.notify_all()

    def close(self) -> None:
        self.mv.release()
        with contextlib.suppress(BufferError):
            self.map.close()


@dataclasses.dataclass(eq=False)
class Batch:
    """Records moved by one client call: their indices in the caller's lists, offsets in the bounce
    extent and value sizes (bytes; ``direct``: payload sizes, the extent holding only the headers);
    filled in as the call is started."""

    idx: list[int] = dataclasses.field(default_factory=list)
    offs: list[int] = dataclasses.field(default_factory=list)
    sizes: list[int] = dataclasses.field(default_factory=list)
    total: int = 0
    moved: int = 0  # bytes the call moves (the sub-batch split counts these)
    direct: bool = False  # records whose payload moves straight from/into the caller's pool slot
    slots: list[int | None] = dataclasses.field(default_factory=list)  # direct get: the slots read into
    held: list[int] = dataclasses.field(default_factory=list)  # direct get timed out: the slots held
    base: int | None = None
    ptrs: list[int] = dataclasses.field(default_factory=list)
    kind: str = ""
    pending: Any = None  # the started client call
    names: list[str] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)
    views: list[memoryview] = dataclasses.field(default_factory=list)


def copy_out(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` with the GIL released (numpy), so verification of one sub-batch and the
    transfers of others run in parallel."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
