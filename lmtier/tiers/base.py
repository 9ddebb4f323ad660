"""The storage-tier interface shared by the CPU pool, local disk and remote tiers.

A tier stores *chunks*: the canonical byte image of ``chunk_size`` tokens of KV for all layers
of one tensor-parallel rank (see :mod:`lmtier.layout` for the canonical layout), addressed by a
32-byte chunk key (see :mod:`lmtier.keys`). Tiers never interpret the bytes; the namespace bound
into every key makes chunks of incompatible models/geometries/codecs unreachable from each other.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from lmtier.errors import LMTierError
from lmtier.geometry import KEY_BYTES


class TierError(LMTierError, RuntimeError):
    """A tier failed in a way the caller should treat as a miss (load) or a dropped store."""


@dataclass(frozen=True)
class TierUsage:
    """Capacity and usage of one tier, in bytes and chunks."""

    capacity_bytes: int
    used_bytes: int
    num_chunks: int


class Tier(abc.ABC):
    """One storage tier.

    Contract:
      * ``put`` makes a chunk visible to ``contains``/``get_into`` only after every byte is
        durably stored in this tier; a failed put leaves no visible chunk.
      * ``get_into`` either fills ``out`` completely with verified bytes and returns the number of
        bytes, or returns ``None`` (miss / failed / corrupted — corrupted data is deleted). It never
        leaves a partially written ``out`` that the caller could mistake for a hit.
      * All methods are thread-safe.
    """

    name: str = "tier"

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """True if ``key`` (32 bytes) is stored and complete."""

    @abc.abstractmethod
    def get_into(self, key: bytes, out: memoryview) -> int | None:
        """Copy the chunk's payload into ``out`` (writable, C-contiguous, >= payload length).

        Returns the payload length in bytes, or ``None`` on a miss or on any failure.
        """

    @abc.abstractmethod
    def put(self, key: bytes, payload: memoryview) -> bool:
        """Store ``payload`` (read-only, contiguous bytes) under ``key``. Returns success."""

    @abc.abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; returns True if something was removed."""

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Current capacity and usage."""

    def close(self) -> None:  # pragma: no cover - default no-op
        """Release resources (threads, connections, file handles)."""
