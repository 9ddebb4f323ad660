"""The P2P tier's reads: one batch of chunks from peers' pools. :class:`PeerReads` is a mixin of
:class:`~lmtier.tiers.p2p.tier.P2PTier` (which owns the attributes it uses); the safety argument is
in that module's doc.

A batch: one directory lookup (``_choose``), the chunks grouped by peer, and each peer's bytes (its
chunks in order) cut into sub-batches of halving size — half of the peer's bytes, then a quarter,
... down to a last one of at most ``2 * MIN_READ_BYTES`` (:func:`read_plan`) — one NIXL READ each.
A sub-batch may end inside a chunk (at a page boundary): it carries *parts* of chunks. A peer's
sub-batches form a :class:`Chain` that one worker thread READs back to back (peers in parallel, up
to ``workers`` chains for the whole tier), while the calling thread verifies each sub-batch as soon
as it arrived: it feeds each part to its chunk's streaming xxh3 and checks a chunk when its last
part arrived. Verifying a sub-batch takes less time than READing the next one, half its size (xxh3
is several times faster than the copy a READ makes on one core, measured: benchmarks/RESULTS.md
§3.5), so only the last, smallest sub-batch's verification adds to the batch's time. (Measured here,
nixl-cu12 1.5.1, UCX between two processes of one host: ``transfer()`` itself moves the data before
it returns ``DONE``, so READs overlap only on separate threads, and concurrent READs from one peer
share its link and end together.) A chunk whose destination is a slot of this node's pool being
written is READ straight into it; any other destination through the registered bounce region. A
sub-batch still running at its deadline (``timeout_s + bytes / min_read_bytes_per_s`` after the
previous one arrived) is not cancelled: its chunks and those of the chain's later sub-batches are
misses, the later ones are never started, and the running READ's destination stays reserved (bounce
extent; slots held) until its worker saw it end.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lmtier import record as rec
from lmtier.tiers.buffers import PAGE_BYTES, address_of, round_up
from lmtier.tiers.checksums import payload_checksums
from lmtier.tiers.mooncake.bounce import ALIGN
from lmtier.tiers.p2p.transport import DONE, POLL_MAX_S, POLL_MIN_S, STUCK, NixlTransport

if TYPE_CHECKING:
    from lmtier.tiers.p2p.directory import Entry

__all__ = ["PeerReads", "Group", "Chain", "MIN_READ_BYTES", "HASH_ALONGSIDE_MIN_CORES", "read_plan"]

log = logging.getLogger("lmtier.tiers.p2p")

MIN_READ_BYTES = 2 << 20
"""A peer's bytes are cut into halving sub-batches (one NIXL READ each) until at most twice this is
left, which is the last sub-batch: the only one whose verification nothing overlaps."""


def read_plan(nbytes: int) -> list[int]:
    """Sizes of the sub-batches (bytes, one NIXL READ each) ``nbytes`` of one peer are cut into:
    half of what is left (rounded down to a page) while more than ``2 * MIN_READ_BYTES`` is left,
    then the rest. Their sum is ``nbytes``; empty for ``nbytes <= 0``."""
    plan: list[int] = []
    left = nbytes
    while left > 2 * MIN_READ_BYTES:
        n = left // 2 // PAGE_BYTES * PAGE_BYTES
        plan.append(n)
        left -= n
    if left > 0:
        plan.append(left)
    return plan


_POLL_LATE_S = 10e-3
HASH_ALONGSIDE_MIN_CORES = 4
"""With fewer CPUs than this, whole chunks of a sub-batch are hashed by the calling thread alone
while a later READ of the chain runs: between two processes of one host the READ is a copy made by
a thread of this process (CMA), and on the 2-core CPU box helper threads hashing beside it took the
core it needed (benchmarks/RESULTS.md §3.5). With more, the helpers of
:func:`~lmtier.tiers.checksums.payload_checksums` hash alongside (a fast network's READ needs no CPU
here, and one thread's xxh3 would fall behind it)."""


@dataclass(eq=False)
class Group:
    """What one READ moves from one peer: parts of chunks, in order. Part ``j`` is bytes
    ``[lo[j], lo[j] + lens[j])`` of the chunk of caller index ``idx[j]`` (its entry
    ``entries[j]``); it lands in a pool slot the caller reserved (``slots[j]``; ``addrs[j]`` is the
    part's address there) or at offset ``offs[j]`` of this group's bounce extent (``total`` bounce
    bytes). A chunk has at most one part per group; its parts in later groups follow on. ``fut``:
    its READ's end state (None: never started)."""

    peer: Any
    idx: list[int] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    lo: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    offs: list[int | None] = field(default_factory=list)
    slots: list[int | None] = field(default_factory=list)
    addrs: list[int] = field(default_factory=list)
    total: int = 0
    nbytes: int = 0
    base: int | None = None
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (local, remote address, bytes)
    started: bool = False
    fut: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(eq=False)
class Chain:
    """A peer's sub-batches, READ one after the other by one worker thread; ``cancelled``: the caller
    stopped waiting (the groups not started yet never will be)."""

    peer: Any
    agent: str = ""
    groups: list[Group] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    late_after: float = 0.0  # the worker polls more slowly after this time (nobody may be waiting)


@dataclass(eq=False)
class _Checks:
    """One batch's verification state: the streaming xxh3 of each chunk read in several parts
    (caller index -> hasher) and the chunks that can no longer verify (a part's READ failed)."""

    hashers: dict[int, Any] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)


