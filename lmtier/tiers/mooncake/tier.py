"""Remote tier on Mooncake Store (kvcache-ai/Mooncake) through its official client,
``mooncake.store.MooncakeDistributedStore`` (the ``mooncake`` extra: scripts/setup_mooncake.sh).

One Mooncake object per chunk, named ``<key_prefix><key hex>``, whose value is a self-describing
record of :mod:`lmtier.record` with the compact header (``payload_offset = 128``) followed by the
payload, as in the Redis tier: a wrong, torn, truncated or replaced value fails the header, length or
xxh3 check and is a miss (and is removed), never KV handed to attention.

Data path (zero-copy on the client's side). The tier owns one page-aligned bounce region
(:class:`~lmtier.tiers.mooncake.bounce.BounceRegion`, ``bounce_bytes``) registered once with
``register_buffer``; records move with ``batch_put_from`` / ``batch_get_into`` between that region
and the store (``pipeline_depth`` > 1: a batch cut into a few sub-batches with that many calls in
flight, so one sub-batch is verified and copied, GIL released, while the next transfers). The
caller's payloads are copied into the region (put) and verified records out of it (get). The copy
is what makes timeouts safe: the client is blocking C++ that cannot be cancelled, so a call that
outlives its timeout keeps running; it only ever touches its own extent of the region, which stays
reserved until the call really returns, so a late write can never land in memory the caller has
reused. CUDA payloads and destinations go through :class:`lmtier.tiers.device.PinnedBounce`.

Failure model (as for Redis): every client call runs on a worker thread and the caller waits at most
``timeout_s`` (``setup_timeout_s`` for ``setup``); a call that times out, raises or returns an
outage code (RPC/transfer failures) counts as a failure of the circuit breaker
(:class:`lmtier.tiers.breaker.CircuitBreaker`); while it is open, calls return misses / False at
once. When all ``workers`` threads are stuck (a paused master holds each call ~30 s), further calls
fail at once instead of queueing. Loads become misses and stores return False; nothing raises to
the caller. Measured here (0.3.13.post1): with the master SIGSTOPped a client call blocks ~30 s (its
RPC timeout; the data calls release the GIL), with it killed ~4 s; after a master restart the client
re-mounts its segment by itself (its ping thread), so the tier recovers without a new client. A
client whose ``setup`` failed (master down at startup) is replaced by a new one on a later call, at
most once per ``breaker_reset_s``. ``setup`` itself holds the GIL while it runs (~90 s against a
dead master), so it is only called once a TCP connect to the master succeeded (a dead master costs
a refused connect); the residual risk is a master that accepts connections but does not answer
(paused) exactly while a client is being set up: the process then stalls until the client's RPC
timeout.

Visibility (Mooncake #1817: ``put`` may return OK on failure): a put returns True only when
``batch_put_from`` returned 0 for the record **and** ``batch_is_exist`` then confirms it; only then
does the tier manager publish the chunk (index events, ``stored_remote``). ``contains`` asks the
master (``batch_is_exist``, one call per batch): there is no local index, so chunks other processes
stored are found, and a value evicted or removed between lookup and read is a miss (the read returns
OBJECT_NOT_FOUND, or the record does not verify).

Logging: ``logging.getLogger("lmtier.tiers.remote")``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmtier import record as rec
from lmtier.affinity import unpin_thread
from lmtier.remote_url import MooncakeEndpoint, parse_mooncake_url
from lmtier.tiers.base import KEY_BYTES, Tier, TierError, TierUsage
from lmtier.tiers.breaker import CircuitBreaker
from lmtier.tiers.buffers import address_of, round_up
from lmtier.tiers.checksums import payload_checksums
from lmtier.tiers.device import PinnedBounce, is_cuda_tensor
from lmtier.tiers.mooncake.bounce import ALIGN, Batch, BounceRegion, copy_out
from lmtier.tiers.mooncake.calls import NOT_FOUND_CODES, ClientCalls, is_outage
from lmtier.tiers.mooncake.calls import Failed as _Failed
from lmtier.tiers.mooncake.settings import MooncakeSettings, local_address_towards

if TYPE_CHECKING:
    from lmtier.config import RemoteConfig
    from lmtier.tiers.cpu import CPUPool

__all__ = ["MooncakeTier", "HEADER", "NOT_FOUND_CODES", "is_outage"]

log = logging.getLogger("lmtier.tiers.remote")

HEADER = rec.COMPACT_PAYLOAD_OFFSET
"""Bytes of the compact record header in front of every stored payload."""
_SPLIT = 4
"""A batch is cut into about this many sub-batches..."""
_MIN_BATCH_BYTES = 8 << 20
"""...of at least this many bytes each (a client call costs a master RPC)."""

_RETRY = object()
"""A direct read's result for a record to read again through the bounce region."""


