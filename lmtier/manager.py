"""The tier manager: lmtier's library API over the CPU pool, local disk, P2P and remote tiers.

:class:`TierManager` looks chunks up (longest cached prefix, fastest tier first), stores them
asynchronously (CPU pool, then write-back to disk and write-through to remote: :mod:`lmtier.writes`)
and retrieves them with promotion into the CPU pool; it publishes index events
(:mod:`lmtier.events`) to listeners.
Policies (write-back, write-through, promotion cost, failures as misses): docs/ARCHITECTURE.md.
The Hugging Face transformers helper (:class:`lmtier.hf.KVCacheStore`) lives in :mod:`lmtier.hf`.
Logging: ``logging.getLogger("lmtier.manager")``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from lmtier.config import LMTierConfig
from lmtier.events import IndexEventHub, IndexEventKind, IndexListener
from lmtier.keys import KEY_BYTES, Namespace
from lmtier.tiers.base import Tier, check_position
from lmtier.tiers.cpu import CPUPool, Slot, _as_byte_dest, as_byte_source
from lmtier.tiers.disk import background_priority
from lmtier.tiers.factory import DiskFactory, RemoteFactory, build_tiers, default_disk_factory, default_remote_factory
from lmtier.tiers.loadmeter import LoadMeter, read_path
from lmtier.tiers.tenants import DEFAULT_TENANT
from lmtier.writes import TierWrites, _ThreadFlag

if TYPE_CHECKING:
    from lmtier.tiers.p2p.tier import P2PTier


__all__ = ["LoadMeter", "TierManager"]

log = logging.getLogger("lmtier.manager")


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _stored(where: Future) -> Future:
    """``Future[bool]`` of a ``Future[str | None]`` from :meth:`TierManager.store_in`: stored or not.
    An exception or a cancellation of ``where`` is passed on; cancelling the result cancels
    ``where`` (a store not yet started does not run)."""
    out: Future = Future()

    def forward(f: Future) -> None:
        try:
            if f.cancelled():
                out.cancel()
            elif (e := f.exception()) is not None:
                out.set_exception(e)
            else:
                out.set_result(f.result() is not None)
        except InvalidStateError:  # the caller cancelled ``out`` meanwhile
            pass

    where.add_done_callback(forward)
    out.add_done_callback(lambda o: where.cancel() if o.cancelled() else None)
    return out


class TierManager(TierWrites):
    """Lookup, asynchronous store and retrieve-with-promotion over up to three tiers.

    Args:
        cpu: tier 1 pool, or ``None`` (no CPU caching: stores go to disk/remote directly).
        disk: tier 2 (``Tier``) or ``None``.
        remote: tier 3 (``Tier``; one ``contains_many`` call per lookup when it
            :meth:`~lmtier.tiers.base.Tier.batches_contains`) or ``None``.
        store_threads: threads running stores (CPU copy + commit, write-back on eviction).
        max_pending_stores: stores queued or running at most; beyond it ``store`` waits
            ``timeout_s`` and then drops the store (its future resolves ``False``).
        p2p: P2P sharing (:class:`lmtier.tiers.p2p.tier.P2PTier`), consulted after disk and before
            remote; with ``cpu`` it publishes the pool (an index listener), without it lookups only.
        remote_threads: threads sending chunks to the remote tier.
        max_pending_remote: remote sends queued at most; more are dropped (write-through is
            best-effort).

    All public methods are thread-safe. The manager registers eviction listeners on ``cpu``
    (write-back to ``disk``, ``EVICTED`` events) and ``disk`` (``DISK_EVICTED`` events); they are
    removed by :meth:`close`.
    """

    def __init__(
        self,
        *,
        cpu: CPUPool | None,
        disk: Tier | None = None,
        remote: Tier | None = None,
        p2p: P2PTier | None = None,
        store_threads: int = 2,
        max_pending_stores: int = 64,
        remote_threads: int = 2,
        max_pending_remote: int = 16,
    ) -> None:
        if cpu is None and disk is None and remote is None and p2p is None:
            raise ValueError("TierManager: at least one tier is required")
        if store_threads < 1 or max_pending_stores < 1 or remote_threads < 1 or max_pending_remote < 1:
            raise ValueError("TierManager: thread counts and queue bounds must be >= 1")
        self.cpu = cpu
        self.disk = disk
        self.remote = remote
        self.p2p = p2p  # P2P sharing (lmtier.tiers.p2p): consulted after disk, before remote
        # Per-tenant budgets of the remote tier: its put takes the chunk's tenant (tiers without
        # budgets keep the plain two-argument put).
        self._remote_tenants = remote is not None and remote.tenant_budgets is not None
        self.counters: collections.Counter[str] = collections.Counter()
        self._tenant_counters: dict[str, collections.Counter[str]] = {}
        self._counter_lock = threading.Lock()
        self._store_slots = threading.BoundedSemaphore(max_pending_stores)
        self._remote_slots = threading.BoundedSemaphore(max_pending_remote)
        # Write-back / write-through work is background work: run it at the lowest CPU priority so
        # it does not take cores from the forward pass on small hosts (measured: cold-request
        # overhead on 2 cores, benchmarks/RESULTS.md).
        self._store_pool = ThreadPoolExecutor(
            store_threads, thread_name_prefix="lmtier-store", initializer=background_priority
        )
        self._remote_pool = (
            ThreadPoolExecutor(remote_threads, thread_name_prefix="lmtier-remote", initializer=background_priority)
            if remote
            else None
        )
        self._inflight = 0
        self._idle = threading.Condition()
        self._no_write_back = _ThreadFlag()  # .on: this thread is inside no_write_back()
        self._closed = False
        self._events = IndexEventHub(lambda: self._count("listener_errors"))
        self._load_meter: LoadMeter | None = None
        if p2p is not None and cpu is not None:  # the P2P tier publishes what enters / leaves the pool
            self._events.add(p2p.on_index_event)
        if cpu is not None:
            cpu.add_eviction_listener(self._on_cpu_evicted)
            if remote is not None:  # a tier that can move chunks straight to/from its slots does
                remote.attach_pool(cpu)
        if disk is not None:
            disk.add_eviction_listener(self._on_disk_evicted)

    @classmethod
    def from_config(
        cls,
        config: LMTierConfig,
        namespace: Namespace,
        *,
        gpu_id: int = 0,
        arena: Any = None,
        disk_factory: DiskFactory = default_disk_factory,
        remote_factory: RemoteFactory = default_remote_factory,
        encode_device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> TierManager:
        """Build the tiers ``config`` enables for chunks of ``namespace``.

        Args:
            config: the loaded configuration; ``config.chunk_size`` must equal ``namespace.chunk_size``.
            namespace: gives the chunk size in bytes (``namespace.chunk_bytes``) for CPU slots.
            gpu_id: this process's GPU (selects the disk path with ``local_disk_path_sharding: by_gpu``).
            arena: optional CPU pool arena (see :class:`CPUPool`).
            disk_factory, remote_factory: build the disk/remote tiers (tests, custom tiers). A tier
                whose serde (``local_disk_serde`` / ``remote_serde``) is ``cachegen`` is wrapped in
                :class:`lmtier.tiers.codec.CodecTier` (level ``config.codec_level``, the namespace's
                chunk geometry and dtype) after the factory built it. With ``remote_auth_key`` the
                remote tier is first wrapped in :class:`lmtier.tiers.seal.tier.SealedTier` (so
                ``CodecTier -> SealedTier -> remote``: compress, then seal).
            encode_device: None (default: codec tiers encode host chunks on the CPU) or the CUDA
                device (``torch.device("cuda", n)`` / ``"cuda:n"``) they encode them on — the vLLM
                worker's GPU; given to every :class:`lmtier.tiers.codec.CodecTier` built here, which
                touches it only at its first put. Never set it in a process that must not use CUDA
                (the scheduler's).
            **kwargs: passed to :class:`TierManager` (thread counts, queue bounds).

        Raises:
            ConfigError: inconsistent chunk size, CPU pool smaller than one chunk, a ``cachegen`` serde
                on a cache the codec cannot take (dtype other than bf16/fp16, MLA, a lossy level with
                a head size that is not a power of two).
        """
        tiers = build_tiers(
            config,
            namespace,
            gpu_id=gpu_id,
            arena=arena,
            disk_factory=disk_factory,
            remote_factory=remote_factory,
            encode_device=encode_device,
        )
        config.log_effective()
        return cls(**tiers._asdict(), **kwargs)

    # ---- lookup ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tier names (``"cpu"``, ``"disk"``, ``"p2p"``, ``"remote"``) of the longest cached prefix of ``keys``.

        ``len(result)`` is the number of leading chunks that can be retrieved now. Lower-tier
        failures count as misses. Note that a retrieve may still miss (eviction in between).
        """
        self._check_open()
        found: list[str] = []
        for key in keys:
            if self.cpu is not None and self.cpu.contains(key):
                found.append("cpu")
            elif self.disk is not None and self._safe(self.disk.contains, key, default=False):
                found.append("disk")
            else:
                break
        rest = list(keys[len(found) :])
        if self.p2p is not None and rest:  # one directory round trip for all remaining keys
            flags = self._safe(self.p2p.contains_many, rest, default=None) or [False] * len(rest)
            n = next((i for i, f in enumerate(flags) if not f), len(flags))
            found += ["p2p"] * n
            rest = rest[n:]
        if self.remote is None or not rest:
            return found
        if self.remote.batches_contains():
            flags = self._safe(self.remote.contains_many, rest, default=None) or [False] * len(rest)
        else:
            flags = []
            for key in rest:
                flags.append(bool(self._safe(self.remote.contains, key, default=False)))
                if not flags[-1]:
                    break
        for f in flags:
            if not f:
                break
            found.append("remote")
        return found

    # ---- store -------------------------------------------------------------------------------

    def store(
        self,
        key: bytes,
        data: Any,
        *,
        timeout_s: float | None = 0.0,
        tenant: str = DEFAULT_TENANT,
        position: int | None = None,
    ) -> Future:
        """Store one chunk asynchronously: :meth:`store_in`, told as stored or not.

        Returns:
            ``Future[bool]``: True once the chunk is stored in (or already was in) a tier; False if
            it was dropped (queue full, every slot pinned and no lower tier, tier failure).

        Raises:
            as :meth:`store_in`.
        """
        return _stored(self.store_in(key, data, timeout_s=timeout_s, tenant=tenant, position=position))

    def store_in(
        self,
        key: bytes,
        data: Any,
        *,
        timeout_s: float | None = 0.0,
        tenant: str = DEFAULT_TENANT,
        position: int | None = None,
    ) -> Future:
        """Store one chunk asynchronously and tell which tier took it.

        Args:
            key: 32-byte chunk key (:func:`lmtier.keys.chunk_keys`).
            data: the chunk bytes: a contiguous torch tensor (any dtype, CPU or CUDA; viewed as
                bytes) or a bytes-like object; ``1..cpu.chunk_bytes`` bytes. It must stay
                unchanged until the returned future completes.
            timeout_s: how long to wait for room in the store queue: ``0`` (default) never waits
                and drops the store when the queue is full; ``None`` waits as long as needed.
            tenant: the chunk's tenant (:func:`lmtier.tiers.tenants.tenant_id`) in the CPU pool and
                in a remote tier with budgets.
            position: the chunk's position (its first token's in its token sequence, ``chunk index
                * chunk_size`` tokens; ``int >= 0``) or None (unknown): kept with it in the CPU pool
                and passed to the disk / remote tiers that take it
                (:meth:`~lmtier.tiers.base.Tier.takes_position`; those refuse a chunk of unknown
                position) when it is written there.

        Returns:
            ``Future[str | None]``: the tier the chunk is in once stored: ``"cpu"`` (the pool took
            it, or held it already), else ``"disk"`` (written through to the disk tier), else
            ``"remote"``; None if it was dropped (queue full, every slot pinned and no lower tier,
            tier failure). The tier named is the one its ``STORED`` index event names (none is
            published for a chunk the pool held already). Cancelling the future before the store
            started drops the store.

        Raises:
            TypeError / ValueError: bad key, data or position (synchronously). RuntimeError: closed.
        """
        self._check_open()
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise TypeError(f"key must be {KEY_BYTES} bytes")
        check_position(position, "TierManager.store")
        src = as_byte_source(data)
        n = int(src.shape[0])
        if n == 0 or (self.cpu is not None and n > self.cpu.chunk_bytes):
            limit = self.cpu.chunk_bytes if self.cpu is not None else "any"
            raise ValueError(f"TierManager.store_in: data must be 1..{limit} bytes, got {n}")
        if self.cpu is not None and self.cpu.is_present(key):
            self._count("store_present")
            return _done("cpu")
        if timeout_s is None:
            room = self._store_slots.acquire()
        elif timeout_s <= 0:
            room = self._store_slots.acquire(blocking=False)
        else:
            room = self._store_slots.acquire(timeout=timeout_s)
        if not room:
            self._count("store_dropped_queue_full")
            return _done(None)
        self._enter()
        try:
            fut = self._store_pool.submit(self._store_job, key, src, data, tenant, position)
        except BaseException:
            self._store_slots.release()
            self._leave()
            raise
        fut.add_done_callback(self._cancelled_store)
        return fut

    def _cancelled_store(self, fut: Future) -> None:
        """A store cancelled before it ran: its queue room and in-flight count, which its job would
        have given back."""
        if fut.cancelled():
            self._store_slots.release()
            self._leave()

    def _store_job(self, key: bytes, src: Any, _keepalive: Any, tenant: str, position: int | None) -> str | None:
        try:
            return self._store_now(key, src, tenant, position)
        except Exception:
            log.exception("store of chunk %s failed", key.hex())
            self._count("store_errors")
            return None
        finally:
            self._store_slots.release()
            self._leave()

    def _store_now(self, key: bytes, src: Any, tenant: str, position: int | None) -> str | None:
        n = int(src.shape[0])
        if self.cpu is not None:
            slot = self.cpu.reserve(key, tenant=tenant, position=position)
            if slot is not None:
                try:
                    if isinstance(src, torch.Tensor):
                        slot.view[:n].copy_(src)
                    else:
                        slot.view[:n].numpy()[:] = src
                except BaseException:
                    self.cpu.abort(slot)
                    raise
                self.cpu.commit(slot, n)
                self._count("stored_cpu")
                self._events.publish(IndexEventKind.STORED, key, "cpu")
                self._send_remote(key, tenant)
                return "cpu"
            if self.cpu.is_present(key):
                self._count("store_present")
                return "cpu"
            self._count("cpu_backpressure")
        # No CPU pool, or every slot pinned: write through to the lower tiers now.
        where: str | None = None
        payload = src if isinstance(src, torch.Tensor) else memoryview(src)
        if self.disk is not None:
            kw = self._put_kw(self.disk, tenant, position)
            ok = bool(self._safe(self.disk.put, key, payload, default=False, **kw))
            self._count("stored_disk" if ok else "disk_put_failures")
            if ok:
                where = "disk"
                self._events.publish(IndexEventKind.STORED, key, "disk")
        if self.remote is not None:
            kw = self._put_kw(self.remote, tenant, position)
            r = bool(self._safe(self.remote.put, key, payload, default=False, **kw))
            self._count("stored_remote" if r else "remote_put_failures")
            if r and where is None:
                where = "remote"
                self._events.publish(IndexEventKind.STORED, key, "remote")
        if where is None:
            self._count("store_dropped")
        return where

    def commit(self, slot: Slot, nbytes: int, *, promoted: bool = False) -> None:
        """Commit a CPU-pool write slot the caller filled, publish ``STORED`` (tier ``"cpu"``), and
        either write the chunk through to disk/remote (:meth:`publish`; a new chunk) or count a
        promotion (``promoted=True``: it came from a lower tier, which holds it already).

        For callers that fill reserved pool slots themselves (the vLLM connector gathers KV straight
        into a slot, or reads a disk hit into one).

        Args:
            slot: a write handle from ``manager.cpu.reserve``.
            nbytes: bytes written, ``1..cpu.chunk_bytes``.

        Raises:
            RuntimeError: no CPU pool, closed manager, or a handle that is not an open write handle
                (see :meth:`CPUPool.commit`). ValueError: bad ``nbytes`` (the slot stays reserved).
        """
        self._check_open()
        if self.cpu is None:
            raise RuntimeError("TierManager.commit: there is no CPU pool")
        self.cpu.commit(slot, nbytes)
        self._events.publish(IndexEventKind.STORED, slot.key, "cpu")
        if promoted:
            self._count("promotions")
        else:
            self.publish(slot.key, tenant=slot.tenant)

    # ---- index events ------------------------------------------------------------------------

    def add_listener(self, fn: IndexListener) -> None:
        """Call ``fn(event)`` (:class:`lmtier.events.IndexEvent`) for every later index change:
        synchronously, in the thread where the change happened, after it happened (``STORED``: once
        the chunk is visible to :meth:`lookup`). ``fn`` must be quick and thread-safe; its
        exceptions are logged and counted (``counters["listener_errors"]``), never raised."""
        self._events.add(fn)

    def remove_listener(self, fn: IndexListener) -> None:
        """Stop calling ``fn`` (a no-op if it is not registered)."""
        self._events.remove(fn)

    def set_load_meter(self, meter: LoadMeter | None) -> None:
        """Time every lower-tier read of :meth:`fetch_lower_many` with ``meter`` from now on (None:
        stop). The vLLM connector's worker measures its tiers' load bandwidth this way."""
        self._load_meter = meter

    # ---- retrieve ----------------------------------------------------------------------------

    def retrieve(self, key: bytes, out: Any, *, tenant: str | None = None, position: int | None = None) -> bool:
        """Fill ``out`` with chunk ``key`` from the fastest tier; see :meth:`retrieve_into`."""
        return self.retrieve_into(key, out, tenant=tenant, position=position) is not None

    def retrieve_into(
        self, key: bytes, out: Any, *, tenant: str | None = None, position: int | None = None
    ) -> int | None:
        """Copy chunk ``key`` into ``out`` from the fastest tier holding it.

        Args:
            key: 32-byte chunk key.
            out: writable destination of ``>=`` the chunk's bytes: a contiguous torch tensor (CPU,
                pinned or CUDA; any dtype, written as bytes) or a writable bytes-like object.
            tenant: the chunk's tenant id: hits / misses counted per tenant (:meth:`tenant_stats`),
                a promotion is its chunk in the pool (None: not counted, the default tenant's).
            position: the chunk's position (as for :meth:`store`), kept with a promotion in the
                pool, which writes it back to a disk tier that takes positions when it is evicted
                (None: unknown).

        Returns:
            the chunk's length in bytes, or ``None`` on a miss (nothing usable was written; the
            caller must recompute). Disk/remote hits are promoted into the CPU pool.

        Raises:
            ValueError: ``out`` is smaller than the chunk, or a bad ``position``. TypeError: bad
                ``out``. RuntimeError: closed.
        """
        self._check_open()
        check_position(position, "TierManager.retrieve_into")
        dst = _as_byte_dest(out)
        if self.cpu is not None:
            n = self.cpu.get_into(key, dst)
            if n is not None:
                self._count("hits_cpu", tenant=tenant)
                return n
        for tier in (self.disk, self.p2p, self.remote):
            if tier is None:
                continue
            n = self._retrieve_from(tier, key, out, dst, tenant or DEFAULT_TENANT, position)
            if n is not None:
                self._count(f"hits_{tier.name}", tenant=tenant)
                return n
        self._count("misses", tenant=tenant)
        return None

    def fetch_lower(self, key: bytes, out: Any, *, stream: Any = None) -> int | None:
        """Copy chunk ``key`` from the disk tier, else the remote tier, into ``out`` — no CPU pool.

        For callers that manage promotion themselves: the vLLM connector reads a disk hit straight
        into a CPU-pool slot it reserved (one copy instead of :meth:`retrieve_into`'s two) and
        commits the slot after it scattered the chunk (then calls ``count("promotions")``).
        Thread-safe; several calls may run at once (the disk tier reads them in parallel).

        Args:
            key: 32-byte chunk key.
            out: writable destination of ``>=`` the chunk's bytes (as for :meth:`retrieve_into`);
                a 4 KiB-aligned host buffer is read into directly (O_DIRECT).
            stream: CUDA ``out`` only, a ``torch.cuda.Stream`` passed to tiers that take one
                (the codec tiers, :class:`~lmtier.tiers.record_tier.RecordTier`: return once the
                record verified, the chunk's copy into ``out`` ordered before later work on ``stream``;
                its decode runs on the GPU); other tiers complete the copy before returning. None:
                ``out`` holds the chunk on return.

        Returns:
            the chunk's length in bytes, or ``None`` on a miss (nothing usable was written). A
            lower-tier error is a miss (logged, counted).

        Raises:
            TypeError: bad ``out``. RuntimeError: closed.
        """
        return self.fetch_lower_many([key], [out], stream=stream)[0]

    def fetch_lower_many(
        self, keys: Sequence[bytes], outs: Sequence[Any], *, stream: Any = None, skip: Sequence[str] = ()
    ) -> list[int | None]:
        """:meth:`fetch_lower` of several chunks: the disk tier reads each; those it misses come from
        the remote tier in one ``get_many_into`` (one batched client call where the tier has one:
        :meth:`~lmtier.tiers.base.Tier.batches_gets`). Returns per key the chunk's length or None.
        A miss whose ``out`` is a CPU-pool slot a tier left held (:meth:`CPUPool.hold
        <lmtier.tiers.cpu.CPUPool.hold>`: a transfer that outlived its timeout may still write into
        it) is not offered to later tiers: the caller must abort that slot.
        ``skip``: names of tiers not to read (``"disk"``, ``"p2p"``, ``"remote"``; the vLLM
        connector's load policy skips a tier slower than recompute when a later one holds a copy).

        Raises:
            TypeError: bad ``out``. ValueError: ``keys`` and ``outs`` differ in length.
            RuntimeError: closed.
        """
        self._check_open()
        if len(keys) != len(outs):
            raise ValueError(f"fetch_lower_many: {len(keys)} keys, {len(outs)} outs")
        targets = [o if isinstance(o, torch.Tensor) else memoryview(_as_byte_dest(o)) for o in outs]
        res: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        if stream is not None:
            from lmtier.tiers.record_tier import RecordTier
        for tier in (self.disk, self.p2p, self.remote):
            if tier is None or not todo or tier.name in skip:
                continue
            kw = {"stream": stream} if stream is not None and isinstance(tier, RecordTier) else {}
            ks, ts = [keys[i] for i in todo], [targets[i] for i in todo]
            meter, got = self._load_meter, None
            token = meter.begin(tier.name, read_path(tier, bool(kw))) if meter is not None else None
            try:
                got = self._safe(tier.get_many_into, ks, ts, default=None, **kw) or [None] * len(todo)
            finally:
                if meter is not None:
                    meter.end(token, sum(n for n in got or () if n))
            left = []
            for i, n in zip(todo, got, strict=True):
                if n is None:
                    if not self._held(targets[i]):  # a late transfer may still write it: no tier may fill it
                        left.append(i)
                else:
                    res[i] = n
                    self._count(f"hits_{tier.name}")
            todo = left
        if todo:
            self._count("misses", len(todo))
        return res

    def _held(self, target: Any) -> bool:
        """Whether ``target`` is a CPU-pool slot a tier left held (:meth:`CPUPool.hold
        <lmtier.tiers.cpu.CPUPool.hold>`: a transfer that outlived its timeout may still write into it)."""
        if self.cpu is None:
            return False
        if isinstance(target, torch.Tensor):
            n = target.numel() * target.element_size()
            return target.device.type == "cpu" and self.cpu.is_held(target.data_ptr(), n)
        from lmtier.tiers.buffers import address_of

        return self.cpu.is_held(address_of(target), target.nbytes)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to ``counters[name]`` (thread-safe)."""
        self._count(name, n)

    def _retrieve_from(
        self, tier: Tier, key: bytes, out: Any, dst: Any, tenant: str, position: int | None
    ) -> int | None:
        slot = self.cpu.reserve(key, tenant=tenant, position=position) if self.cpu is not None else None
        if slot is None:  # no pool, pool full, or someone else is promoting it: read directly
            target = out if isinstance(out, torch.Tensor) else memoryview(dst)
            return self._safe(tier.get_into, key, target, default=None)
        assert self.cpu is not None
        try:
            n = self._safe(tier.get_into, key, slot.memoryview(), default=None)
        except BaseException:
            self.cpu.abort(slot)
            raise
        if n is None:
            self.cpu.abort(slot)
            return None
        if n > dst.shape[0]:
            self.cpu.commit(slot, n)
            self._events.publish(IndexEventKind.STORED, key, "cpu")
            raise ValueError(f"TierManager.retrieve: out has {dst.shape[0]} bytes, chunk has {n}")
        try:
            if isinstance(dst, torch.Tensor):
                dst[:n].copy_(slot.view[:n])
            else:
                dst[:n] = slot.view[:n].numpy()
        except BaseException:
            self.cpu.abort(slot)
            raise
        self.cpu.commit(slot, n)
        self._events.publish(IndexEventKind.STORED, key, "cpu")
        self._count("promotions")
        return n

    # ---- lifecycle ---------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued store and remote send has finished. Returns False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout_s)

    def close(self, *, persist: bool = True) -> None:
        """Finish pending work, optionally write CPU-only chunks to disk (``persist``, each with the
        position its slot holds; so a restarted process finds them), and close every tier. Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._store_pool.shutdown(wait=True)
        if self._remote_pool is not None:
            self._remote_pool.shutdown(wait=True)
        if persist and self.cpu is not None and self.disk is not None:
            for key in self.cpu.keys():
                slot = self.cpu.acquire(key)
                if slot is None:
                    continue
                try:
                    self._write_back(key, slot.view, slot.position)
                finally:
                    self.cpu.release(slot)
        if self.cpu is not None:
            self.cpu.remove_eviction_listener(self._on_cpu_evicted)
        if self.disk is not None:
            self.disk.remove_eviction_listener(self._on_disk_evicted)
        for tier in (self.p2p, self.cpu, self.disk, self.remote):
            if tier is not None:
                try:
                    tier.close()
                except Exception:
                    log.exception("closing tier %s failed", tier.name)

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TierManager is closed")

    def _count(self, name: str, n: int = 1, *, tenant: str | None = None) -> None:
        with self._counter_lock:
            self.counters[name] += n
            if tenant is not None:
                self._tenant_counters.setdefault(tenant, collections.Counter())[name] += n

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant id: the CPU pool's usage and eviction counts (:meth:`CPUPool.tenant_stats`, with
        budgets on), the remote tier's as ``remote_<name>`` (with its budgets:
        :meth:`lmtier.tiers.redis.RedisTier.tenant_stats`) and the ``hits_{cpu,disk,remote}`` /
        ``misses`` of :meth:`retrieve_into` calls that named the tenant (a snapshot)."""
        out = self.cpu.tenant_stats() if self.cpu is not None else {}
        if self._remote_tenants:
            for t, row in self.remote.tenant_stats().items():  # type: ignore[union-attr]
                out.setdefault(t, {}).update({f"remote_{k}": v for k, v in row.items()})
        with self._counter_lock:
            for t, c in self._tenant_counters.items():
                out.setdefault(t, {}).update(c)
        return out

    def _enter(self) -> None:
        with self._idle:
            self._inflight += 1

    def _leave(self) -> None:
        with self._idle:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()

    def _safe(self, fn: Callable, *args: Any, default: Any, **kwargs: Any) -> Any:
        """Call a lower-tier method; any exception becomes ``default`` (a miss / failed store)."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            name = getattr(getattr(fn, "__self__", None), "name", "tier")
            log.warning("%s.%s failed: %r; treated as a miss", name, getattr(fn, "__name__", "?"), e)
            self._count("tier_errors")
            return default
