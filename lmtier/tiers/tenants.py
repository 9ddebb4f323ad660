"""Per-tenant budgets of the CPU pool: who a chunk belongs to, each tenant's guaranteed share, and
the choice of an eviction victim that never takes a tenant below its share.

A **tenant** is a request's ``cache_salt`` (vLLM's per-request salt; :class:`lmtier.keys.KeyScope`):
requests without a salt belong to the default tenant :data:`DEFAULT_TENANT`. The salt is part of
every chunk key, so two tenants never share a chunk: each chunk has exactly one tenant. A tenant is
named by :func:`tenant_id`, a short stable digest of its salt (never the salt itself: ids appear in
configuration, metrics and logs); the operator computes a salt's id with
``python -c "from lmtier.tiers.tenants import tenant_id; print(tenant_id('SALT'))"``. A low-entropy
salt can be guessed from its id by trying candidates, as it can from cache timing already.

Policy (budgets on: :class:`TenantShares` configured; :class:`TenantLedger` implements it):

* Tenant ``t`` is **guaranteed** ``g(t) = floor(share(t) * num_slots)`` slots, ``share(t)`` from
  ``cpu_tenant_shares`` or else ``cpu_tenant_share`` (0 when only per-tenant shares are set).
  ``held(t)`` counts the slots holding ``t``'s chunks (committed, being written, or pinned after a
  delete). Free slots go to whoever asks first: a tenant may hold more than ``g(t)`` (it
  **borrows** the unused shares of others) while the pool has room.
* When a writer ``w`` needs a slot and none is free, the victim is the least recently used
  *evictable* (committed, unpinned) chunk of, in this order:

  1. ``w`` itself, when ``held(w) >= g(w)`` (a tenant at or over its share recycles its own chunks);
  2. the tenants ``t != w`` with ``held(t) > g(t)`` (borrowers), the LRU chunk among all of them:
     a tenant under its share **reclaims** borrowed slots, oldest first;
  3. ``w`` itself (a tenant under its share whose share is not free because the shares are
     oversubscribed: guarantees add up to more than the pool);
  4. none: ``reserve`` returns ``None`` (back-pressure, counted as ``denied``), even if other
     tenants' chunks could be evicted: they are within their shares.

  Hence the invariant: **a chunk of tenant t is evicted for another tenant only while
  ``held(t) > g(t)``**, so other tenants' pressure never takes ``t`` below its guarantee; only its
  own stores do. With a single tenant (or every request unsalted) the order is the pool's plain LRU.
* Explicit shares add up to at most 1. The default share applies to every tenant not listed, so
  with many tenants the guarantees can add up to more than the pool: they are honoured first come
  (rule 3-4), never by evicting a tenant within its share.

Borrowing is first come: once the pool is full, a borrower keeps its borrowed slots until a tenant
under its share reclaims them (rule 2) or its own stores recycle them (rule 1). LMCache's
``IsolatedLRU`` (multiprocess mode, ``/quota``) is the other design: hard per-salt limits, a salt
without a quota keeps nothing, eviction by a background loop at a watermark; lmtier's shares are
guarantees with borrowing, enforced at reservation time (no background thread, no over-commit).

Cost: with budgets off the pool does none of this. On: a dict update per reserve / commit /
acquire / release / free, and an eviction scans the borrowers (``O(number of borrowers)``);
measured in benchmarks/RESULTS.md ("tenant budgets").

Shared tiers: :class:`SharedBudgets` (``remote_tenant_share(s)`` + ``remote_tenant_capacity``) is the
same policy in bytes of records, enforced in the Redis/Valkey server by
:mod:`lmtier.tiers.redis.budget`.

Not thread-safe: the pool calls every method under its lock. Imports no torch.
"""

from __future__ import annotations

import collections
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_TENANT",
    "SharedBudgets",
    "TenantShares",
    "TenantLedger",
    "check_tenant",
    "tenant_id",
    "parse_tenant_shares",
]

DEFAULT_TENANT = "default"
"""The tenant of requests without a ``cache_salt``."""

TENANT_ID_HEX = 16
"""Hex digits of a tenant id (a 64-bit BLAKE2b digest of the salt)."""

