"""The storage-tier protocol shared by the CPU pool, local disk, remote and codec tiers.

A tier stores *chunks*: the canonical byte image of ``chunk_size`` tokens of KV for all layers
of one tensor-parallel rank (see :mod:`lmtier.layout` for the canonical layout), addressed by a
32-byte chunk key (see :mod:`lmtier.keys`). Tiers never interpret the bytes; the namespace bound
into every key makes chunks of incompatible models/geometries/codecs unreachable from each other.

Evictions are published, not patched in: a tier that drops chunks on its own (the CPU pool's LRU,
the disk tier's LRU) calls every function registered with :meth:`Tier.add_eviction_listener`
with an :class:`Eviction`. The tier manager subscribes to its tiers (write-back, index events,
:mod:`lmtier.events`); nothing sets attributes on a tier object.
"""

from __future__ import annotations

import abc
import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmtier.errors import LMTierError
from lmtier.geometry import KEY_BYTES

__all__ = [
    "KEY_BYTES",
    "TIER_EVENTS",
    "TierError",
    "TierUsage",
    "Eviction",
    "EvictionListener",
    "Tier",
    "check_position",
]

log = logging.getLogger("lmtier.tiers")


class TierError(LMTierError, RuntimeError):
    """A tier failed in a way the caller should treat as a miss (load) or a dropped store."""


@dataclass(frozen=True)
class TierUsage:
    """Capacity and usage of one tier, in bytes and chunks."""

    capacity_bytes: int
    used_bytes: int
    num_chunks: int


@dataclass(frozen=True)
class Eviction:
    """Chunks that left a tier.

    Attributes:
        tier: the tier's name (``"cpu"``, ``"disk"``, ``"remote"``).
        keys: the 32-byte chunk keys, in eviction order.
        payloads: CPU pool only: each chunk's bytes (a ``torch.uint8`` CPU tensor view of its
            slot, ``[payload bytes]``), readable only until the listener returns (the tier
            manager's write-back copies them to disk then); ``None`` for other tiers.
        positions: CPU pool only: each chunk's position (:meth:`Tier.takes_position`; None where
            the store did not name it); ``None`` for other tiers.
    """

    tier: str
    keys: tuple[bytes, ...]
    payloads: tuple[Any, ...] | None = None
    positions: tuple[int | None, ...] | None = None


TIER_EVENTS = (
    "corrupt",
    "corrupt_deleted",
    "auth_failures",
    "decode_failures",
    "timeouts",
    "breaker_rejects",
    "not_regular",
    "get_errors",
    "stale",
    "bad_entries",
    "bad_nodes",
    "refused",
    "read_errors",
    "directory_errors",
    "stuck",
    "writes_dropped",
    "writes_skipped",
    "gpu_encodes",
    "gpu_encode_fallbacks",
)
"""Tier counters an operator watches (exported by the connector as
``vllm:lmtier_tier_events_total{tier,event}``): stored records that failed their checksum or format
(``corrupt``; codec records: ``corrupt_deleted``), their MAC (``auth_failures``, sealed tiers) or
decoding (``decode_failures``), remote calls that timed out or were refused by an open circuit
breaker; disk record paths holding a directory, symlink, FIFO or device node (``not_regular``) and
records that could not be opened or read (``get_errors``: ``EACCES``, ``EIO``; issue 20 section 2).
The P2P tier (:meth:`lmtier.tiers.p2p.tier.P2PTier.event_counts`) adds: chunks read from a
peer that did not match their directory entry (``stale``: the slot was reused), directory entries and
node records that failed their MAC or format (``bad_entries``, ``bad_nodes``), entries of peers not
on the allow-list (``refused``), READs that failed (``read_errors``: peer gone, its metadata did not
load), failed directory calls (``directory_errors``) and READs NIXL could not cancel (``stuck``);
its ``timeouts`` are READs past their deadline, its ``breaker_rejects`` count the peers' breakers and
the directory's. The tier manager adds, for its disk and remote tiers
(:meth:`lmtier.manager.TierManager.write_events`), chunks whose write-through was dropped because
the queue was full (``writes_dropped``) and chunks that left the CPU pool without reaching the tier
(``writes_skipped``: evicted before their write-through ran, or evicted in the engine step without a
write-back) — the tier falling behind the stores. A codec tier
(:class:`lmtier.tiers.codec.CodecTier`) counts the chunks it encoded on the worker's GPU
(``gpu_encodes``) and those whose GPU encode failed and fell back to the CPU
(``gpu_encode_fallbacks``; the first turns GPU encoding off for that tier)."""


