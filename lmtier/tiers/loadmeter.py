"""The interface that times the tier manager's lower-tier reads (:class:`LoadMeter`) and the read
path labels it receives (:func:`read_path`)."""

from __future__ import annotations

from typing import Any, Protocol

from lmtier.tiers.base import Tier

__all__ = ["LoadMeter", "read_path"]


class LoadMeter(Protocol):
    """Times the lower tiers' reads of :meth:`lmtier.manager.TierManager.fetch_lower_many` (e.g.
    :class:`lmtier.integration.vllm.loadpolicy.BusyMeter`); called from any thread."""

    def begin(self, tier: str, path: str) -> Any:
        """A read of ``tier`` (``"disk"``, ``"p2p"``, ``"remote"``) by ``path`` (``"raw"``,
        ``"codec"``, ``"codec+device"``) starts; returns the token :meth:`end` takes."""
        ...

    def end(self, token: Any, nbytes: int) -> None:
        """That read ended, having delivered ``nbytes`` chunk bytes (0 on a miss)."""
        ...


def read_path(tier: Tier, device: bool) -> str:
    """How ``tier``'s chunks are read: ``"raw"`` records, ``"codec"`` records decoded on the host,
    ``"codec+device"`` decoded on the GPU (a :class:`LoadMeter` label)."""
    from lmtier.tiers.record_tier import RecordTier

    if not isinstance(tier, RecordTier):  # CodecTier, PCACodecTier
        return "raw"
    return "codec+device" if device else "codec"
