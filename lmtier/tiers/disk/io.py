"""POSIX I/O helpers of the disk tier: whole-buffer ``pread``/``pwrite``, GIL-free copies, quiet
unlinks, and the background priority of write threads (Linux ``setpriority`` + ``ioprio_set``)."""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import numpy as np

__all__ = ["background_priority", "listdir", "unlink_quiet", "wait_all", "copy_into", "pwrite_all", "pread_into"]

# ioprio_set(2): syscall numbers by machine (no libc wrapper); IOPRIO_WHO_PROCESS with a thread id
# applies to that thread only.
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT, _IOPRIO_WHO_PROCESS = 2, 13, 1
_libc = None


def background_priority() -> None:
    """Lower the calling thread to background priority: CPU nice 19 and I/O priority best-effort
    level 7 (the lowest level of the default class; the idle class could starve writes outright).

    For threads that only do background work (write-through, write-back): on a small host they
    must not take cores or device time from the forward pass or from a load. Linux only; a no-op
    (silently) elsewhere or when not permitted.
    """
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):  # not Linux, or not permitted
        pass
    global _libc
    try:
        nr = _SYS_IOPRIO_SET.get(os.uname().machine)
        if nr is None:
            return
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall(nr, _IOPRIO_WHO_PROCESS, tid, (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | 7)
    except (AttributeError, OSError):
        pass


def listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def wait_all(futs) -> None:
    """Wait for every future; re-raise the first error after all finished."""
    err = None
    for f in futs:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            err = err or e
    if err is not None:
        raise err


def copy_into(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src (NumPy's copy releases the GIL, unlike memoryview slice assignment)."""
    if src.nbytes:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while mv.nbytes:
        k = os.pwrite(fd, mv, offset)
        if k <= 0:
            raise OSError(errno.EIO, "pwrite wrote 0 bytes")
        mv = mv[k:]
        offset += k


def pread_into(fd: int, mv: memoryview, offset: int) -> int:
    """Read up to ``mv.nbytes`` at ``offset``; returns the count (short only at end of file)."""
    total = 0
    while total < mv.nbytes:
        k = os.preadv(fd, [mv[total:]], offset + total)
        if k == 0:
            break
        total += k
    return total
