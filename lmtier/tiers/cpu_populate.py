"""The CPU pool's populate-ahead thread: maps an unpinned arena's pages a window ahead of the slots in use.

:class:`~lmtier.tiers.cpu.CPUPool` with ``populate="ahead"`` (the default for an arena it allocates
and that is not pinned) hands never-used slots out in index order (freed ones are reused first), so
mapping slots ``[0, target)`` ahead of the highest slot handed out suffices. :class:`PopulateAhead`
keeps :data:`POPULATE_AHEAD_BYTES` mapped ahead of it on a daemon thread at the lowest CPU priority
(:func:`lmtier.memory.populate`: ``madvise(MADV_POPULATE_WRITE)``, in pieces of
:data:`POPULATE_PIECE_BYTES`), so stores into never-used slots take no first-touch page faults in the
serving path while resident memory still grows only with use.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref

import torch

__all__ = ["POPULATE_AHEAD_BYTES", "POPULATE_PIECE_BYTES", "PopulateAhead"]

POPULATE_AHEAD_BYTES = 256 << 20  # CPUPool(populate="ahead"): mapped ahead of the slots in use
POPULATE_PIECE_BYTES = 8 << 20  # one madvise call (a concurrent fault there waits for it)


class PopulateAhead:
    """Maps slots ``[0, target)`` of a pool's arena on a daemon thread (``lmtier-populate``);
    :meth:`slot_used_locked` moves ``target`` as slots are handed out.

    Args:
        arena: the pool's arena, a 1-D contiguous CPU ``torch.uint8`` tensor of
            ``num_slots * slot_bytes`` bytes.
        slot_bytes: bytes per slot (a multiple of 4096).
        num_slots: slots in the arena.
        lock: the pool's lock: the thread's condition variable uses it, and
            :meth:`slot_used_locked` is called with it held.
        counters: the pool's counters; ``populated_slots`` is set to the number of slots mapped so far.
    """

    def __init__(
        self,
        arena: torch.Tensor,
        slot_bytes: int,
        num_slots: int,
        lock: threading.Lock,
        counters: collections.Counter[str],
    ) -> None:
        from lmtier.memory import start_background

        self.arena = arena
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.counters = counters
        self._ahead = max(1, POPULATE_AHEAD_BYTES // slot_bytes)
        self._cond = cond = threading.Condition(lock)
        self._target = min(num_slots, self._ahead)
        self._closed = False
        stop = threading.Event()

        def wake() -> None:  # no reference to the populator: an unclosed pool is still freed
            stop.set()
            with cond:
                cond.notify_all()

        self._thread = start_background(
            PopulateAhead._loop, (weakref.ref(self), cond, stop), name="lmtier-populate", stop=wake
        )

    def slot_used_locked(self, idx: int) -> None:
        """Slot ``idx`` is being handed out (pool lock held): once it is within a window of the
        target, move the target to ``idx`` plus two windows and wake the thread."""
        if idx + self._ahead > self._target:
            self._target = min(self.num_slots, idx + 2 * self._ahead)
            self._cond.notify()

    def close(self) -> None:
        """Stop and join the thread (it calls torch, which must not run on a daemon thread at
        interpreter exit: :mod:`lmtier.memory`)."""
        from lmtier.memory import join_background

        with self._cond:
            self._closed = True
            self._cond.notify()
        join_background(self._thread)

    @staticmethod
    def _loop(ref: weakref.ref[PopulateAhead], cond: threading.Condition, stop: threading.Event) -> None:
        """Daemon thread: map slots ``[done, target)`` whenever the target moves.
        Holds only a weak reference to the populator between rounds, so an unclosed pool is still
        freed. Returns once it is closed or freed or ``stop`` is set (checked between pieces)."""
        from lmtier.memory import populate

        try:  # background work: lowest CPU priority (Linux: per thread), never ahead of a forward pass
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        done = 0
        while True:
            with cond:
                pop = ref()
                if pop is None or pop._closed or stop.is_set():
                    return
                if pop._target <= done:
                    del pop
                    cond.wait(1.0)
                    continue
                target = pop._target
                step = max(1, POPULATE_PIECE_BYTES // pop.slot_bytes)
                slot_bytes, arena = pop.slot_bytes, pop.arena
                del pop
            # In pieces: a fault in a range being populated waits for that madvise call.
            for a in range(done, target, step):
                if stop.is_set():
                    return
                if not populate(arena[a * slot_bytes : min(a + step, target) * slot_bytes], stop=stop):
                    return  # not supported here (pages fault on first write, as without populating), or stopped
            del arena
            done = target
            with cond:
                pop = ref()
                if pop is not None:
                    pop.counters["populated_slots"] = done
                del pop