def check_position(position: object, where: str) -> int | None:
    """``position`` if it is a chunk position (:meth:`Tier.takes_position`: the chunk's first token's
    position in its token sequence, tokens; an ``int >= 0``, not a bool) or None (unknown).

    Raises:
        ValueError: anything else (the message names ``where``, e.g. ``"CPUPool.reserve"``, and the value).
    """
    if position is None:
        return None
    if isinstance(position, int) and not isinstance(position, bool) and position >= 0:
        return position
    raise ValueError(f"{where}: position must be None or an int >= 0 (tokens), got {position!r}")


EvictionListener = Callable[[Eviction], None]
"""``fn(eviction)``: called in the thread that caused the eviction, outside the tier's lock; must be
thread-safe; exceptions are logged and counted by the tier, never raised to its caller."""


class Tier(abc.ABC):
    """One storage tier.

    Contract:
      * ``put`` makes a chunk visible to ``contains``/``get_into`` only after every byte is
        durably stored in this tier; a failed put leaves no visible chunk.
      * ``get_into`` either fills ``out`` completely with verified bytes and returns the number of
        bytes, or returns ``None`` (miss / failed / corrupted — corrupted data is deleted). It never
        leaves a partially written ``out`` that the caller could mistake for a hit.
      * Chunks the tier drops by itself (LRU) are reported to eviction listeners (:class:`Eviction`);
        ``delete`` and ``forget`` are not reported (the caller knows).
      * All methods are thread-safe.

    Subclasses must call ``super().__init__()`` (it creates the listener list).
    """

    name: str = "tier"

    def __init__(self) -> None:
        self.counters: collections.Counter[str] = collections.Counter()
        self._eviction_listeners: list[EvictionListener] = []
        self._eviction_listeners_lock = threading.Lock()

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """True if ``key`` (32 bytes) is stored and complete."""

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``[contains(k) for k in keys]``; tiers with a batched lookup (one round trip) override it
        (see :meth:`batches_contains`)."""
        return [bool(self.contains(k)) for k in keys]

    def batches_contains(self) -> bool:
        """True if :meth:`contains_many` is one batched lookup (e.g. one pipelined Redis round trip),
        so asking for many keys at once is cheaper than asking one by one until the first miss.
        Default: whether the class overrides :meth:`contains_many`."""
        return type(self).contains_many is not Tier.contains_many

    @abc.abstractmethod
    def get_into(self, key: bytes, out: Any) -> int | None:
        """Copy the chunk's payload into ``out`` (writable, C-contiguous, >= payload length).

        Returns the payload length in bytes, or ``None`` on a miss or on any failure.
        """

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """``[get_into(k, o) for k, o in zip(keys, outs)]``, each as :meth:`get_into`; tiers whose
        client moves several values in one call faster than one by one override it (see
        :meth:`batches_gets`).

        Raises:
            ValueError: ``keys`` and ``outs`` differ in length.
        """
        if len(keys) != len(outs):
            raise ValueError(f"{type(self).__name__}.get_many_into: {len(keys)} keys, {len(outs)} outs")
        return [self.get_into(k, o) for k, o in zip(keys, outs, strict=True)]

    def batches_gets(self) -> bool:
        """True if :meth:`get_many_into` moves a batch faster than one ``get_into`` per key (e.g.
        one Mooncake ``batch_get_into``), so a caller should hand it several chunks at once.
        Default: whether the class overrides :meth:`get_many_into`."""
        return type(self).get_many_into is not Tier.get_many_into

    @abc.abstractmethod
    def put(self, key: bytes, payload: Any) -> bool:
        """Store ``payload`` (read-only, contiguous bytes) under ``key``. Returns success.

        A tier is done reading ``payload`` when ``put`` returns (it copied or sent the bytes): the
        caller may reuse the memory at once. The codec tiers rely on it: they hand their inner tier
        each record in the buffer they assemble the next one in
        (:func:`lmtier.codec.format.pack_runs` ``scratch=True``). One exception, never a caller's
        buffer: a Mooncake tier's put straight from the slot of the CPU pool it is attached to may
        still read the slot after a call that timed out (:meth:`lmtier.tiers.mooncake.MooncakeTier.attach_pool`).

        Tiers with per-tenant budgets (:attr:`tenant_budgets` not None: the CPU pool, the Redis tier
        and the decorators over it) also take ``tenant=`` (:func:`lmtier.tiers.tenants.tenant_id`);
        the tier manager passes it only to those. Tiers whose :meth:`takes_position` is True also
        take ``position=`` (see there)."""

    def takes_position(self) -> bool:
        """True if :meth:`put` takes ``position=``: the position of the chunk's first token in its
        token sequence (``chunk index * chunk_size``; an ``int >= 0``, or None where the caller does
        not know it). A tier whose records depend on it (a PCA codec tier: keys are stored with RoPE
        undone, :class:`lmtier.tiers.codec_pca.PCACodecTier`) returns True and does not store a
        chunk of unknown position (its put returns False). The tier manager passes ``position=``
        only to those tiers. Default False."""
        return False

    @abc.abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key`` (its stored bytes too); returns True if something was removed."""

    @abc.abstractmethod
    def forget(self, key: bytes) -> bool:
        """Drop ``key`` from this process's index without deleting stored bytes: another process
        (sharing the storage) deleted them. Returns whether this process had it indexed."""

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Current capacity and usage."""

    @property
    def tenant_budgets(self) -> Any:
        """The per-tenant budgets this tier enforces (its ``put`` then takes ``tenant=``), or None
        (default). Decorators forward their inner tier's."""
        return None

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant id, this tier's budget counts (``commits``, ``evicted_by_self``,
        ``evicted_by_others``, ``evicted_others``, ``denied``, ``held_bytes``,
        ``guaranteed_bytes``); ``{}`` without budgets (default)."""
        return {}

    def event_counts(self) -> dict[str, int]:
        """Cumulative event counts of this tier since it was built (``counters``: ``corrupt``,
        ``timeouts``, ...); decorators (codec, seal) add those of the tier they wrap, their own
        counts winning a shared name. The connector exports the :data:`TIER_EVENTS` among them.

        Reads a snapshot: the tier's threads add counters while the connector reports (iterating the
        live ``Counter`` raised "dictionary changed size during iteration" inside vLLM's step)."""
        return {k: int(v) for k, v in dict(self.counters).items()}

    def attach_pool(self, pool: Any) -> None:  # noqa: B027 - a concrete default no-op, not abstract
        """Offered by the tier manager: its CPU pool (:class:`~lmtier.tiers.cpu.CPUPool`), whose slots
        callers pass to ``get_many_into`` / ``put_many``. A tier that can move bytes straight between
        those slots and its transport (Mooncake) registers the arena and, when a call that reads into
        a slot outlives its timeout, holds that slot (:meth:`CPUPool.hold
        <lmtier.tiers.cpu.CPUPool.hold>`). Default: nothing (decorators such as the codec tier pass
        their own buffers to the tier they wrap, so they do not forward it)."""

    def close(self) -> None:  # noqa: B027  # pragma: no cover - a concrete default no-op, not abstract
        """Release resources (threads, connections, file handles)."""

    # ---- eviction listeners -------------------------------------------------------------------

    def add_eviction_listener(self, fn: EvictionListener) -> None:
        """Call ``fn(eviction)`` for every later eviction (see :data:`EvictionListener`)."""
        with self._eviction_listeners_lock:
            self._eviction_listeners = [*self._eviction_listeners, fn]

    def remove_eviction_listener(self, fn: EvictionListener) -> None:
        """Stop calling ``fn`` (a no-op if it is not registered)."""
        with self._eviction_listeners_lock:
            self._eviction_listeners = [f for f in self._eviction_listeners if f != fn]

    def has_eviction_listeners(self) -> bool:
        """True while at least one listener is registered."""
        return bool(self._eviction_listeners)

    def _notify_evicted(self, ev: Eviction) -> int:
        """For subclasses: call every listener with ``ev`` (in registration order). Exceptions are
        logged, never raised; returns how many listeners failed (for the tier's counters)."""
        failed = 0
        for fn in self._eviction_listeners:  # a snapshot: the list is replaced, never mutated
            try:
                fn(ev)
            except Exception:  # an index or write-back failure must not fail the tier's caller
                failed += 1
                log.exception("%s: eviction listener %r failed", self.name, fn)
        return failed
