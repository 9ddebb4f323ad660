"""Index events: what the tier manager publishes when a chunk becomes visible or leaves a tier.

Subscribers (the vLLM connector's index mirror) register with
:meth:`lmtier.manager.TierManager.add_listener`. This module imports neither torch nor vLLM, so a
scheduler-side process can decode events without them.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["IndexEventHub", "IndexEventKind", "IndexEvent", "IndexListener"]

log = logging.getLogger("lmtier.manager")


class IndexEventKind(str, enum.Enum):
    """What happened to a chunk."""

    STORED = "stored"
    """The chunk became visible to lookups in ``tier``."""
    EVICTED = "evicted"
    """The chunk left the CPU pool (LRU)."""
    DISK_EVICTED = "disk_evicted"
    """The disk tier's LRU deleted the chunk's record."""


@dataclass(frozen=True)
class IndexEvent:
    """One index change of one chunk.

    Attributes:
        kind: see :class:`IndexEventKind`.
        key: the tier manager's (this rank's) 32-byte chunk key.
        tier: ``STORED``: the tier now holding it (``"cpu"``; ``"disk"`` or ``"remote"`` when it
            was stored without the CPU pool: no pool, or every slot pinned); ``EVICTED``:
            ``"disk"`` when it is on disk (written back, or there already) as it leaves the CPU
            pool, else ``None``; ``DISK_EVICTED``: ``None``.
    """

    kind: IndexEventKind
    key: bytes
    tier: str | None


IndexListener = Callable[[IndexEvent], None]
"""``fn(event)``: called synchronously in the thread where the change happened, after it happened;
must be quick and thread-safe; exceptions are logged by the manager, never raised."""


class IndexEventHub:
    """The listeners of one tier manager's index events.

    :meth:`add` / :meth:`remove` from any thread; :meth:`publish` calls every listener registered at
    that moment (a snapshot: the list is replaced, never mutated), synchronously, in the calling
    thread. A listener's exception is logged and reported through ``on_error()``, never raised.
    """

    def __init__(self, on_error: Callable[[], None]) -> None:
        self._on_error = on_error
        self._listeners: list[IndexListener] = []
        self._lock = threading.Lock()

    def add(self, fn: IndexListener) -> None:
        with self._lock:
            self._listeners = [*self._listeners, fn]

    def remove(self, fn: IndexListener) -> None:
        """Stop calling ``fn`` (a no-op if it is not registered)."""
        with self._lock:
            self._listeners = [f for f in self._listeners if f != fn]

    def publish(self, kind: IndexEventKind, key: bytes, tier: str | None) -> None:
        listeners = self._listeners
        if not listeners:
            return
        ev = IndexEvent(kind, key, tier)
        for fn in listeners:
            try:
                fn(ev)
            except Exception:
                log.exception("index listener %r failed on %s", fn, ev)
                self._on_error()
