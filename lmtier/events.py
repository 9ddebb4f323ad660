"""Index events: what the tier manager publishes when a chunk becomes visible or leaves a tier.

Subscribers (the vLLM connector's index mirror) register with
:meth:`lmtier.manager.TierManager.add_listener`. This module imports neither torch nor vLLM, so a
scheduler-side process can decode events without them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["IndexEventKind", "IndexEvent", "IndexListener"]


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
