"""The tier manager's writes to the lower tiers: write-through (:meth:`TierWrites.publish`: CPU pool
to disk and remote, queued) and write-back (CPU-pool victims to disk, :meth:`TierWrites.no_write_back`).

:class:`TierWrites` is a mixin of :class:`lmtier.manager.TierManager`, which owns the state it uses.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lmtier.events import IndexEventHub, IndexEventKind
from lmtier.tiers.base import Eviction, Tier
from lmtier.tiers.cpu import CPUPool
from lmtier.tiers.tenants import DEFAULT_TENANT

__all__ = ["TierWrites"]


class _ThreadFlag(threading.local):
    """A per-thread boolean ``on`` (False in every thread until set there)."""

    on = False


class TierWrites:
    """Write-through and write-back of :class:`~lmtier.manager.TierManager` (a mixin: it uses the
    manager's tiers ``cpu``, ``disk``, ``remote``, its queues ``_store_pool`` / ``_store_slots`` and
    ``_remote_pool`` / ``_remote_slots``, ``_remote_tenants``, ``_no_write_back``, ``_events``,
    ``counters`` / ``_counter_lock`` and its helpers ``_check_open``, ``_count``, ``_safe``,
    ``_enter`` and ``_leave``)."""

    cpu: CPUPool | None
    disk: Tier | None
    remote: Tier | None
    counters: collections.Counter[str]
    _counter_lock: threading.Lock
    _remote_tenants: bool
    _store_pool: ThreadPoolExecutor
    _store_slots: threading.BoundedSemaphore
    _remote_pool: ThreadPoolExecutor | None
    _remote_slots: threading.BoundedSemaphore
    _no_write_back: _ThreadFlag
    _events: IndexEventHub
    _check_open: Callable[[], None]
    _count: Callable[..., None]
    _safe: Callable[..., Any]
    _enter: Callable[[], None]
    _leave: Callable[[], None]

    def publish(self, key: bytes, *, tenant: str = DEFAULT_TENANT) -> None:
        """Write a chunk the caller committed into the CPU pool through to disk and remote, asynchronously.

        For callers that fill reserved pool slots themselves (the vLLM connector gathers KV straight
        into a slot). The disk copy makes the chunk survive a restart without waiting for eviction;
        both writes are best-effort (dropped and counted when their queues are full). A queued write
        does not pin the chunk: one evicted before its write ran is skipped (counted), so the CPU
        pool keeps admitting new chunks when the lower tiers fall behind. Publishes no index event
        (:meth:`~lmtier.manager.TierManager.commit` commits, publishes ``STORED`` and calls this).
        ``tenant``: the chunk's tenant in a remote tier with budgets. A tier that takes positions
        (:meth:`~lmtier.tiers.base.Tier.takes_position`) gets the one the chunk's slot holds
        (named at ``cpu.reserve``).
        """
        self._check_open()
        if self.disk is not None and self.cpu is not None:
            self._queue_write("disk", self._store_pool, self._store_slots, key, tenant)
        self._send_remote(key, tenant)

    def _put_kw(self, tier: Tier, tenant: str, position: int | None) -> dict[str, Any]:
        """The keyword arguments of ``tier.put`` (``tier``: this manager's disk or remote tier) for a
        chunk of ``tenant`` at ``position`` (tokens, or None: unknown): ``tenant=`` for the remote tier
        with budgets, ``position=`` for a tier that :meth:`~lmtier.tiers.base.Tier.takes_position`;
        nothing else, so tiers without either keep the plain two-argument ``put``."""
        kw: dict[str, Any] = {}
        if self._remote_tenants and tier is self.remote:
            kw["tenant"] = tenant
        if tier.takes_position():
            kw["position"] = position
        return kw

    def _send_remote(self, key: bytes, tenant: str = DEFAULT_TENANT) -> None:
        """Queue the chunk's write-through to the remote tier (no-op without one)."""
        if self.remote is not None and self._remote_pool is not None:
            self._queue_write("remote", self._remote_pool, self._remote_slots, key, tenant)

    def _queue_write(
        self, name: str, pool: ThreadPoolExecutor, slots: threading.BoundedSemaphore, key: bytes, tenant: str
    ) -> None:
        """Submit :meth:`_write_job` for tier ``name`` ("disk" / "remote") unless its queue is full
        (counted ``<name>_dropped_queue_full``)."""
        if not slots.acquire(blocking=False):
            self._count(f"{name}_dropped_queue_full")
            return
        self._enter()
        try:
            pool.submit(self._write_job, name, slots, key, tenant)
        except BaseException:
            slots.release()
            self._leave()
            raise

    def _write_job(self, name: str, slots: threading.BoundedSemaphore, key: bytes, tenant: str) -> None:
        """Copy the chunk from the CPU pool (pinned while the tier reads it) to the disk or remote
        tier, with the position its slot holds (:attr:`Slot.position <lmtier.tiers.cpu.Slot.position>`);
        skipped (``<name>_skipped_evicted``) when it left the pool first, and on disk when the
        disk already holds it. Counts ``stored_<name>`` or ``<name>_put_failures``."""
        try:
            tier = self.disk if name == "disk" else self.remote
            assert self.cpu is not None and tier is not None
            slot = self.cpu.acquire(key)
            if slot is None:
                self._count(f"{name}_skipped_evicted")
                return
            try:
                if name == "disk" and self._safe(tier.contains, key, default=False):
                    return
                kw = self._put_kw(tier, tenant, slot.position)
                ok = bool(self._safe(tier.put, key, slot.memoryview(), default=False, **kw))
            finally:
                self.cpu.release(slot)
            self._count(f"stored_{name}" if ok else f"{name}_put_failures")
        finally:
            slots.release()
            self._leave()

    def _write_back(self, key: bytes, view: torch.Tensor, position: int | None) -> bool:
        """Persist a CPU chunk (``view``: ``torch.uint8`` CPU ``[nbytes]``; ``position``: its
        position, tokens, or None) to disk unless it is there already (or, inside
        :meth:`no_write_back`, count it skipped). Returns whether the disk holds it afterwards."""
        disk = self.disk
        if disk is None:
            return False
        if self._safe(disk.contains, key, default=False):
            return True
        if self._no_write_back.on:
            self._count("write_back_skipped")
            return False
        kw = self._put_kw(disk, DEFAULT_TENANT, position)
        ok = bool(self._safe(disk.put, key, memoryview(view.numpy()), default=False, **kw))
        self._count("written_back" if ok else "write_back_failures")
        return ok

    @contextlib.contextmanager
    def no_write_back(self) -> Iterator[None]:
        """Within the block, CPU-pool evictions that this thread causes (a ``cpu.reserve`` that takes
        an LRU victim's slot) never write the victim to disk here: a victim the disk holds already
        stays there (``EVICTED`` names ``"disk"``), one it does not is dropped from the CPU tier only
        (``counters["write_back_skipped"]``; ``EVICTED`` with no tier).

        For latency paths whose chunks reach the disk by :meth:`publish`'s asynchronous write-through
        (the vLLM connector's stores in the engine step and its load threads): a synchronous
        write-back there costs a disk write — and with ``local_disk_serde: cachegen`` an encode — per
        victim inside the caller's step. Nestable; per thread.
        """
        prev = self._no_write_back.on
        self._no_write_back.on = True
        try:
            yield
        finally:
            self._no_write_back.on = prev

    def _on_cpu_evicted(self, ev: Eviction) -> None:
        """CPU pool eviction listener: write each victim back to disk with its position (its payload
        is readable until this returns; not inside :meth:`no_write_back`), then publish ``EVICTED``."""
        payloads = ev.payloads if ev.payloads is not None else (None,) * len(ev.keys)
        positions = ev.positions if ev.positions is not None else (None,) * len(ev.keys)
        for key, view, position in zip(ev.keys, payloads, positions):
            on_disk = view is not None and self._write_back(key, view, position)
            self._events.publish(IndexEventKind.EVICTED, key, "disk" if on_disk else None)

    def _on_disk_evicted(self, ev: Eviction) -> None:
        """Disk tier eviction listener: publish ``DISK_EVICTED`` per key."""
        for key in ev.keys:
            self._events.publish(IndexEventKind.DISK_EVICTED, key, None)

    def write_events(self, tier: str) -> dict[str, int]:
        """The write-through counts of the ``"disk"`` or ``"remote"`` tier (cumulative):
        ``writes_dropped`` (queue full) and ``writes_skipped`` (the chunk left the CPU pool without
        reaching the tier). See :data:`lmtier.tiers.base.TIER_EVENTS`. ValueError: another name."""
        names = {
            "disk": (("disk_dropped_queue_full",), ("disk_skipped_evicted", "write_back_skipped")),
            "remote": (("remote_dropped_queue_full",), ("remote_skipped_evicted",)),
        }.get(tier)
        if names is None:
            raise ValueError(f"TierManager.write_events: tier must be 'disk' or 'remote', got {tier!r}")
        with self._counter_lock:
            return {
                "writes_dropped": sum(self.counters[n] for n in names[0]),
                "writes_skipped": sum(self.counters[n] for n in names[1]),
            }