_ID_RE = re.compile(r"^(default|[0-9a-f]{16})$")


def tenant_id(cache_salt: Any) -> str:
    """The tenant of a request scope: :data:`DEFAULT_TENANT` without a salt, else 16 hex digits of
    ``BLAKE2b-64(salt, person="lmtier-tenant")``.

    Args:
        cache_salt: a :class:`lmtier.keys.KeyScope` (its ``cache_salt``; LoRA and multimodal fields
            do not change the tenant), a ``str`` (UTF-8) or ``bytes`` salt, or ``None``. ``""`` and
            ``b""`` mean no salt, as in :func:`lmtier.keys.chunk_keys`.

    Raises:
        TypeError: another type.
    """
    from lmtier.keys import KeyScope

    salt = cache_salt.cache_salt if isinstance(cache_salt, KeyScope) else cache_salt
    if salt is None:
        return DEFAULT_TENANT
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    if not isinstance(salt, bytes):
        raise TypeError(f"cache_salt must be a KeyScope, str, bytes or None, got {type(salt).__name__}")
    if not salt:
        return DEFAULT_TENANT
    return hashlib.blake2b(salt, digest_size=TENANT_ID_HEX // 2, person=b"lmtier-tenant").hexdigest()


@dataclass(frozen=True)
class TenantShares:
    """Configured guaranteed shares of the CPU pool (see the module doc for the policy).

    Attributes:
        default_share: fraction ``[0, 1]`` of the pool guaranteed to each tenant not in ``shares``
            (``cpu_tenant_share``; 0 when only ``cpu_tenant_shares`` is set).
        shares: ``((tenant id, fraction), ...)`` (``cpu_tenant_shares``), ids unique, fractions
            summing to at most 1.
    """

    default_share: float = 0.0
    shares: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for t, f in ((None, self.default_share), *self.shares):
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
                raise ValueError(f"TenantShares: share of {t or 'other tenants'} must be in [0, 1], got {f!r}")
        ids = [t for t, _ in self.shares]
        if len(set(ids)) != len(ids) or not all(_ID_RE.match(t) for t in ids):
            raise ValueError(f"TenantShares: tenant ids must be unique, 'default' or {TENANT_ID_HEX} hex digits: {ids}")
        if sum(f for _, f in self.shares) > 1.0 + 1e-9:
            raise ValueError(f"TenantShares: explicit shares add up to more than 1: {self.shares}")

    def share_of(self, tenant: str) -> float:
        """The guaranteed fraction of ``tenant``."""
        for t, f in self.shares:
            if t == tenant:
                return f
        return self.default_share

    def to_text(self) -> str:
        """``cpu_tenant_shares``' text form (``"id=fraction,..."``; ``""`` when empty)."""
        return ",".join(f"{t}={f:g}" for t, f in self.shares)


def check_tenant(tenant: str) -> str:
    """``tenant`` if it is a tenant id (:data:`DEFAULT_TENANT` or 16 hex digits, the form of
    :func:`tenant_id`); shared tiers put it into key names, so nothing else is accepted.

    Raises:
        ValueError: another string (or not a string).
    """
    if not isinstance(tenant, str) or not _ID_RE.match(tenant):
        raise ValueError(f"tenant must be 'default' or {TENANT_ID_HEX} hex digits (tenant_id(salt)), got {tenant!r}")
    return tenant


@dataclass(frozen=True)
class SharedBudgets:
    """Per-tenant budgets of a shared tier (Redis/Valkey: :mod:`lmtier.tiers.redis.budget`), the
    same policy as the CPU pool's (the module doc) in bytes of stored records.

    Attributes:
        shares: the guaranteed fractions (``remote_tenant_share`` / ``remote_tenant_shares``).
        capacity_bytes: the bytes of records all tenants together may keep in the shared tier
            (``remote_tenant_capacity``, GiB in the config); the shares are fractions of it.
    """

    shares: TenantShares
    capacity_bytes: int

    def __post_init__(self) -> None:
        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 1:
            raise ValueError(f"SharedBudgets: capacity_bytes must be a positive int, got {self.capacity_bytes!r}")

    def guaranteed_bytes(self, tenant: str) -> int:
        """``floor(share(tenant) * capacity_bytes)``."""
        return int(self.shares.share_of(tenant) * self.capacity_bytes)

    def fingerprint(self) -> str:
        """The settings as one line (nodes sharing a store compare it at start-up)."""
        return f"capacity={self.capacity_bytes};share={self.shares.default_share:g};shares={self.shares.to_text()}"


def parse_tenant_shares(
    key: str, text: str | None, default_share: float | None, *, default_key: str = "cpu_tenant_share"
) -> TenantShares | None:
    """Build :class:`TenantShares` from ``cpu_tenant_shares`` (``text``: comma-separated
    ``tenant_id=fraction`` items, ids from :func:`tenant_id` or ``default``) and
    ``cpu_tenant_share`` (``default_share``) — or the ``remote_tenant_*`` pair (``key`` and
    ``default_key`` name the keys). Returns None (budgets off) when both are unset.

    Raises:
        lmtier.config.ConfigError: a malformed item, an unknown id form, a fraction outside
            ``[0, 1]``, an id listed twice, fractions adding up to more than 1 (the message names
            ``key`` or ``default_key``).
    """
    from lmtier.config_schema import config_error

    if default_share is not None and not (math.isfinite(default_share) and 0.0 <= default_share <= 1.0):
        raise config_error(default_key, default_share, "must be a fraction in [0, 1]")
    if text is None or not text.strip():
        return None if default_share is None else TenantShares(float(default_share))
    items: list[tuple[str, float]] = []
    for part in text.split(","):
        tid, sep, frac = part.strip().partition("=")
        tid = tid.strip().lower()
        if not sep or not _ID_RE.match(tid):
            raise config_error(
                key, text, f"item {part.strip()!r}: expected tenant_id=fraction, tenant_id 'default' or 16 hex digits"
            )
        try:
            f = float(frac)
        except ValueError:
            raise config_error(key, text, f"item {part.strip()!r}: {frac.strip()!r} is not a number") from None
        if not (math.isfinite(f) and 0.0 <= f <= 1.0):
            raise config_error(key, text, f"item {part.strip()!r}: the fraction must be in [0, 1]")
        if any(t == tid for t, _ in items):
            raise config_error(key, text, f"tenant {tid} listed twice")
        items.append((tid, f))
    if sum(f for _, f in items) > 1.0 + 1e-9:
        raise config_error(key, text, "the shares add up to more than 1 (the whole pool / capacity)")
    return TenantShares(0.0 if default_share is None else float(default_share), tuple(items))


_COUNTERS = ("commits", "evicted_by_self", "evicted_by_others", "evicted_others", "denied")


class TenantLedger:
    """The CPU pool's per-tenant bookkeeping (slot owners, per-tenant LRU lists, held slots) and
    victim choice (the module doc's rules 1-4). Every method runs under the pool's lock.

    Args:
        shares: the configured shares.
        num_slots: slots of the pool.
        slot_bytes: bytes per slot (for ``held_bytes`` / ``guaranteed_bytes`` in :meth:`stats`).
    """

    def __init__(self, shares: TenantShares, num_slots: int, slot_bytes: int) -> None:
        self.shares = shares
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.owner: list[str | None] = [None] * num_slots  # slot -> tenant
        self._stamp = [0] * num_slots  # slot -> when it last became evictable (global LRU order)
        self._tick = 0
        self.held: dict[str, int] = {}
        self._lru: dict[str, collections.OrderedDict[int, None]] = {}  # tenant -> evictable slots, LRU first
        self._over: set[str] = set()  # tenants holding more than their guarantee
        self._g: dict[str, int] = {}
        self.counters: dict[str, collections.Counter[str]] = {}

    def guarantee(self, tenant: str) -> int:
        """``g(tenant)`` in slots."""
        g = self._g.get(tenant)
        if g is None:
            g = self._g[tenant] = int(self.shares.share_of(tenant) * self.num_slots)
        return g

    def _count(self, tenant: str, name: str) -> None:
        c = self.counters.get(tenant)
        if c is None:
            c = self.counters[tenant] = collections.Counter()
        c[name] += 1

    def _set_held(self, tenant: str, n: int) -> None:
        if n:
            self.held[tenant] = n
        else:
            self.held.pop(tenant, None)
        if n > self.guarantee(tenant):
            self._over.add(tenant)
        else:
            self._over.discard(tenant)

    def assign(self, idx: int, tenant: str) -> None:
        """Slot ``idx`` now holds a chunk of ``tenant`` being written (its previous owner, if the
        slot was reused straight from eviction, gives it up)."""
        old = self.owner[idx]
        if old is not None:
            self._set_held(old, self.held.get(old, 0) - 1)
        self.owner[idx] = tenant
        self._set_held(tenant, self.held.get(tenant, 0) + 1)
        if tenant not in self.counters:
            self.counters[tenant] = collections.Counter()

    def free(self, idx: int) -> None:
        """Slot ``idx`` became free."""
        old = self.owner[idx]
        if old is not None:
            self.owner[idx] = None
            self._set_held(old, self.held.get(old, 0) - 1)

    def committed(self, idx: int) -> None:
        """Slot ``idx``'s chunk was committed (and becomes evictable)."""
        tenant = self.owner[idx]
        assert tenant is not None
        self._count(tenant, "commits")
        self.evictable(idx)

    def evictable(self, idx: int) -> None:
        """Slot ``idx`` became evictable (committed, last reader gone): most recently used."""
        tenant = self.owner[idx]
        assert tenant is not None
        self._tick += 1
        self._stamp[idx] = self._tick
        lru = self._lru.get(tenant)
        if lru is None:
            lru = self._lru[tenant] = collections.OrderedDict()
        lru[idx] = None

    def pinned(self, idx: int) -> None:
        """Slot ``idx`` is no longer evictable (pinned by a reader, deleted)."""
        tenant = self.owner[idx]
        if tenant is not None:
            lru = self._lru.get(tenant)
            if lru is not None:
                lru.pop(idx, None)

    def victim(self, writer: str) -> int | None:
        """The slot to evict for ``writer`` (rules 1-4), removed from its tenant's LRU list; None
        when no chunk may be evicted for ``writer`` (counted as ``denied``). The caller removes it
        from the pool's own LRU and then calls :meth:`evicted`."""
        own = self._lru.get(writer)
        if own and self.held.get(writer, 0) >= self.guarantee(writer):
            return own.popitem(last=False)[0]
        best, best_stamp = None, 0
        for t in self._over:
            lru = self._lru.get(t)
            if t == writer or not lru:
                continue
            idx = next(iter(lru))
            if best is None or self._stamp[idx] < best_stamp:
                best, best_stamp = idx, self._stamp[idx]
        if best is not None:
            lru = self._lru[self.owner[best]]  # type: ignore[index]
            del lru[best]
            return best
        if own:
            return own.popitem(last=False)[0]
        self._count(writer, "denied")
        return None

    def evicted(self, idx: int, writer: str) -> None:
        """Slot ``idx``'s chunk was evicted for ``writer`` (counters only; the slot is then freed
        or reassigned by :meth:`assign`)."""
        tenant = self.owner[idx]
        assert tenant is not None
        if tenant == writer:
            self._count(tenant, "evicted_by_self")
        else:
            self._count(tenant, "evicted_by_others")
            self._count(writer, "evicted_others")

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tenant (every tenant seen): ``held_bytes``, ``guaranteed_bytes``, and the cumulative
        counts ``commits`` (chunks committed: stores and promotions), ``evicted_by_self`` /
        ``evicted_by_others`` (its chunks evicted for its own / another tenant's store),
        ``evicted_others`` (others' chunks evicted for its stores), ``denied`` (reservations refused:
        nothing it may evict)."""
        out: dict[str, dict[str, int]] = {}
        for t in set(self.counters) | set(self.held):
            c = self.counters.get(t, collections.Counter())
            row = {k: int(c[k]) for k in _COUNTERS}
            row["held_bytes"] = self.held.get(t, 0) * self.slot_bytes
            row["guaranteed_bytes"] = self.guarantee(t) * self.slot_bytes
            out[t] = row
        return out
