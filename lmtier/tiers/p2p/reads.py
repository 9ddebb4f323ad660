"""The P2P tier's reads: one batch of chunks from peers' pools. :class:`PeerReads` is a mixin of
:class:`~lmtier.tiers.p2p.tier.P2PTier` (which owns the attributes it uses); the safety argument is
in that module's doc.

A batch: one directory lookup (``_choose``), the chunks grouped by peer and cut into sub-batches
(about a quarter of the bytes, >= 8 MiB), one NIXL READ per sub-batch. A peer's sub-batches form a
:class:`Chain` that one worker thread READs back to back (peers in parallel, up to ``workers`` chains
for the whole tier), while the calling thread verifies each sub-batch as soon as it arrived — so the
verification overlaps the next transfer. (Measured here, nixl-cu12 1.5.1, UCX over TCP: ``transfer()``
itself moves the data before it returns ``DONE``, so READs overlap only on separate threads, and
concurrent READs from one peer share its link and end together.) A chunk whose destination is a slot
of this node's pool being written is READ straight into it; any other destination through the
registered bounce region. A sub-batch still running at its deadline (``timeout_s + bytes /
min_read_bytes_per_s`` after the previous one arrived) is not cancelled: its chunks and those of the
chain's later sub-batches are misses, the later ones are never started, and the running READ's
destination stays reserved (bounce extent; slots held) until its worker saw it end.

Logging: ``logging.getLogger("lmtier.tiers.p2p")``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lmtier.tiers.buffers import address_of, round_up
from lmtier.tiers.checksums import payload_checksums
from lmtier.tiers.mooncake.bounce import ALIGN
from lmtier.tiers.p2p.transport import DONE, POLL_MAX_S, POLL_MIN_S, STUCK, NixlTransport

if TYPE_CHECKING:
    from lmtier.tiers.p2p.directory import Entry

__all__ = ["PeerReads", "Group", "Chain", "MIN_READ_BYTES"]

log = logging.getLogger("lmtier.tiers.p2p")

MIN_READ_BYTES = 8 << 20
"""Smallest sub-batch a batch of reads is cut into (one NIXL transfer each)."""
_POLL_LATE_S = 10e-3


@dataclass(eq=False)
class Group:
    """The chunks one READ moves from one peer: caller indices, entries, and where each lands — a
    pool slot the caller reserved (``slots[j]``, its address ``addrs[j]``) or an offset into this
    group's bounce extent (``offs[j]``, ``total`` bounce bytes). ``fut``: its READ's end state
    (None: never started)."""

    peer: Any
    idx: list[int] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
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
        while todo:
            chains = self._start_chains(todo)
            if not chains:  # nothing could start with nothing of ours in flight: the rest miss
                break
            for chain in chains:
                self._collect(chain, keys, outs, res)
        n_hit = sum(1 for n in res if n is not None)
        self.counters["hits"] += n_hit
        self.counters["misses"] += len(keys) - n_hit
        return res

    def _groups(self, choice: list, outs: list[memoryview]) -> collections.deque[Group]:
        """The sub-batches (about a quarter of the bytes, >= 8 MiB; bounce share <= half the region)
        of the chosen chunks, per peer, in order."""
        total = sum(round_up(c[1].length, ALIGN) for c in choice if c is not None)
        limit = max(MIN_READ_BYTES, -(-total // 4))
        half = self._bounce.nbytes // 2
        open_groups: dict[str, Group] = {}
        todo: collections.deque[Group] = collections.deque()
        for i, c in enumerate(choice):
            if c is None:
                continue
            peer, e = c
            n = round_up(e.length, ALIGN)
            if e.length > outs[i].nbytes or n > self._bounce.nbytes:
                log.warning("p2p get_into: out has %d bytes, chunk has %d", outs[i].nbytes, e.length)
                continue
            addr = address_of(outs[i])
            slot = self._direct_slot(addr, e.length)
            g = open_groups.get(peer.node_id)
            if g is None or (g.idx and (g.nbytes + n > limit or (slot is None and g.total + n > half))):
                g = open_groups[peer.node_id] = Group(peer)
                todo.append(g)
            g.idx.append(i)
            g.entries.append(e)
            g.slots.append(slot)
            g.addrs.append(addr)
            if slot is None:
                g.offs.append(g.total)
                g.total += n
            else:
                g.offs.append(None)
            g.nbytes += n
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
                (a if off is None else bounce + off, arena + e.offset, e.length)
                for a, off, e in zip(g.addrs, g.offs, g.entries, strict=True)
            ]
            chain.groups.append(g)
            todo.remove(g)
        for chain in chains.values():
            self.counters["direct_gets"] += sum(1 for g in chain.groups for s in g.slots if s is not None)
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

    def _collect(self, chain: Chain, keys: Sequence[bytes], outs: list[memoryview], res: list[int | None]) -> None:
        """Wait for the chain's sub-batches in order (each until ``timeout_s + its bytes /
        min_read_bytes_per_s`` after the previous one arrived) and verify each as it arrives; on a
        timeout give the chain up (see the module doc)."""
        ref = time.monotonic()
        for k, g in enumerate(chain.groups):
            deadline = ref + self.timeout_s + g.nbytes / self.min_read_bytes_per_s
            try:
                state = g.fut.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                self._abandon(chain, k)
                return
            ref = time.monotonic()
            self._end(g, state, keys, outs, res)

    def _abandon(self, chain: Chain, k: int) -> None:
        """The caller stops waiting for ``chain`` at its sub-batch ``k``: the later ones are not
        started; the one running (at most one, possibly none any more) keeps its memory — bounce
        extent, and the caller's slots held (never committed, parked once aborted) — until its
        worker saw it end; the peer stays hidden until then. Its chunks are misses."""
        self.counters["timeouts"] += 1
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
        self, g: Group, state: str | None, keys: Sequence[bytes], outs: list[memoryview], res: list[int | None]
    ) -> None:
        """``g``'s READ is over (``state``: DONE, or a failure; nothing more will be written): verify
        each chunk against its entry in its ``out`` (a bounce chunk after its copy there: what is
        checked is what the caller gets) and give the bounce extent back."""
        assert g.base is not None and self._bounce is not None
        peer = g.peer
        if state != DONE:
            self.counters["stuck" if state == STUCK else "errors"] += 1
            self._peer_failed(peer)
            if state == STUCK:  # a READ NIXL could not cancel (closing) may still write: keep its memory
                self._hold(g)
            elif g.total:
                self._bounce.release(g.base, g.total)
            return
        peer.breaker.success()
        stale: list[tuple[int, Entry]] = []
        try:
            mv = self._bounce.mv
            dsts = [outs[i][: e.length] for i, e in zip(g.idx, g.entries, strict=True)]
            for dst, off, e in zip(dsts, g.offs, g.entries, strict=True):
                if off is not None:
                    o = g.base + off
                    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(mv[o : o + e.length], dtype=np.uint8))
            for i, e, xxh3 in zip(g.idx, g.entries, payload_checksums(dsts), strict=True):
                if xxh3 != e.xxh3:
                    stale.append((i, e))
                    continue
                res[i] = e.length
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
