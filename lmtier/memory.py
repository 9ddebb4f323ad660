"""Host memory for the CPU tier and staging: page-aligned, pinned where CUDA is present.

``HostBuffer`` owns one allocation of exactly ``nbytes`` bytes (no power-of-two rounding as in
torch's caching host allocator). With a CUDA device it is page-locked and mapped
(``cudaHostAlloc(cudaHostAllocPortable | cudaHostAllocMapped)``), so copy engines reach full PCIe
speed and GPU kernels can address it directly (zero-copy). Without one it is plain 4 KiB-aligned
memory (``posix_memalign``), which is what O_DIRECT disk I/O needs.

Plain memory is mapped lazily by the kernel: the first write to each 4 KiB page takes a page fault
(measured on the 2-core CPU box: a store into a never-touched pool slot ran at about a third of
the speed of one into a touched slot). :func:`populate` maps a range up front
(``madvise(MADV_POPULATE_WRITE)``, Linux >= 5.14, contents unchanged), so the CPU pool pays the
faults once at startup instead of inside the serving path.

Background threads that call torch (populating on a daemon thread) are started with
:func:`start_background` and stopped with :func:`join_background`; interpreter exit stops and joins
the ones still running (``atexit``) before CPython finalizes. A daemon thread still inside torch at
finalization aborts the process: when the torch call returns and re-takes the GIL, CPython ends the
thread with ``pthread_exit``, whose forced unwind through torch's C++ frames calls
``std::terminate`` ("terminate called without an active exception", SIGABRT; seen in 1 of ~10
runs of ``examples/library_api.py`` on a loaded 2-core box, where the nice-19 populate thread was
still at work when the main thread exited).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from collections.abc import Callable

import torch

from lmtier import _C

PAGE_BYTES = 4096
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+)

log = logging.getLogger("lmtier.memory")

_libc = None


def _madvise(addr: int, nbytes: int, advice: int) -> int:
    """``madvise(2)``; returns 0 or the errno (never raises)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), advice) == 0:
        return 0
    return ctypes.get_errno() or -1


POPULATE_PIECE_BYTES = 32 << 20
BACKGROUND_JOIN_TIMEOUT_S = 60.0  # one populate piece at nice 19 on a loaded box takes seconds at most

_background: dict[threading.Thread, Callable[[], None]] = {}  # live background thread -> its stop()
_background_lock = threading.Lock()
_atexit_registered = False


def start_background(target: Callable[..., None], args: tuple = (), *, name: str, stop: Callable[[], None]):
    """Start ``target(*args)`` on a daemon thread that interpreter exit stops (``stop()``) and joins
    before finalization (see the module doc for why a daemon thread must not be inside torch then).

    Args:
        target: the thread's work; it must return soon after ``stop()`` was called.
        name: the thread name.
        stop: makes ``target`` return (set its event, wake its condition); never blocks for long,
            callable from any thread, and must not hold a strong reference to what ``target``
            references only weakly.

    Returns:
        the started ``threading.Thread`` (for :func:`join_background`).
    """
    global _atexit_registered
    th = threading.Thread(target=_run_background, args=(target, args), name=name, daemon=True)
    with _background_lock:
        if not _atexit_registered:
            atexit.register(_join_all_background)
            _atexit_registered = True
        _background[th] = stop
    th.start()
    return th


def _run_background(target: Callable[..., None], args: tuple) -> None:
    try:
        target(*args)
    finally:
        with _background_lock:
            _background.pop(threading.current_thread(), None)


def join_background(th: threading.Thread, timeout_s: float = BACKGROUND_JOIN_TIMEOUT_S) -> bool:
    """Stop the background thread ``th`` (its ``stop()``) and wait for it (not from ``th`` itself).

    Returns:
        True once it has ended; False (logged) if it is still running after ``timeout_s``.
    """
    with _background_lock:
        stop = _background.get(th)
    if stop is not None:
        stop()
    if th is threading.current_thread():
        return False
    th.join(timeout_s)
    if th.is_alive():
        log.warning("background thread %s still running after %.0f s", th.name, timeout_s)
        return False
    return True


def _join_all_background() -> None:
    """atexit: stop and join every background thread still running."""
    with _background_lock:
        live = list(_background)
    for th in live:
        join_background(th)