class PeerReads:
    """The read path of :class:`~lmtier.tiers.p2p.tier.P2PTier` (a mixin: it uses the tier's
    ``pool``, ``transport``, ``_bounce``, ``_pool`` (the worker threads), ``_stop_reads``, ``_lock``,
    ``_inflight``, ``_closed``, ``workers``, ``timeout_s``, ``min_read_bytes_per_s``, ``counters``,
    ``directory``, ``_choose`` and ``_peer_failed``)."""

    pool: Any
    transport: NixlTransport | None
    directory: Any
    _bounce: Any
    _pool: concurrent.futures.ThreadPoolExecutor | None
    _stop_reads: threading.Event
    _lock: threading.Lock
    _inflight: int
    _closed: bool
    workers: int
    timeout_s: float
    min_read_bytes_per_s: float
    counters: collections.Counter
    _choose: Callable[[Sequence[bytes]], list]
    _peer_failed: Callable[[Any], None]

    def _get_host(self, keys: Sequence[bytes], outs: list[memoryview]) -> list[int | None]:
        """Read and verify ``keys`` into host ``outs`` (see the module doc); per key its length or None."""
        res: list[int | None] = [None] * len(keys)
        assert self._bounce is not None
        todo = self._groups(self._choose(keys), outs)
        checks = _Checks()
        while todo:
            chains = self._start_chains(todo)
            if not chains:  # nothing could start with nothing of ours in flight: the rest miss
                break
            for chain in chains:
                self._collect(chain, keys, outs, res, checks)
        n_hit = sum(1 for n in res if n is not None)
        self.counters["hits"] += n_hit
        self.counters["misses"] += len(keys) - n_hit
        return res

    def _groups(self, choice: list, outs: list[memoryview]) -> collections.deque[Group]:
        """The sub-batches of the chosen chunks: per peer, its chunks in order cut by
        :func:`read_plan` (a part's bounce bytes also fit half the bounce region; a chunk is split
        at page boundaries only)."""
        half = self._bounce.nbytes // 2
        per_peer: dict[str, list[tuple[Any, int, Entry, int, int | None]]] = {}
        for i, c in enumerate(choice):
            if c is None:
                continue
            peer, e = c
            if e.length > outs[i].nbytes:
                log.warning("p2p get_into: out has %d bytes, chunk has %d", outs[i].nbytes, e.length)
                continue
            addr = address_of(outs[i])
            per_peer.setdefault(peer.node_id, []).append((peer, i, e, addr, self._direct_slot(addr, e.length)))
        todo: collections.deque[Group] = collections.deque()
        for items in per_peer.values():
            plan = collections.deque(read_plan(sum(e.length for _, _, e, _, _ in items)))
            g, room = None, 0
            for peer, i, e, addr, slot in items:
                lo = 0
                while lo < e.length:
                    if g is None or room <= 0:
                        g, room = Group(peer), plan.popleft() if plan else e.length - lo
                        todo.append(g)
                    n = min(e.length - lo, room)
                    if slot is None:
                        n = min(n, half - g.total)
                    if n < e.length - lo:
                        n = n // PAGE_BYTES * PAGE_BYTES
                    if n <= 0:  # the group is full (its bounce share): the rest goes into the next
                        if plan:
                            plan[0] += room
                        g = None
                        continue
                    g.idx.append(i)
                    g.entries.append(e)
                    g.lo.append(lo)
                    g.lens.append(n)
                    g.slots.append(slot)
                    g.addrs.append(addr + lo)
                    if slot is None:
                        g.offs.append(g.total)
                        g.total += round_up(n, ALIGN)
                    else:
                        g.offs.append(None)
                    g.nbytes += n
                    lo += n
                    room -= n
        return todo

    def _direct_slot(self, address: int, nbytes: int) -> int | None:
        """The index of the slot of this node's pool (registered with NIXL) being written that holds
        ``[address, address + nbytes)`` — a READ may land there directly, since this tier can hold the
        slot if the READ outlives its wait — else None (the chunk goes through the bounce region)."""
        pool = self.pool
        return None if pool is None else pool.writing_slot(address, nbytes)

    def _start_chains(self, todo: collections.deque[Group]) -> list[Chain]:
        """Take the next sub-batches of each peer off ``todo`` (as far as bounce extents allow) and
        start one chain per peer on a worker, up to ``workers`` for the whole tier. The first
        chain may wait up to ``timeout_s`` for its first extent; a peer whose breaker refuses or
        whose metadata does not load gets no chain (its sub-batches leave ``todo``: misses)."""
        assert self._bounce is not None and self.transport is not None and self._pool is not None
        chains: dict[str, Chain] = {}
        blocked: set[str] = set()
        for g in list(todo):
            node = g.peer.node_id
            if node in blocked:
                continue
            chain = chains.get(node)
            if chain is None:
                if not self._take_worker(first=not chains):
                    break
                peer = g.peer
                assert peer.record is not None
                why = None
                if not peer.breaker.allow():
                    why = "breaker_rejects"
                elif not self.transport.load_peer(peer.agent_name, peer.record.metadata):
                    why = "errors"
                    self._peer_failed(peer)
                if why is not None:
                    self.counters[why] += 1
                    self._give_worker()
                    blocked.add(node)
                    for other in [x for x in todo if x.peer.node_id == node]:
                        todo.remove(other)
                    continue
                chain = chains[node] = Chain(peer, peer.agent_name)
            wait = self.timeout_s if not chain.groups and len(chains) == 1 else 0.0
            base = self._bounce.acquire(g.total, wait) if g.total else 0
            if base is None:  # no extent now: this peer's remaining sub-batches wait for a later round
                blocked.add(node)
                if not chain.groups:
                    self.counters["bounce_full"] += 1
                    del chains[node]
                    self._give_worker()
                    for other in [x for x in todo if x.peer.node_id == node]:
                        todo.remove(other)
                continue
            g.base = base
            bounce, arena = self._bounce.address + base, chain.peer.record.arena_base
            g.pieces = [
                (a if off is None else bounce + off, arena + e.offset + lo, n)
                for a, off, e, lo, n in zip(g.addrs, g.offs, g.entries, g.lo, g.lens, strict=True)
            ]
            chain.groups.append(g)
            todo.remove(g)
        for chain in chains.values():
            self.counters["direct_gets"] += sum(
                1 for g in chain.groups for s, lo in zip(g.slots, g.lo, strict=True) if s is not None and lo == 0
            )
            nbytes = sum(g.nbytes for g in chain.groups)
            chain.late_after = time.monotonic() + self.timeout_s + nbytes / self.min_read_bytes_per_s
            task = self._pool.submit(self._run_chain, chain)
            task.add_done_callback(lambda _f: self._give_worker())
        return list(chains.values())

    def _take_worker(self, *, first: bool) -> bool:
        with self._lock:
            busy = self._inflight >= self.workers or self._closed
            if not busy:
                self._inflight += 1
        if busy and first:
            self.counters["busy"] += 1
        return not busy

    def _give_worker(self) -> None:
        with self._lock:
            self._inflight -= 1

    def _run_chain(self, chain: Chain) -> None:
        """Worker thread: READ the chain's sub-batches one after the other, each to its end (no
        deadline: the caller stops waiting instead), skipping those not started once the caller
        cancelled; ``tier.close`` cancels the one running."""
        assert self.transport is not None
        for g in chain.groups:
            with chain.lock:
                if not chain.cancelled:
                    g.started = True
            if not g.started:
                g.fut.set_result(None)
                continue
            state = STUCK
            try:
                handle, state = self.transport.start_read(chain.agent, g.pieces)
                pause = POLL_MIN_S
                while state == "PROC":
                    if self._stop_reads.is_set():
                        state = self.transport.end(handle, running=True)
                        handle = None
                        break
                    time.sleep(pause)
                    pause = _POLL_LATE_S if time.monotonic() > chain.late_after else min(2 * pause, POLL_MAX_S)
                    state = self.transport.poll(handle)
                self.transport.end(handle)
            finally:
                g.fut.set_result(state)

    def _collect(
        self, chain: Chain, keys: Sequence[bytes], outs: list[memoryview], res: list[int | None], checks: _Checks
    ) -> None:
        """Wait for the chain's sub-batches in order (each until ``timeout_s + its bytes /
        min_read_bytes_per_s`` after the previous one arrived) and verify each as it arrives; on a
        timeout give the chain up (see the module doc)."""
        ref = time.monotonic()
        for k, g in enumerate(chain.groups):
            deadline = ref + self.timeout_s + g.nbytes / self.min_read_bytes_per_s
            try:
                state = g.fut.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                self._abandon(chain, k, checks)
                return
            ref = time.monotonic()
            self._end(g, state, keys, outs, res, checks, last=k == len(chain.groups) - 1)

    def _abandon(self, chain: Chain, k: int, checks: _Checks) -> None:
        """The caller stops waiting for ``chain`` at its sub-batch ``k``: the later ones are not
        started; the one running (at most one, possibly none any more) keeps its memory — bounce
        extent, and the caller's slots held (never committed, parked once aborted) — until its
        worker saw it end; the peer stays hidden until then. Its chunks are misses (also where a
        later part of one is READ in a later round)."""
        self.counters["timeouts"] += 1
        for g in chain.groups[k:]:
            checks.failed.update(g.idx)
        self._peer_failed(chain.peer)
        with chain.lock:
            chain.cancelled = True
            started = [g for g in chain.groups[k:] if g.started]
        for g in chain.groups[k:]:
            held = self._hold(g) if g in started else []
            if g in started:
                with self._lock:
                    g.peer.late += 1
            g.fut.add_done_callback(lambda f, g=g, held=held: self._late_done(g, held, f.result()))

    def _end(
        self,
        g: Group,
        state: str | None,
        keys: Sequence[bytes],
        outs: list[memoryview],
        res: list[int | None],
        checks: _Checks,
        *,
        last: bool,
    ) -> None:
        """``g``'s READ is over (``state``: DONE, or a failure; nothing more will be written): feed
        each part, in its ``out`` (a bounce part after its copy there: what is checked is what the
        caller gets), to its chunk's xxh3; a chunk whose last part this is is checked against its
        entry (``res`` set on a match). Gives the bounce extent back. ``last``: no READ of this chain
        runs any more, so whole chunks hash on the helper threads too (as on any host with
        :data:`HASH_ALONGSIDE_MIN_CORES` CPUs or more)."""
        assert g.base is not None and self._bounce is not None
        peer = g.peer
        if state != DONE:
            checks.failed.update(g.idx)
            self.counters["stuck" if state == STUCK else "errors"] += 1
            self._peer_failed(peer)
            if state == STUCK:  # a READ NIXL could not cancel (closing) may still write: keep its memory
                self._hold(g)
            elif g.total:
                self._bounce.release(g.base, g.total)
            return
        peer.breaker.success()
        stale: list[tuple[int, Entry]] = []
        whole: list[tuple[int, Entry, memoryview]] = []  # chunks entirely in this group
        try:
            mv = self._bounce.mv
            for i, e, lo, n, off in zip(g.idx, g.entries, g.lo, g.lens, g.offs, strict=True):
                if i in checks.failed:
                    continue
                dst = outs[i][lo : lo + n]
                if off is not None:
                    o = g.base + off
                    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(mv[o : o + n], dtype=np.uint8))
                if lo == 0 and n == e.length:
                    whole.append((i, e, dst))
                    continue
                h = checks.hashers.get(i)
                if h is None:
                    if lo != 0:  # (an earlier part was never hashed: cannot happen, but never a false stale)
                        checks.failed.add(i)
                        continue
                    h = checks.hashers[i] = rec.payload_hasher()
                h.update(dst)  # releases the GIL: the next READ's copy runs meanwhile
                if lo + n == e.length:
                    del checks.hashers[i]
                    if h.intdigest() == e.xxh3:
                        res[i] = e.length
                    else:
                        stale.append((i, e))
            # Whole chunks: on a small host one at a time while a READ of this chain runs (a helper
            # thread would take CPU from its copy); on the helpers too once nothing runs any more.
            dsts = [d for _, _, d in whole]
            alongside = (os.cpu_count() or 1) >= HASH_ALONGSIDE_MIN_CORES
            sums = payload_checksums(dsts) if last or alongside else [rec.payload_checksum(d) for d in dsts]
            for (i, e, _), xxh3 in zip(whole, sums, strict=True):
                if xxh3 == e.xxh3:
                    res[i] = e.length
                else:
                    stale.append((i, e))
        finally:
            if g.total:
                self._bounce.release(g.base, g.total)
        for i, e in stale:
            self.counters["stale"] += 1
            log.info(
                "p2p: chunk %s from %s changed since it was published (slot reused); a miss",
                keys[i][:6].hex(),
                peer.node_id,
            )
            self.directory.drop_stale(keys[i], peer.node_id, e)

    def _hold(self, g: Group) -> list[int]:
        """Hold ``g``'s direct slots in the pool (a READ still running may write them); returns them."""
        held = []
        for slot in g.slots:
            if slot is None:
                continue
            try:
                self.pool.hold(slot)
            except RuntimeError:  # the caller gave its slot up while we read into it: a caller bug
                log.error("p2p: a slot read into was aborted or committed during the READ")
                continue
            held.append(slot)
        return held

    def _late_done(self, g: Group, held: list[int], state: str | None) -> None:
        """A sub-batch of an abandoned chain ended (``state`` None: never started): free its memory
        — unless NIXL could not cancel its READ at close: then it stays reserved for good — and show
        the peer again."""
        assert self._bounce is not None and g.base is not None
        if g.started:
            with self._lock:
                g.peer.late -= 1
        if state == STUCK:
            self.counters["stuck"] += 1
            return
        for slot in held:
            self.pool.unhold(slot)
        if g.total:
            self._bounce.release(g.base, g.total)
