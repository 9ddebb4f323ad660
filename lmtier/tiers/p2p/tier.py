"""The P2P tier: chunks read with one-sided NIXL READs straight out of peers' CPU pools, found
through a directory in Redis/Valkey (:mod:`lmtier.tiers.p2p.directory`); and the publisher that
announces this node's own CPU pool to its peers. docs/p2p.md.

Serving side (every node): the CPU pool's arena is registered with NIXL once; the node publishes a
:class:`~lmtier.tiers.p2p.directory.NodeRecord` (its NIXL metadata and the arena's address) and keeps
it alive with a heartbeat. The tier manager's index events drive publication
(:meth:`P2PTier.on_index_event`, registered by the manager): ``STORED`` in ``"cpu"`` queues the chunk
for publication, ``EVICTED`` for removal. A background thread pins the slot, computes the payload's
xxh3, unpins, and publishes ``chunk key -> (node, slot offset, length, generation, xxh3)``
(one pipelined round trip per batch); entries are re-published every ``entry_ttl_s / 3`` while
the chunk stays, so their TTL only removes what a dead node left behind.

Reading side: ``contains_many`` is one pipelined ``HGETALL`` round trip (entries of other, allowed,
live nodes only); ``get_many_into`` looks the entries up again (fresh), groups the chunks by peer,
cuts each peer's bytes into sub-batches of halving size (half, a quarter, ... down to a last one of
at most 4 MiB; a sub-batch may end inside a chunk) and issues one NIXL READ per sub-batch, a peer's
sub-batches READ back to back by one worker thread (peers in parallel, up to ``workers``) while the
calling thread verifies each as it arrives, a chunk split across READs with a streaming xxh3
(:mod:`lmtier.tiers.p2p.reads`). A chunk
whose ``out`` is a slot of this node's CPU pool being written (the connector's and the manager's
promotions: :meth:`CPUPool.writing_slot <lmtier.tiers.cpu.CPUPool.writing_slot>`) is read straight
into it — the pool's arena is registered with NIXL anyway — and verified there; any other ``out``
gets its chunk through a registered bounce region (copied, then verified in ``out``).

Safety (decision): a peer's slot can be evicted and reused between the lookup and the READ, or
rewritten while the READ runs. The pool stores raw payloads (no header), so each read is checked
against its directory entry: the entry's MAC binds it to this namespace, chunk key and node (an entry
copied elsewhere does not verify), and the bytes read must have the entry's length and xxh3-64. A
reused slot holds another chunk's bytes (or a torn mix) and fails the checksum: a miss, counted
(``stale``), and that entry is deleted from the directory if it is still the same value (a
concurrent re-publication survives). The one residual risk is an xxh3-64 collision between the
published chunk and what the slot holds now (2**-64 per read for non-adversarial data). A chunk that
does not verify is a miss even where it was read straight into the caller's slot: the caller aborts
that slot, its bytes never become visible. A READ that outlives its caller's wait is not cancelled
(whether a cancelled UCX READ can still write is not something to rely on): it runs on until it
completes or fails, and until then everything it may write stays reserved — its bounce extent, and
the caller's slots *held* (:meth:`CPUPool.hold <lmtier.tiers.cpu.CPUPool.hold>`: never committed,
parked once aborted, and skipped by the manager's later tiers) — while the peer is hidden from
lookups, so at most one such READ per peer; its worker thread follows it until it ends. Only ``close``
cancels READs; one NIXL cannot cancel keeps its memory for good (counted ``stuck``).

Failure model: every directory call has socket timeouts (``timeout_s``) and a breaker; a caller
waits for a sub-batch ``timeout_s + bytes / min_read_bytes_per_s`` at most (after the previous one
arrived), then counts its chunks and those of the peer's later sub-batches as misses (see above for
the READ itself); a failed or timed-out READ
counts against that peer's :class:`~lmtier.tiers.breaker.CircuitBreaker`, whose opening hides the
peer from lookups for ``breaker_reset_s``; with all ``workers`` busy further reads fail at once. A
SIGKILLed peer: its READs fail at once (UCX disconnect) and its entries are ignored once its node
record expires (``node_ttl_s``). Nothing raises to the caller.

``put`` stores nothing (returns False): this tier holds no bytes of its own; chunks enter it only by
entering this node's CPU pool (the manager's write path), which publishes them. ``delete`` /
``forget`` likewise return False.

Logging: ``logging.getLogger("lmtier.tiers.p2p")``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmtier import record as rec
from lmtier.affinity import unpin_thread
from lmtier.events import IndexEvent, IndexEventKind
from lmtier.remote_url import RedisEndpoint
from lmtier.tiers.base import KEY_BYTES, Tier, TierUsage
from lmtier.tiers.breaker import CircuitBreaker
from lmtier.tiers.buffers import host_view
from lmtier.tiers.device import PinnedBounce, is_cuda_tensor
from lmtier.tiers.mooncake.bounce import BounceRegion
from lmtier.tiers.p2p.directory import Directory, Entry, NodeRecord
from lmtier.tiers.p2p.reads import PeerReads
from lmtier.tiers.p2p.transport import NixlTransport

if TYPE_CHECKING:
    from lmtier.keys import Namespace
    from lmtier.tiers.cpu import CPUPool
    from lmtier.tiers.p2p.settings import P2PSettings

__all__ = ["P2PTier"]

log = logging.getLogger("lmtier.tiers.p2p")

_PUBLISH_BATCH = 256
"""Chunks per publication round trip."""


@dataclass(eq=False)
class _Peer:
    """What this node knows about one peer: its verified record, when it was fetched, its breaker,
    and until when it is hidden from lookups (breaker open)."""

    node_id: str
    record: NodeRecord | None
    fetched: float
    breaker: CircuitBreaker
    hidden_until: float = 0.0
    late: int = 0  # READs from it that outlived their caller's wait and still run

    @property
    def agent_name(self) -> str:
        assert self.record is not None
        return _agent_name(self.node_id, self.record.epoch)


def _agent_name(node_id: str, epoch: int) -> str:
    return f"lmtier-p2p-{node_id}-{epoch:016x}"


class P2PTier(PeerReads, Tier):
    """Chunks in peers' CPU pools, read over NIXL; publishes this node's CPU pool. Thread-safe.

    Args:
        pool: this node's CPU pool (its arena is registered with NIXL and published); ``None``: a
            lookups-only tier (no NIXL agent, nothing published, every read a miss) for a process
            that only decides, such as a vLLM scheduler whose worker owns the pool.
        directory: where the directory lives (a single Redis/Valkey instance).
        namespace: 16-byte namespace digest (only nodes of the same namespace see each other).
        node_id: this node's id (``p2p_host:port``), unique among the peers.
        token: shared token (MACs entries and node records) or None.
        allowed: ``allowed(node_id)``: may this node be read from (the allow-list)?
        timeout_s: longest wait of one directory call, seconds; a READ of ``n`` bytes may take
            ``timeout_s + n / min_read_bytes_per_s``.
        entry_ttl_s: directory entry lifetime, seconds (re-published every third of it).
        node_ttl_s: node record lifetime, seconds (heartbeat every third of it).
        workers: peers read from at once at most (threads; a peer's sub-batches are READ one
            after another by one thread), all callers together.
        bounce_bytes: size of the registered bounce region reads land in.
        breaker_failures, breaker_reset_s: per-peer (and directory) circuit breaker settings.
        max_pending: publications queued at most (more are dropped, counted ``publish_dropped``).
        min_read_bytes_per_s: the slowest READ rate tolerated (see ``timeout_s``).

    Raises:
        TierError: NIXL not installed, agent or registration failed.

    Attributes:
        counters: ``hits``, ``misses``, ``stale`` (read did not verify), ``refused`` (entries of
            nodes not allowed), ``timeouts``, ``errors``, ``stuck``, ``busy``, ``breaker_rejects``,
            ``bounce_full``, ``published``, ``publish_dropped``, ``publish_failures``,
            ``direct_gets`` (chunks READ straight into a slot of this node's pool).
    """

    name = "p2p"

    def __init__(
        self,
        pool: CPUPool | None,
        directory: RedisEndpoint,
        *,
        namespace: bytes,
        node_id: str,
        token: bytes | None = None,
        allowed: Callable[[str], bool] = lambda node_id: True,
        timeout_s: float = 1.0,
        entry_ttl_s: float = 300.0,
        node_ttl_s: float = 15.0,
        workers: int = 4,
        bounce_bytes: int = 256 << 20,
        breaker_failures: int = 3,
        breaker_reset_s: float = 2.0,
        max_pending: int = 65536,
        min_read_bytes_per_s: float = 50e6,
    ) -> None:
        super().__init__()
        if timeout_s <= 0 or entry_ttl_s <= 0 or node_ttl_s <= 0:
            raise ValueError("P2PTier: timeouts and TTLs must be > 0")
        if workers < 1 or bounce_bytes < (1 << 20) or max_pending < 1 or not min_read_bytes_per_s > 0:
            raise ValueError("P2PTier: workers and max_pending must be >= 1 and bounce_bytes >= 1 MiB")
        self.pool = pool
        self.node_id = node_id
        self.namespace = bytes(namespace)
        self.allowed = allowed
        self.timeout_s = float(timeout_s)
        self.entry_ttl_s = float(entry_ttl_s)
        self.node_ttl_s = float(node_ttl_s)
        self.workers = workers
        self.breaker_failures = breaker_failures
        self.breaker_reset_s = breaker_reset_s
        self.max_pending = max_pending
        self.min_read_bytes_per_s = float(min_read_bytes_per_s)
        self.epoch = int.from_bytes(os.urandom(8), "little")
        self.counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._inflight = 0
        self._closed = False
        self._device = PinnedBounce(max_cached=2)
        self.directory = Directory(
            directory,
            self.namespace,
            token=token,
            timeout_s=timeout_s,
            entry_ttl_s=entry_ttl_s,
            node_ttl_s=node_ttl_s,
            breaker_failures=breaker_failures,
            breaker_reset_s=breaker_reset_s,
        )
        # Publisher state: the entries this node announced, and the queue of index changes.
        self._published: dict[bytes, Entry] = {}
        self._generation = 0
        self._queue: collections.deque[tuple[bool, bytes]] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._busy_publishing = False
        self.transport: NixlTransport | None = None
        self._bounce: BounceRegion | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the READ chains' threads
        self._stop_reads = threading.Event()  # set by close: READs still running are cancelled
        self._thread: threading.Thread | None = None
        if pool is None:
            log.info("p2p tier (lookups only): node %s, directory %s", node_id, self.directory.url)
            return
        self.transport = NixlTransport(_agent_name(node_id, self.epoch))
        self._bounce = BounceRegion(bounce_bytes)
        try:
            arena = pool.arena
            self.transport.register(arena.data_ptr(), arena.numel())
            self.transport.register(self._bounce.address, self._bounce.nbytes)
            self._record = NodeRecord(
                self.epoch, arena.data_ptr(), arena.numel(), time.time_ns(), self.transport.metadata()
            )
        except BaseException:
            self.transport.close()
            self.directory.close()
            raise
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="lmtier-p2p-read", initializer=unpin_thread
        )
        if not self.directory.put_node(node_id, self._record):
            log.warning("p2p: directory %s not reachable at startup; retrying with the heartbeat", self.directory.url)
        self._thread = threading.Thread(target=self._publisher, name="lmtier-p2p-publish", daemon=True)
        self._thread.start()
        log.info(
            "p2p tier: node %s, directory %s, arena %d MiB registered with NIXL (UCX), timeout %.3f s",
            node_id,
            self.directory.url,
            arena.numel() >> 20,
            timeout_s,
        )

    @classmethod
    def from_config(cls, settings: P2PSettings, namespace: Namespace, pool: CPUPool | None, **kwargs: Any) -> P2PTier:
        """The tier of a loaded configuration (``config.p2p``) for ``namespace``'s TP rank.

        Raises:
            ConfigError: ``p2p_init_ports`` has no port for the namespace's TP rank.
            TierError: NIXL missing or failing.
        """
        kwargs.setdefault("timeout_s", settings.timeout_s)
        kwargs.setdefault("entry_ttl_s", settings.entry_ttl_s)
        return cls(
            pool,
            settings.directory,
            namespace=namespace.digest()[:16],
            node_id=settings.node_id(namespace.tp_rank),
            token=settings.token,
            allowed=settings.allows,
            **kwargs,
        )

    # ---- publishing (this node's CPU pool) ----------------------------------------------------

    def on_index_event(self, ev: IndexEvent) -> None:
        """The tier manager's index listener: queue ``STORED`` (in ``"cpu"``) for publication and
        ``EVICTED`` for removal. Quick, thread-safe; a full queue drops (counted)."""
        if self.pool is None:
            return
        if ev.kind is IndexEventKind.STORED and ev.tier == "cpu":
            self._enqueue(True, ev.key)
        elif ev.kind is IndexEventKind.EVICTED:
            self._enqueue(False, ev.key)

    def publish_now(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued publication was processed (tests, benchmarks). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy_publishing, timeout_s)

    def _enqueue(self, publish: bool, key: bytes) -> None:
        with self._cond:
            if len(self._queue) >= self.max_pending:
                self.counters["publish_dropped"] += 1
                return
            self._queue.append((publish, bytes(key)))
            self._cond.notify_all()

    def _publisher(self) -> None:
        """Background thread: publish/remove queued entries in order, heartbeat the node record,
        re-publish held entries every ``entry_ttl_s / 3``."""
        unpin_thread()
        next_beat = time.monotonic() + self.node_ttl_s / 3
        next_refresh = time.monotonic() + self.entry_ttl_s / 3
        while True:
            with self._cond:
                wait = max(0.0, min(next_beat, next_refresh) - time.monotonic())
                self._cond.wait_for(lambda: self._queue or self._stop, wait)
                if self._stop:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), _PUBLISH_BATCH))]
                self._busy_publishing = bool(batch)
            try:
                self._apply(batch)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.node_ttl_s / 3
                    self.directory.put_node(self.node_id, self._record)
                if now >= next_refresh:
                    next_refresh = now + self.entry_ttl_s / 3
                    pool = self.pool
                    assert pool is not None
                    with self._lock:  # (a chunk whose EVICTED was dropped with a full queue: forget it)
                        for k in [k for k in self._published if not pool.contains(k)]:
                            del self._published[k]
                        items = list(self._published.items())
                    for i in range(0, len(items), _PUBLISH_BATCH):
                        self.directory.publish(self.node_id, items[i : i + _PUBLISH_BATCH])
            except Exception:  # the publisher must survive anything; a lost publication is a lost hit
                log.exception("p2p publisher failed")
            finally:
                with self._cond:
                    self._busy_publishing = False
                    self._cond.notify_all()

    def _apply(self, batch: list[tuple[bool, bytes]]) -> None:
        """Runs of publications / removals, in queue order."""
        i = 0
        while i < len(batch):
            j = i
            while j < len(batch) and batch[j][0] == batch[i][0]:
                j += 1
            keys = [k for _, k in batch[i:j]]
            if batch[i][0]:
                self._publish(keys)
            else:
                with self._lock:
                    for k in keys:
                        self._published.pop(k, None)
                self.directory.unpublish(self.node_id, keys)
            i = j

    def _publish(self, keys: list[bytes]) -> None:
        items: list[tuple[bytes, Entry]] = []
        for key in keys:
            assert self.pool is not None
            slot = self.pool.acquire(key)  # pinned: the bytes cannot change while hashed
            if slot is None:
                continue  # evicted before we got here: its EVICTED is queued behind
            try:
                xxh3 = rec.payload_checksum(slot.memoryview())
                with self._lock:
                    self._generation += 1
                    e = Entry(self.epoch, slot.offset, slot.nbytes, self._generation, xxh3)
                    self._published[key] = e
            finally:
                self.pool.release(slot)
            items.append((key, e))
        if items:
            ok = self.directory.publish(self.node_id, items)
            self.counters["published" if ok else "publish_failures"] += len(items)

    # ---- lookup -------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipelined directory round trip (plus one ``MGET`` of node records not seen for a
        while): True where an allowed, live peer other than this node publishes the chunk."""
        return [c is not None for c in self._choose(keys)]

    def _choose(self, keys: Sequence[bytes]) -> list[tuple[_Peer, Entry] | None]:
        """Per key the peer to read from and its entry, or None."""
        keys = [_check_key(k) for k in keys]
        found = self.directory.lookup(keys)
        if found is None:
            return [None] * len(keys)
        wanted = {n for entries in found for n in entries if n != self.node_id}
        refused = {n for n in wanted if not self.allowed(n)}
        if refused:
            self.counters["refused"] += sum(1 for entries in found for n in entries if n in refused)
        peers = self._peers_for(sorted(wanted - refused))
        now = time.monotonic()
        out: list[tuple[_Peer, Entry] | None] = []
        for entries in found:
            pick = None
            for n, e in entries.items():
                p = peers.get(n)
                if p is None or p.record is None or p.hidden_until > now or p.late:
                    continue
                if e.epoch != p.record.epoch or e.offset + e.length > p.record.arena_bytes or e.length == 0:
                    continue  # left by an earlier process of that node, or malformed
                pick = (p, e)
                break
            out.append(pick)
        return out

    def _peers_for(self, node_ids: list[str]) -> dict[str, _Peer]:
        """The peers of ``node_ids``, fetching records not refreshed for ``node_ttl_s / 3``."""
        now = time.monotonic()
        with self._lock:
            stale = [n for n in node_ids if n not in self._peers or now - self._peers[n].fetched > self.node_ttl_s / 3]
        if stale:
            recs = self.directory.get_nodes(stale)
            if recs is not None:
                with self._lock:
                    for n, r in recs.items():
                        p = self._peers.get(n)
                        if p is None:
                            p = self._peers[n] = _Peer(
                                n, None, now, CircuitBreaker(self.breaker_failures, self.breaker_reset_s)
                            )
                        gone = p.record is not None and (r is None or r.epoch != p.record.epoch)
                        if gone and self.transport is not None:
                            self.transport.drop_peer(p.agent_name)  # gone or restarted
                        p.record, p.fetched = r, now
        with self._lock:
            return {n: self._peers[n] for n in node_ids if n in self._peers}

    # ---- reads --------------------------------------------------------------------------------

    def get_into(self, key: bytes, out: Any) -> int | None:
        return self.get_many_into([key], [out])[0]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """Read and verify several chunks: one directory round trip, NIXL READs per peer in
        pipelined sub-batches (peers in parallel), each chunk checked against its entry (length,
        xxh3) in its ``out`` (a writable host buffer or CUDA tensor; a slot of this node's pool being
        written is read into directly, see the module doc). Per key: payload bytes, or None (a
        miss: ``out`` may hold unverified bytes, which the caller must not use).
        """
        if len(keys) != len(outs):
            raise ValueError(f"P2PTier.get_many_into: {len(keys)} keys, {len(outs)} outs")
        res: list[int | None] = [None] * len(keys)
        if self.transport is None:  # lookups only
            self.counters["misses"] += len(keys)
            return res
        host = [i for i, o in enumerate(outs) if not is_cuda_tensor(o)]
        if host:
            views = [host_view(outs[i], writable=True) for i in host]
            got = self._get_host([keys[i] for i in host], views)
            for i, n in zip(host, got, strict=True):
                res[i] = n
        for i, o in enumerate(outs):
            if is_cuda_tensor(o):
                k = keys[i]
                res[i] = self._device.get_into(o, lambda mv, k=k: self._get_host([k], [mv])[0])
        return res

    def _peer_failed(self, peer: _Peer) -> None:
        peer.breaker.failure()
        if peer.breaker.is_open:
            with self._lock:
                peer.hidden_until = time.monotonic() + self.breaker_reset_s
                peer.fetched = 0.0  # refetch its record when it comes back (it may have restarted)

    # ---- the rest of the Tier protocol --------------------------------------------------------

    def event_counts(self) -> dict[str, int]:
        """This tier's counters and its directory's, under the :data:`~lmtier.tiers.base.TIER_EVENTS`
        names: ``breaker_rejects`` sums the peers' breakers and the directory's; the directory's
        ``bad_entries`` / ``bad_nodes`` (MAC or format failures) as they are and its ``errors`` as
        ``directory_errors``; failed READs (``errors``) also as ``read_errors``."""
        out = super().event_counts()
        d = {k: int(v) for k, v in dict(self.directory.counters).items()}
        out["read_errors"] = out.get("errors", 0)
        out["directory_errors"] = d.get("errors", 0)
        out["breaker_rejects"] = out.get("breaker_rejects", 0) + d.get("breaker_rejects", 0)
        out["bad_entries"] = d.get("bad_entries", 0)
        out["bad_nodes"] = d.get("bad_nodes", 0)
        return out

    def put(self, key: bytes, payload: Any) -> bool:
        """Stores nothing: chunks reach peers by entering this node's CPU pool (see the module doc)."""
        return False

    def delete(self, key: bytes) -> bool:
        """Nothing stored here to delete (peers' pools are theirs); returns False."""
        return False

    def forget(self, key: bytes) -> bool:
        return False

    def usage(self) -> TierUsage:
        """``num_chunks``: chunks this node currently publishes; no capacity of its own."""
        with self._lock:
            n = len(self._published)
        return TierUsage(capacity_bytes=0, used_bytes=0, num_chunks=n)

    def close(self) -> None:
        """Stop publishing, withdraw this node's entries and record (best effort), stop the readers,
        deregister NIXL memory (unless a READ could not be cancelled). Idempotent."""
        with self._cond:
            if self._stop:
                return
            self._stop = True
            self._cond.notify_all()
        with self._lock:
            self._closed = True
        self._stop_reads.set()
        if self._thread is not None and self._pool is not None:  # a serving node
            self._thread.join(timeout=10)
            with self._lock:
                keys = list(self._published)
                self._published.clear()
            for i in range(0, len(keys), _PUBLISH_BATCH):
                self.directory.unpublish(self.node_id, keys[i : i + _PUBLISH_BATCH])
            self.directory.delete_node(self.node_id)
            self._pool.shutdown(wait=True)  # READs still running are cancelled (_stop_reads)
            if not self.counters["stuck"] and self.transport is not None and self._bounce is not None:
                self.transport.close()
                self._bounce.close()
        self.directory.close()
        self._device.close()


def _check_key(key: bytes) -> bytes:
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise ValueError(f"P2PTier: key must be {KEY_BYTES} bytes, got {len(key)}")
    return key