def populate(tensor: torch.Tensor, *, piece_bytes: int = 0, stop: threading.Event | None = None) -> bool:
    """Map every page of a CPU tensor's memory now, without changing its contents.

    Args:
        tensor: a contiguous CPU tensor (any dtype). Only whole pages inside it are advised; a
            partial first/last page is left to fault normally.
        piece_bytes: advise the range in pieces of this many bytes (0: one call). A page fault in
            the range waits while a populate call covering it runs (measured: a store into a pool
            being populated in one 2 GiB call stalled ~1.3 s), so background callers use pieces.
        stop: checked between pieces: once set, return False without mapping the rest.

    Returns:
        True when the kernel populated the range (``MADV_POPULATE_WRITE``), False when it is not
        supported (older kernel, not Linux) — the pages then fault on first write as before — or
        when ``stop`` was set.
        Safe to call while other threads read or write the memory (no byte is written).

    Raises:
        ValueError: not a contiguous CPU tensor.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("populate: expected a contiguous CPU tensor")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // PAGE_BYTES) * PAGE_BYTES
    last = end // PAGE_BYTES * PAGE_BYTES
    if last <= first:
        return True
    step = last - first if piece_bytes <= 0 else max(PAGE_BYTES, piece_bytes // PAGE_BYTES * PAGE_BYTES)
    for a in range(first, last, step):
        if stop is not None and stop.is_set():
            return False
        try:
            err = _madvise(a, min(step, last - a), MADV_POPULATE_WRITE)
        except (OSError, AttributeError):  # no libc madvise (not Linux)
            return False
        if err:
            log.info("madvise(MADV_POPULATE_WRITE) unavailable (errno %d): host pages fault on first use", err)
            return False
    return True


class HostBuffer:
    """An owned, page-aligned host allocation.

    Args:
        nbytes: size in bytes (> 0).
        pinned: ``True`` requires page-locked memory (raises ``RuntimeError`` when no CUDA device is
            usable), ``False`` never pins, ``None`` (default) pins when a CUDA device is usable.
        populate: plain (unpinned) memory only — ``"now"`` maps every page before returning,
            ``"background"`` maps them on a daemon thread from the start of the buffer on, in pieces
            of 32 MiB (contents are never touched, so the buffer may be used meanwhile; a fault
            waits at most for one piece), ``"lazy"`` (default) leaves them to fault on first write.
            ``populated`` is set once done.
            Page-locked memory is always mapped already.

    Attributes:
        tensor: ``torch.uint8`` 1-D CPU tensor of ``nbytes`` viewing the memory (shares lifetime:
            keep the ``HostBuffer`` alive while the tensor is used).
        ptr: integer address; ``nbytes``; ``pinned``.
    """

    def __init__(self, nbytes: int, *, pinned: bool | None = None, populate: str = "lazy") -> None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"HostBuffer: nbytes must be a positive int, got {nbytes!r}")
        if populate not in ("lazy", "now", "background"):
            raise ValueError(f"HostBuffer: populate must be 'lazy', 'now' or 'background', got {populate!r}")
        if pinned is None:
            pinned = _C.cuda_device_count() > 0
        self._buf = _C.HostBuffer(nbytes, bool(pinned))
        self.nbytes = nbytes
        self.pinned = bool(pinned)
        self.ptr = self._buf.ptr
        self.tensor = torch.frombuffer(self._buf, dtype=torch.uint8)
        self.populated: threading.Event = threading.Event()
        self._stop = threading.Event()
        if self.pinned or populate == "lazy":
            if self.pinned:
                self.populated.set()
            return
        if populate == "now":
            self._populate()
        else:
            start_background(self._populate, name="lmtier-populate", stop=self._stop.set)

    def _populate(self) -> None:
        try:
            populate(self.tensor, piece_bytes=POPULATE_PIECE_BYTES, stop=self._stop)
        finally:
            self.populated.set()

    def view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor view of ``[offset, offset + nbytes)``; bounds-checked."""
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise IndexError(f"HostBuffer.view: [{offset}, {offset + nbytes}) outside [0, {self.nbytes})")
        return self.tensor[offset : offset + nbytes]

    def __repr__(self) -> str:
        return f"HostBuffer(nbytes={self.nbytes}, pinned={self.pinned}, ptr=0x{self.ptr:x})"