class MooncakeTier(ClientCalls, Tier):
    """Chunks as Mooncake Store objects (one self-describing record each), through the official client.

    Args:
        endpoint: the master: a :class:`lmtier.remote_url.MooncakeEndpoint` (as the config parsed
            it) or a ``mooncakestore://HOST:PORT/`` URL.
        settings: client settings (:class:`~lmtier.tiers.mooncake.settings.MooncakeSettings`);
            default: the defaults for ``endpoint`` (tcp, P2PHANDSHAKE, 1 GiB segment).
        timeout_s: longest a caller waits for one client call, seconds.
        setup_timeout_s: longest a caller waits for the client's ``setup``, seconds.
        breaker_failures: consecutive failures that open the circuit breaker.
        breaker_reset_s: seconds it stays open before one trial call.
        workers: client calls in flight at most (threads); further calls while all are busy fail.
        bounce_bytes: size of the registered bounce region; larger batches move in several calls.
        pipeline_depth: client calls one ``put_many`` / ``get_many_into`` keeps in flight (>= 1):
            with 2 or more a batch is cut into about four sub-batches and the next ones transfer
            while one is verified and copied; 1 moves each bounce-sized batch in one call.
        direct: move payloads straight between the slots of a pool given to :meth:`attach_pool` and
            the store (no copy through the bounce region); False: always through the region.
        key_prefix: prefix of every object name.
        max_value_bytes: largest payload stored or accepted when loading.
        capacity_bytes: reported by :meth:`usage` (default: the mounted segment size).
        namespace: 16-byte namespace digest written into each record header (informational).

    Raises:
        TierError: the ``mooncake`` package is not installed (``pip install lmtier[mooncake]`` /
            scripts/setup_mooncake.sh). An unreachable master only logs a warning (misses).
        ValueError: malformed URL or arguments.

    Attributes:
        counters: ``collections.Counter``: ``hits``, ``misses``, ``errors``, ``timeouts``,
            ``busy`` (all workers stuck), ``corrupt``, ``puts``, ``put_failures``,
            ``put_unconfirmed`` (put said OK, ``batch_is_exist`` disagreed: #1817),
            ``breaker_rejects``, ``bounce_full``, ``setups``, ``direct_puts`` / ``direct_gets``
            (records moved straight from / into a pool slot, :meth:`attach_pool`).
    """

    name = "remote"

    def __init__(
        self,
        endpoint: MooncakeEndpoint | str,
        settings: MooncakeSettings | None = None,
        *,
        timeout_s: float = 1.0,
        setup_timeout_s: float = 10.0,
        breaker_failures: int = 3,
        breaker_reset_s: float = 2.0,
        workers: int = 4,
        bounce_bytes: int = 256 << 20,
        pipeline_depth: int = 1,
        direct: bool = True,
        key_prefix: str = "lmtier:",
        max_value_bytes: int = rec.DEFAULT_MAX_PAYLOAD_BYTES,
        capacity_bytes: int | None = None,
        namespace: bytes = bytes(16),
    ) -> None:
        super().__init__()
        if timeout_s <= 0 or setup_timeout_s <= 0:
            raise ValueError("MooncakeTier: timeouts must be > 0")
        if breaker_failures < 1 or breaker_reset_s < 0:
            raise ValueError("MooncakeTier: breaker_failures must be >= 1 and breaker_reset_s >= 0")
        if workers < 1 or bounce_bytes < (1 << 20) or pipeline_depth < 1:
            raise ValueError("MooncakeTier: workers and pipeline_depth must be >= 1 and bounce_bytes >= 1 MiB")
        if isinstance(endpoint, str):
            endpoint = parse_mooncake_url(endpoint)
        if not isinstance(endpoint, MooncakeEndpoint):
            raise TypeError(
                f"MooncakeTier: endpoint must be a MooncakeEndpoint or a URL, got {type(endpoint).__name__}"
            )
        settings = settings or MooncakeSettings(master_server_address=endpoint.master_address)
        if settings.master_server_address != endpoint.master_address:
            raise ValueError(
                f"MooncakeTier: settings name master {settings.master_server_address!r}, the endpoint "
                f"{endpoint.master_address!r}"
            )
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise TierError(
                f"the Mooncake tier needs the mooncake package ({e}); install it with "
                "scripts/setup_mooncake.sh or pip install 'lmtier[mooncake]' (and Debian's libibverbs1 "
                "librdmacm1 libnuma1)"
            ) from None
        self._store_cls = MooncakeDistributedStore
        self.endpoint = endpoint
        self.url = endpoint.describe()
        self.settings = settings
        self.local_hostname = settings.local_hostname or local_address_towards(endpoint.host, endpoint.port)
        self.timeout_s = float(timeout_s)
        self.setup_timeout_s = float(setup_timeout_s)
        self.workers = workers
        self.pipeline_depth = pipeline_depth
        self.direct = bool(direct)
        self._cpu: CPUPool | None = None  # attach_pool: the pool whose slots move directly
        self._cpu_base = self._cpu_bytes = 0
        self._cpu_registered = False  # with the current client
        self.key_prefix = key_prefix
        self.max_value_bytes = max_value_bytes
        self.capacity_bytes = settings.global_segment_size if capacity_bytes is None else capacity_bytes
        self._meta = rec.RecordMeta(namespace=bytes(namespace))
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.counters: collections.Counter = collections.Counter()
        self._device = PinnedBounce(max_cached=2)
        self._arena = BounceRegion(bounce_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="lmtier-mooncake", initializer=unpin_thread
        )
        self._lock = threading.Lock()
        self._inflight = 0
        self._store: Any = None  # a set-up client with the arena registered, or None
        self._next_setup = 0.0
        self._closed = False
        with self._lock:
            ok = self._setup_locked()
        if not ok:
            log.warning("remote tier %s not reachable at startup; it degrades to misses and retries", self.url)
        log.info(
            "remote tier %s via mooncake (%s, metadata %s, segment %d MiB, timeout %.3f s, breaker %d/%.1f s)",
            self.url,
            settings.protocol,
            settings.metadata_server,
            settings.global_segment_size >> 20,
            timeout_s,
            breaker_failures,
            breaker_reset_s,
        )

    @classmethod
    def from_config(cls, remote: RemoteConfig, **kwargs: Any) -> MooncakeTier:
        """The tier of a loaded configuration: the endpoint and settings the config resolved and
        ``remote_timeout_s``; ``kwargs`` go to the constructor.

        Raises:
            ValueError: the remote tier is off or is not ``mooncakestore://``.
        """
        if not isinstance(remote.endpoint, MooncakeEndpoint) or remote.mooncake is None:
            raise ValueError("MooncakeTier.from_config: remote_url is not mooncakestore://")
        kwargs.setdefault("timeout_s", remote.timeout_s)
        return cls(remote.endpoint, remote.mooncake, **kwargs)

    @property
    def breaker_open(self) -> bool:
        return self.breaker.is_open

    # ---- public API ------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One ``batch_is_exist`` call; all False on any failure."""
        if not keys:
            return []
        names = [self._name(k) for k in keys]
        try:
            codes = self._call(lambda s: s.batch_is_exist(names))
        except _Failed:
            return [False] * len(keys)
        if any(c < 0 for c in codes):
            self.counters["errors"] += 1
        return [c == 1 for c in codes]

    def put(self, key: bytes, payload: Any) -> bool:
        """Store one record; True only once the store confirms it (see the module doc)."""
        return self.put_many([key], [payload])[0]

    def put_many(self, keys: Sequence[bytes], payloads: Sequence[Any]) -> list[bool]:
        """Store several records with as few ``batch_put_from`` calls as the bounce region allows
        (payloads inside the attached pool's arena: ``batch_put_from_multi_buffers`` of the header
        from the bounce region and the payload from the slot, no copy; :meth:`attach_pool`).

        Args:
            keys: 32-byte chunk keys.
            payloads: read-only contiguous host buffers or CUDA tensors, one per key.

        Returns:
            Per key: True when stored and confirmed by ``batch_is_exist``.
        """
        if len(keys) != len(payloads):
            raise ValueError("MooncakeTier.put_many: keys and payloads differ in length")
        keys = [bytes(k) for k in keys]
        names = [self._name(k) for k in keys]
        out = [False] * len(keys)
        with contextlib.ExitStack() as stack:
            views = [stack.enter_context(self._device.host_payload(p)) for p in payloads]
            todo = []
            for i, mv in enumerate(views):
                if mv.nbytes > self.max_value_bytes:
                    log.warning("put: payload of %d bytes exceeds max_value_bytes %d", mv.nbytes, self.max_value_bytes)
                    continue
                todo.append(i)
            direct = [self._in_arena(mv) for mv in views]
            sizes = [mv.nbytes if d else HEADER + mv.nbytes for mv, d in zip(views, direct, strict=True)]
            sent = self._pipeline(
                self._batches(todo, sizes, direct), lambda b, first: self._put_start(b, names, keys, views, first)
            )
            sent_idx = [i for i, ok in sent.items() if ok]
            for i, ok in zip(sent_idx, self._confirm([names[i] for i in sent_idx]), strict=True):
                out[i] = ok
        for r in out:
            self.counters["puts" if r else "put_failures"] += 1
        return out

    def get_into(self, key: bytes, out: Any) -> int | None:
        """Read and verify one record into ``out`` (host buffer or CUDA tensor); payload bytes or None."""
        key = bytes(key)
        if is_cuda_tensor(out):
            return self._device.get_into(out, lambda mv: self.get_many_into([key], [mv])[0])
        return self.get_many_into([key], [out])[0]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """Read several records with as few ``batch_get_into`` calls as the bounce region allows.

        Args:
            keys: 32-byte chunk keys.
            outs: writable contiguous host buffers, each >= its payload (CUDA tensors are read
                one by one through :meth:`get_into`). An ``out`` that is a slot of the attached
                pool being written (:meth:`attach_pool`) is read into directly
                (``batch_get_into_multi_buffers``: the header into the bounce region, the payload
                into the slot) and verified there; if that call outlives ``timeout_s`` the slot is
                held (:meth:`CPUPool.hold <lmtier.tiers.cpu.CPUPool.hold>`) until it returns.

        Returns:
            Per key: the payload bytes in its ``out`` (verified), or None (miss, too small ``out``,
            failure, a record that does not verify — which is then removed; ``out`` may then hold
            unverified bytes, which the caller must not use).
        """
        if len(keys) != len(outs):
            raise ValueError("MooncakeTier.get_many_into: keys and outs differ in length")
        if any(is_cuda_tensor(o) for o in outs):
            return [self.get_into(k, o) for k, o in zip(keys, outs, strict=True)]
        from lmtier.tiers.buffers import host_view

        keys = [bytes(k) for k in keys]
        names = [self._name(k) for k in keys]
        views = [host_view(o, writable=True) for o in outs]
        slots = [self._direct_slot(v) for v in views]
        direct = [s is not None for s in slots]
        sizes = [
            v.nbytes if d else HEADER + min(v.nbytes, self.max_value_bytes) for v, d in zip(views, direct, strict=True)
        ]
        got = self._pipeline(
            self._batches(list(range(len(keys))), sizes, direct),
            lambda b, first: self._get_start(b, names, keys, views, slots, first),
        )
        # A direct read of a value whose size is not header + len(out) fails (the client wants
        # exact sizes): read those through the bounce region, which takes any size up to out.
        retry = [i for i, n in got.items() if n is _RETRY]
        if retry:
            got.update(dict.fromkeys(retry))
            got.update(
                self._pipeline(
                    self._batches(retry, [HEADER + min(views[i].nbytes, self.max_value_bytes) for i in retry]),
                    lambda b, first: self._get_start(b, names, keys, views, None, first),
                )
            )
        res: list[int | None] = [got.get(i) for i in range(len(keys))]
        for n in res:
            self.counters["hits" if n is not None else "misses"] += 1
        return res

    def delete(self, key: bytes) -> bool:
        """Remove the object (``remove(force=True)``); True if it was removed."""
        name = self._name(key)
        try:
            return self._call(lambda s: s.remove(name, True)) == 0
        except _Failed:
            return False

    def forget(self, key: bytes) -> bool:
        """Always False: this tier keeps no local index (every lookup asks the master)."""
        self._name(key)
        return False

    def usage(self) -> TierUsage:
        """``capacity_bytes``; used bytes and chunks are not reported by the client (0)."""
        return TierUsage(self.capacity_bytes, 0, 0)

    def ping(self) -> bool:
        """True when the client reports itself healthy (``health_check() == 0``)."""
        try:
            return self._call(lambda s: s.health_check()) == 0
        except _Failed:
            return False

    def close(self) -> None:
        """Close the client (bounded by ``timeout_s``) and free the bounce region once no call runs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        stuck = self._inflight > 0
        if store is not None and not stuck:
            fut = self._pool.submit(self._close_store, store)
            with contextlib.suppress(Exception):
                fut.result(self.timeout_s)
        self._pool.shutdown(wait=False)
        if not stuck:
            self._arena.close()  # else left to the stuck calls' process lifetime
        self._device.close()

    def _close_store(self, store: Any) -> None:
        with contextlib.suppress(Exception):
            store.unregister_buffer(self._arena.address)
        if self._cpu_registered:
            with contextlib.suppress(Exception):
                store.unregister_buffer(self._cpu_base)
        store.close()

    # ---- data path -------------------------------------------------------------------------

    def _batches(self, idx: list[int], sizes: list[int], direct: list[bool] | None = None) -> list[Batch]:
        """``idx`` split into sub-batches of consecutive records, each one client call (direct
        records — ``direct[i]``: ``sizes[i]`` is the payload, the bounce extent holds only the
        header — and bounce records in separate calls): with ``pipeline_depth`` > 1 about a
        quarter of the bytes moved (at least ``_MIN_BATCH_BYTES``; extents at most half the bounce
        region), so that the next sub-batch transfers while this one is verified and copied
        (:meth:`_pipeline`); else as many as the bounce region holds."""
        out: list[Batch] = []
        for want in (True, False):
            part = [i for i in idx if bool(direct and direct[i]) == want]
            if not part:
                continue
            ext = {i: round_up(HEADER if want else sizes[i], ALIGN) for i in part}
            total = sum(sizes[i] for i in part)
            limit, moved_limit = self._arena.nbytes, total
            if self.pipeline_depth > 1:
                limit = limit // 2
                moved_limit = max(_MIN_BATCH_BYTES, -(-total // _SPLIT))
            cur = Batch(direct=want)
            for i in part:
                if ext[i] > self._arena.nbytes:
                    log.warning(
                        "record of %d bytes exceeds the bounce region (%d bytes); skipped", ext[i], self._arena.nbytes
                    )
                    continue
                if cur.idx and (cur.total + ext[i] > limit or cur.moved + sizes[i] > moved_limit):
                    out.append(cur)
                    cur = Batch(direct=want)
                cur.idx.append(i)
                cur.offs.append(cur.total)
                cur.sizes.append(sizes[i])
                cur.total += ext[i]
                cur.moved += sizes[i]
            if cur.idx:
                out.append(cur)
        return out

    def _pipeline(self, batches: list[Batch], start: Callable[[Batch, bool], bool]) -> dict[int, Any]:
        """Run sub-batches with up to ``pipeline_depth`` client calls in flight: ``start(batch, first)``
        reserves the batch's bounce extent and starts its call (``first``: this caller has none in
        flight, so it may wait for an extent / count a busy pool as a failure; otherwise it declines
        by returning False and the batch waits its turn); :meth:`_finish` of each batch, in order,
        verifies/copies while the next ones transfer; each call is waited for at most ``timeout_s``
        after the one before it finished (so the bound per call is as without pipelining).
        Returns ``{index: result}``."""
        todo = collections.deque(batches)
        flight: collections.deque[Batch] = collections.deque()
        res: dict[int, Any] = {}
        while todo or flight:
            while todo and len(flight) < self.pipeline_depth and start(todo[0], not flight):
                flight.append(todo.popleft())
            if not flight:  # a first start that failed: its batch is done (all misses / not stored)
                todo.popleft()
                continue
            res.update(self._finish(flight.popleft()))
            if flight and flight[0].pending is not None:  # its wait starts now, not while it queued
                p = flight[0].pending
                p.deadline = max(p.deadline, time.monotonic() + self.timeout_s)
        return res

    def _reserve(self, b: Batch, first: bool) -> bool:
        base = self._arena.acquire(b.total, self.timeout_s if first else 0.0)
        if base is None:
            if first:
                self.counters["bounce_full"] += 1
            return False
        b.base = base
        b.ptrs = [self._arena.address + base + off for off in b.offs]
        return True

    def _put_start(self, b: Batch, names: list[str], keys: list[bytes], views: list[memoryview], first: bool) -> bool:
        """Write the records of ``b`` into a bounce extent and start their ``batch_put_from``."""
        if not self._reserve(b, first):
            return False
        arena = self._arena.mv
        sums = payload_checksums([views[i] for i in b.idx])
        for i, off, xxh3 in zip(b.idx, b.offs, sums, strict=True):
            o, mv = b.base + off, views[i]
            n = mv.nbytes
            arena[o : o + HEADER] = rec.encode_header(keys[i], n, xxh3, payload_offset=HEADER, meta=self._meta)
            if not b.direct:
                copy_out(arena[o + HEADER : o + HEADER + n], mv)
        bnames = [names[i] for i in b.idx]
        b.kind = "put"
        if b.direct:  # header from the bounce region, payload from the pool slot (registered)
            self.counters["direct_puts"] += len(b.idx)
            bufs = [[p, address_of(views[i])] for p, i in zip(b.ptrs, b.idx, strict=True)]
            lens = [[HEADER, n] for n in b.sizes]
            return self._start_batch(b, lambda s: s.batch_put_from_multi_buffers(bnames, bufs, lens), first)
        return self._start_batch(b, lambda s: s.batch_put_from(bnames, b.ptrs, b.sizes), first)

    def _get_start(
        self,
        b: Batch,
        names: list[str],
        keys: list[bytes],
        views: list[memoryview],
        slots: list[int | None] | None,
        first: bool,
    ) -> bool:
        """Start the ``batch_get_into`` of ``b`` into a bounce extent (direct: the
        ``batch_get_into_multi_buffers`` of the headers into it and the payloads into the slots)."""
        if not self._reserve(b, first):
            return False
        bnames = [names[i] for i in b.idx]
        b.kind, b.names, b.keys, b.views = "get", bnames, [keys[i] for i in b.idx], [views[i] for i in b.idx]
        if b.direct:
            assert slots is not None
            self.counters["direct_gets"] += len(b.idx)
            b.slots = [slots[i] for i in b.idx]
            bufs = [[p, address_of(v)] for p, v in zip(b.ptrs, b.views, strict=True)]
            lens = [[HEADER, n] for n in b.sizes]
            return self._start_batch(b, lambda s: s.batch_get_into_multi_buffers(bnames, bufs, lens), first)
        return self._start_batch(b, lambda s: s.batch_get_into(bnames, b.ptrs, b.sizes), first)

    def _start_batch(self, b: Batch, fn: Callable[[Any], Any], first: bool) -> bool:
        try:
            b.pending = self._start(fn, optional=not first)
        except _Failed:
            b.pending = None
        if b.pending is None and not first:  # declined: give the extent back, start it later
            self._arena.release(b.base, b.total)
            return False
        return True

    def _finish(self, b: Batch) -> dict[int, Any]:
        """Wait for ``b``'s call; put: ``{i: sent}``; get: ``{i: payload bytes or None}``
        (verified and copied out). Releases the extent (a timed-out call: when it really returns)."""
        release = [True]
        codes: list[int] | None = None
        corrupt: list[tuple[str, str]] = []
        res: dict[int, Any] = dict.fromkeys(b.idx, False if b.kind == "put" else None)
        direct_get = b.direct and b.kind == "get"
        try:
            if b.pending is not None:
                with contextlib.suppress(_Failed):
                    codes = self._wait(
                        b.pending,
                        extent=(b.base, b.total),
                        release=release,
                        outage_ok=direct_get,
                        on_late=self._late_hook(b),
                    )
            if codes is None:
                return res
            if any(is_outage(c) for c in codes) and not direct_get:
                self.counters["errors"] += 1
            if b.kind == "put":
                return {i: c == 0 for i, c in zip(b.idx, codes, strict=True)}
            arena = self._arena.mv
            direct_hdrs: list[tuple[int, int, rec.RecordHeader]] = []
            for j, (i, code) in enumerate(zip(b.idx, codes, strict=True)):
                if code < 0:
                    if direct_get and code not in NOT_FOUND_CODES:  # e.g. another size: through the bounce
                        res[i] = _RETRY
                    elif code == -600:  # INVALID_PARAMS: the value is larger than out
                        log.warning("get_into: out has %d bytes < value %s", b.views[j].nbytes, b.names[j])
                    continue
                o = b.base + b.offs[j]
                if direct_get:  # header in the extent, payload in the slot: checked there, below
                    hdr = self._direct_header(b.keys[j], arena[o : o + HEADER], b.sizes[j], code)
                    if isinstance(hdr, str):
                        corrupt.append((b.names[j], hdr))
                    else:
                        direct_hdrs.append((j, i, hdr))
                    continue
                why = self._verify(b.keys[j], arena[o : o + code], b.views[j].nbytes)
                if isinstance(why, str):
                    corrupt.append((b.names[j], why))
                elif why is not None:
                    copy_out(b.views[j][:why], arena[o + HEADER : o + HEADER + why])
                    res[i] = why
            sums = payload_checksums([b.views[j][: b.sizes[j]] for j, _, _ in direct_hdrs])
            for (j, i, hdr), xxh3 in zip(direct_hdrs, sums, strict=True):
                if xxh3 == hdr.payload_xxh3:
                    res[i] = hdr.payload_bytes
                else:
                    corrupt.append((b.names[j], f"payload checksum mismatch (stored {hdr.payload_xxh3:#018x})"))
        finally:
            if b.base is not None and release[0]:
                self._arena.release(b.base, b.total)
        for name, why in corrupt:
            log.warning("remote value %s is corrupt (%s); removing it", name, why)
            self.counters["corrupt"] += 1
            with contextlib.suppress(_Failed):
                self._call(lambda s, name=name: s.remove(name, True))
        return res

    def _confirm(self, names: list[str]) -> list[bool]:
        """Mooncake #1817: a 0 from ``batch_put_from`` is not proof; the master must list the object.
        One ``batch_is_exist`` for every record a ``put_many`` sent."""
        if not names:
            return []
        try:
            there = self._call(lambda s: s.batch_is_exist(names))
        except _Failed:
            return [False] * len(names)
        for name, e in zip(names, there, strict=True):
            if e != 1:
                self.counters["put_unconfirmed"] += 1
                log.warning("put %s: the client said OK but the object is not there (Mooncake #1817)", name)
        return [e == 1 for e in there]

    def _verify(self, key: bytes, value: memoryview, cap: int) -> int | str | None:
        """Payload length of a verified record, a reason string when it does not verify, None when
        ``out`` (``cap`` bytes) is too small."""
        if value.nbytes < HEADER:
            return f"value of {value.nbytes} bytes is shorter than the header"
        try:
            hdr = rec.decode_header(value[:HEADER], expected_key=key, max_payload_bytes=self.max_value_bytes)
        except rec.RecordError as e:
            return str(e)
        if hdr.payload_offset != HEADER or HEADER + hdr.payload_bytes != value.nbytes:
            return f"value length {value.nbytes} != header {HEADER} + payload {hdr.payload_bytes}"
        if hdr.payload_bytes > cap:
            log.warning("get_into: out has %d bytes < payload %d", cap, hdr.payload_bytes)
            return None
        try:
            rec.verify_payload(hdr, value[HEADER:])
        except rec.RecordError as e:
            return str(e)
        return hdr.payload_bytes

    def _direct_header(self, key: bytes, header: memoryview, nbytes: int, code: int) -> rec.RecordHeader | str:
        """The header of a record read straight into a slot (``header``: its 128 bytes, ``nbytes``:
        the payload bytes read into the slot, ``code``: what the client reported) if it is this
        key's and states that length — its payload checksum is then compared by the caller —, else
        why not."""
        try:
            hdr = rec.decode_header(header, expected_key=key, max_payload_bytes=self.max_value_bytes)
        except rec.RecordError as e:
            return str(e)
        if hdr.payload_offset != HEADER or hdr.payload_bytes != nbytes or code != HEADER + nbytes:
            return f"value length {code} != header {HEADER} + payload {hdr.payload_bytes} (read {nbytes})"
        return hdr

    def _late_hook(self, b: Batch) -> Callable[[], Callable[[concurrent.futures.Future], None]] | None:
        """For a direct get: what to do if its call outlives the wait — hold its slots (the call keeps
        writing into them) and return the callback that unholds them when it finally returns."""
        if not (b.direct and b.kind == "get") or self._cpu is None:
            return None
        pool = self._cpu

        def on_late() -> Callable[[concurrent.futures.Future], None]:
            for slot in b.slots:
                if slot is None:
                    continue
                try:
                    pool.hold(slot)
                except RuntimeError:  # the caller gave its slot up during the call: a caller bug
                    log.error("mooncake: a slot read into was aborted or committed during the call")
                    continue
                b.held.append(slot)
            return lambda _f: [pool.unhold(slot) for slot in b.held]

        return on_late

    def _in_arena(self, mv: memoryview) -> bool:
        """Whether ``mv`` lies inside the attached pool's arena registered with the client."""
        if self._cpu is None or not self._cpu_registered or not self.direct or mv.nbytes == 0:
            return False
        a = address_of(mv)
        return self._cpu_base <= a and a + mv.nbytes <= self._cpu_base + self._cpu_bytes

    def _direct_slot(self, mv: memoryview) -> int | None:
        """The attached pool's slot being written that ``mv`` is (a direct read target), else None."""
        if mv.nbytes > self.max_value_bytes or not self._in_arena(mv):
            return None
        assert self._cpu is not None
        return self._cpu.writing_slot(address_of(mv), mv.nbytes)

    # ---- plumbing --------------------------------------------------------------------------

    def _name(self, key: bytes) -> str:
        key = bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"MooncakeTier: key must be {KEY_BYTES} bytes, got {len(key)}")
        return self.key_prefix + key.hex()

    def attach_pool(self, pool: CPUPool) -> None:
        """Move chunks straight between ``pool``'s slots and the store (unless ``direct`` is False):
        its arena is registered with the client (now and after every new client set-up), so that
        a payload inside it is stored with ``batch_put_from_multi_buffers`` (header from the bounce
        region, payload from the slot) and a slot being written is read into with
        ``batch_get_into_multi_buffers`` — no copy through the bounce region. Safety is as with the
        region: a call that outlives its timeout may still read a slot (its record then fails its
        checksum: a miss for any reader) or write one, which therefore stays held
        (:meth:`CPUPool.hold <lmtier.tiers.cpu.CPUPool.hold>`) until the call returns. The tier
        manager calls this with its CPU pool."""
        with self._lock:
            self._cpu = pool
            self._cpu_base = pool.arena.data_ptr()
            self._cpu_bytes = pool.num_slots * pool.slot_bytes
            self._register_cpu_locked()
