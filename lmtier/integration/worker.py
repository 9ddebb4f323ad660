"""Worker-side data path of lmtier's vLLM connector, without vLLM.

:class:`ConnectorWorker` executes the load and store operations the connector's scheduler side
decides (:class:`LoadOp`, :class:`StoreOp`) against one paged KV cache (a
:class:`lmtier.layout.KVLayout`) and a :class:`lmtier.manager.TierManager`. It imports nothing from
vLLM, so it can be tested on machines without vLLM (the H200 runner) with real CUDA KV tensors in
vLLM's layouts; :class:`lmtier.integration.vllm.connector.LMTierConnector` delegates its worker
hooks to it and keeps the vLLM glue (metadata classes, stats objects, hook names).

Data path:

* **Slots.** ``block_ids[i]`` of an op holds tokens ``[i * block_size, (i + 1) * block_size)``
  (``block_size`` = vLLM's logical block size); chunk ``c`` maps to slots
  ``block * block_size + offset``. With kernel-block splitting (the cache's views have blocks of
  ``layout.block_size < block_size`` tokens) the same slot numbers address the kernel blocks.
* **Loads** (:meth:`ConnectorWorker.load`, synchronous): for each chunk from
  ``start_token // chunk``: a CPU-pool hit is scattered straight from the pinned pool slot (held
  with ``acquire`` while it is read); otherwise the chunk is retrieved from disk/remote into a
  scratch buffer (the manager promotes it into the pool) and scattered from there. Tokens before
  ``start_token`` are never written. The first chunk that cannot be loaded (miss, short read,
  error) ends the op: its blocks (from ``max(chunk start, start_token)``) and every later block
  are returned as failed, and nothing is written into them. Asynchronous loads
  (:meth:`start_load` / :meth:`poll_loads`) fetch every chunk into host memory on a background
  thread and scatter on the calling thread.
* **Stores** (:meth:`ConnectorWorker.store`): each chunk gets a CPU-pool slot (``reserve``; none
  when the chunk is present already or every slot is pinned — skipped), is gathered into it and
  committed, then ``manager.publish`` writes it through to disk / remote. On a CUDA cache the gather
  runs on :class:`lmtier.transfer.CudaTransferEngine`'s side streams after an event recorded on the
  **current (compute) stream** at the time of the call, so the blocks are read after every kernel
  queued before ``store``; the slot is committed (visible to lookups) only when the copy's event
  has completed (:meth:`poll_stores`). Without a CPU pool the chunk is gathered into a scratch
  buffer synchronously and handed to ``manager.store``.
* **Ordering contract (CUDA).** Work queued on the compute stream *after* ``store`` is **not**
  ordered after the copy. The caller must not overwrite the stored blocks until the request's
  stores completed: vLLM keeps a finished request's blocks while :meth:`finished_sending` has not
  reported it (``request_finished`` returns True for requests with CUDA stores), and preempted
  requests' blocks are reused only after ``handle_preemptions``, which calls
  ``poll_stores(block=True)``.

Not thread-safe: one thread (vLLM's worker thread) calls every method; only the background fetch
of asynchronous loads runs elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from lmtier import ops
from lmtier.keys import Namespace, chunk_keys
from lmtier.layout import KVLayout
from lmtier.manager import TierManager

__all__ = ["LoadOp", "StoreOp", "ConnectorWorker", "InjectedFault"]

log = logging.getLogger("vllm.lmtier.connector")


@dataclass
class LoadOp:
    """Load chunks ``[start_token // chunk, len(token_ids) // chunk)`` of a request into its blocks.

    ``token_ids`` is the prompt prefix covering the hit (whole chunks); tokens before
    ``start_token`` are held by vLLM (its prefix cache) and are not written. ``block_ids[i]`` holds
    tokens ``[i * block_size, (i + 1) * block_size)``. ``is_async``: run in the background and
    report through ``finished_recving`` (else before the forward, failures as invalid blocks).
    """

    req_id: str
    token_ids: list[int]
    cache_salt: str | None
    start_token: int
    block_ids: list[int]
    is_async: bool = False
    poisoned: bool = False  # load nothing, report every block as failed (vLLM recomputes them)


@dataclass
class StoreOp:
    """Store chunks ``[first_chunk, len(token_ids) // chunk)`` of a request from its blocks."""

    req_id: str
    token_ids: list[int]
    cache_salt: str | None
    first_chunk: int
    block_ids: list[int]


class InjectedFault(RuntimeError):
    """Raised internally when a fault hook makes a load fail (tests)."""


class _AsyncLoad:
    """State of one background load: the fetch future, its op, and the start time."""

    __slots__ = ("op", "future", "t0", "cancelled")

    def __init__(self, op: LoadOp, future: Future, t0: float):
        self.op, self.future, self.t0, self.cancelled = op, future, t0, False


def _no_faults() -> set[str]:
    return set()


class ConnectorWorker:
    """Executes :class:`LoadOp` / :class:`StoreOp` between one paged KV cache and lmtier's tiers.

    Args:
        layout: the paged cache (CPU or one CUDA device), e.g. from
            :meth:`KVLayout.from_layer_views` over the tensors vLLM passes to ``register_kv_caches``.
        manager: the tiers. Stores go into ``manager.cpu`` when it exists (else through
            ``manager.store``); loads read the pool first, then ``manager.retrieve_into``.
        chunk_size: tokens per chunk (a multiple of ``block_size``).
        block_size: vLLM's (logical) block size: tokens per entry of an op's ``block_ids``.
        namespace: this rank's key space (chunk keys of every op); its ``chunk_bytes`` must equal
            ``layout.chunk_bytes(chunk_size)``.
        index_namespace: the key space reported to ``on_stored`` (rank 0's, the scheduler's index);
            default ``namespace``.
        on_stat: ``on_stat(name, value)`` for counters and latencies (names of
            ``LMTierStats``: ``loaded_chunks``, ``loaded_bytes``, ``load_failures``, ``load_ms``,
            ``load_lat_s``, ``async_loads``, ``stored_chunks``, ``stored_bytes``, ``store_skipped``,
            ``store_ms``, ``store_lat_s``).
        on_stored: ``on_stored(key, index_key, tier)`` once a chunk is committed (``tier`` is
            ``"cpu"``, or ``"disk"`` without a CPU pool).
        faults: returns the active fault names (``load``, ``load_sync``, ``load_async``: those
            chunk loads fail); test hook, default none.
        load_threads: background threads for asynchronous loads (created on first use).

    Raises:
        ValueError: the cache's chunk size in bytes differs from the namespace's, or sizes are invalid.

    Attributes (read-only for callers): ``pending`` (req id -> CUDA stores in flight), ``delayed``
    (finished requests whose blocks are held until their stores complete), ``async_loads``
    (req id -> background load in flight).
    """

    def __init__(self, layout: KVLayout, manager: TierManager, *, chunk_size: int, block_size: int,
                 namespace: Namespace, index_namespace: Namespace | None = None,
                 on_stat: Callable[[str, float], None] | None = None,
                 on_stored: Callable[[bytes, bytes, str], None] | None = None,
                 faults: Callable[[], set[str]] | None = None, load_threads: int = 2) -> None:
        if chunk_size <= 0 or block_size <= 0 or chunk_size % block_size:
            raise ValueError(f"lmtier: chunk_size {chunk_size} must be a positive multiple of block_size {block_size}")
        cb = layout.chunk_bytes(chunk_size)
        if cb != namespace.chunk_bytes:
            raise ValueError(f"lmtier: chunk bytes {cb} from the KV tensors differ from the namespace's "
                             f"{namespace.chunk_bytes}")
        self.layout = layout
        self.manager = manager
        self.chunk = chunk_size
        self.block_size = block_size
        self.ns = namespace
        self.index_ns = index_namespace if index_namespace is not None else namespace
        self.chunk_bytes = cb
        self._stat = on_stat or (lambda name, value=1: None)
        self._on_stored = on_stored or (lambda key, key0, tier: None)
        self._faults = faults or _no_faults
        self._load_threads = load_threads
        self.is_cuda = layout.device.type == "cuda"
        self.scratch = torch.empty(cb, dtype=torch.uint8, pin_memory=self.is_cuda)
        self.store_engine = self.load_engine = None
        if self.is_cuda:
            from lmtier.transfer import CudaTransferEngine

            self.store_engine = CudaTransferEngine(layout, chunk_size)
            self.load_engine = CudaTransferEngine(layout, chunk_size)
        self.pending: dict[str, list[tuple[Any, Any, bytes, bytes]]] = {}  # req -> [(event, slot, key, key0)]
        self.delayed: set[str] = set()
        self.async_loads: dict[str, _AsyncLoad] = {}
        self._finished_seen: set[str] = set()
        self._load_pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------------------ helpers
    def slot_mapping(self, block_ids: list[int], chunk_index: int, start_token: int = 0) -> torch.Tensor:
        """Slot mapping ``[1, chunk]`` (int64, CPU) of chunk ``chunk_index``; tokens before ``start_token`` are -1."""
        t = torch.arange(chunk_index * self.chunk, (chunk_index + 1) * self.chunk, dtype=torch.int64)
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)[t // self.block_size]
        slots = blocks * self.block_size + t % self.block_size
        slots[t < start_token] = -1
        return slots.view(1, -1)

    def keys(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """This rank's chunk keys of ``token_ids`` (whole chunks only)."""
        return chunk_keys(token_ids, self.ns, cache_salt=cache_salt)

    def scatter(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Write one canonical chunk ``src`` (uint8, CPU) into the cache at ``slots``; returns when done."""
        if self.load_engine is not None:
            if not src.is_pinned():
                src = src.pin_memory()
            self.load_engine.load(slots, [src]).synchronize()
        else:
            ops.scatter(self.layout, slots, [src])

    def _failed_from(self, op: LoadOp, chunk_index: int) -> list[int]:
        first_block = max(chunk_index * self.chunk, op.start_token) // self.block_size
        return op.block_ids[first_block:]

    # ------------------------------------------------------------------------------ sync loads
    def load(self, op: LoadOp) -> set[int]:
        """Load ``op`` now (before the forward). Returns the block ids that were not loaded.

        A poisoned op loads nothing and returns every block from ``start_token``. Otherwise chunks
        load in order until one fails; that chunk's blocks (from ``start_token`` when it lies
        inside) and all later blocks are returned, and nothing is written into them.
        """
        if op.poisoned:
            self._stat("load_failures")
            return set(op.block_ids[op.start_token // self.block_size:])
        failed: set[int] = set()
        t0 = time.perf_counter()
        keys = self.keys(op.token_ids, op.cache_salt)
        for ci in range(op.start_token // self.chunk, len(keys)):
            ok = False
            try:
                if self._faults() & {"load", "load_sync"}:
                    raise InjectedFault("sync load")
                ok = self.load_chunk(keys[ci], self.slot_mapping(op.block_ids, ci, op.start_token))
            except InjectedFault:
                log.warning("lmtier: injected fault: load of chunk %d of request %s fails", ci, op.req_id)
            except Exception:
                log.exception("lmtier: load of chunk %d of request %s failed", ci, op.req_id)
            if not ok:
                failed.update(self._failed_from(op, ci))
                self._stat("load_failures")
                break
            self._stat("loaded_chunks")
            self._stat("loaded_bytes", self.chunk_bytes)
        dt = time.perf_counter() - t0
        self._stat("load_ms", dt * 1e3)
        self._stat("load_lat_s", dt)
        return failed

    def load_chunk(self, key: bytes, slots: torch.Tensor) -> bool:
        """Scatter chunk ``key`` into ``slots`` from the fastest tier; False (nothing written) on a miss."""
        cb = self.chunk_bytes
        cpu = self.manager.cpu
        slot = cpu.acquire(key) if cpu is not None else None
        try:
            if slot is not None:
                if slot.nbytes < cb:
                    return False
                src = slot.view[:cb]
            else:
                n = self.manager.retrieve_into(key, self.scratch)
                if n != cb:
                    return False
                src = self.scratch[:cb]
            self.scatter(slots, src)
            return True
        finally:
            if slot is not None:
                cpu.release(slot)

    # ------------------------------------------------------------------------------ async loads
    def start_load(self, op: LoadOp) -> None:
        """Start fetching ``op``'s chunks into host memory on a background thread (see :meth:`poll_loads`)."""
        if op.req_id in self.async_loads:  # cannot happen (one load per admission); never report twice
            log.error("lmtier: request %s already has an async load in flight; ignoring the second", op.req_id)
            return
        if self._load_pool is None:
            self._load_pool = ThreadPoolExecutor(self._load_threads, thread_name_prefix="lmtier-load")
        self._stat("async_loads")
        self.async_loads[op.req_id] = _AsyncLoad(op, self._load_pool.submit(self._fetch, op), time.perf_counter())

    def _fetch(self, op: LoadOp) -> tuple[list[tuple[int, torch.Tensor, Any]], bool]:
        """Background thread: bring every chunk of ``op`` into host memory.

        Returns ``(chunks, ok)``: ``chunks`` = ``[(chunk_index, uint8 tensor of chunk_bytes, pinned CPU
        slot or None)]`` for the leading chunks that arrived; ``ok`` False if one failed (then
        ``chunks`` stops before it). Read slots stay pinned until the worker thread scattered them.
        """
        cb = self.chunk_bytes
        cpu = self.manager.cpu
        out: list[tuple[int, torch.Tensor, Any]] = []
        if op.poisoned:
            return out, False
        keys = self.keys(op.token_ids, op.cache_salt)
        try:
            for ci in range(op.start_token // self.chunk, len(keys)):
                if self._faults() & {"load", "load_async"}:
                    log.warning("lmtier: injected fault: async load of chunk %d of request %s fails", ci, op.req_id)
                    return out, False
                slot = cpu.acquire(keys[ci]) if cpu is not None else None
                if slot is not None:
                    if slot.nbytes < cb:
                        cpu.release(slot)
                        return out, False
                    out.append((ci, slot.view[:cb], slot))
                    continue
                buf = torch.empty(cb, dtype=torch.uint8, pin_memory=self.is_cuda)
                n = self.manager.retrieve_into(keys[ci], buf)  # promotes into the CPU pool
                if n != cb:
                    return out, False
                out.append((ci, buf, None))
            return out, True
        except Exception:
            log.exception("lmtier: async load of request %s failed", op.req_id)
            return out, False

    def poll_loads(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        """Scatter the background loads that completed; returns ``(finished, failed)`` request ids.

        A failed load is in both sets (vLLM's ``finished_recving`` / ``failed_recving``) and writes
        nothing. ``finished_req_ids``: requests vLLM finished (aborted); their loads are completed
        without writing (nothing reads those blocks) and reported as finished, not failed.
        """
        self._finished_seen |= set(finished_req_ids)
        done: set[str] = set()
        failed: set[str] = set()
        for rid, a in list(self.async_loads.items()):
            if not a.future.done():
                continue
            del self.async_loads[rid]
            chunks, ok = a.future.result()
            cpu = self.manager.cpu
            try:
                if rid in self._finished_seen:  # aborted while loading: nothing reads these blocks
                    ok = True
                else:
                    for ci, src, _slot in chunks if ok else ():
                        self.scatter(self.slot_mapping(a.op.block_ids, ci, a.op.start_token), src)
                        self._stat("loaded_chunks")
                        self._stat("loaded_bytes", self.chunk_bytes)
            except Exception:
                log.exception("lmtier: scatter of async load of request %s failed", rid)
                ok = False
            finally:
                for _ci, _src, slot in chunks:
                    if slot is not None:
                        cpu.release(slot)
            dt = time.perf_counter() - a.t0
            self._stat("load_lat_s", dt)
            self._stat("load_ms", dt * 1e3)
            done.add(rid)
            if not ok:
                self._stat("load_failures")
                failed.add(rid)
        self._finished_seen.intersection_update(self.async_loads)  # keep ids of loads still in flight only
        return done, failed

    # ------------------------------------------------------------------------------ stores
    def store(self, op: StoreOp) -> None:
        """Store chunks ``[op.first_chunk, len(op.token_ids) // chunk)`` from ``op.block_ids``.

        CPU cache: gathered and committed before returning. CUDA cache: the gather is queued on side
        streams after the current stream's work, and the chunk is committed by :meth:`poll_stores`
        once it arrived (until then the request is in ``pending``; do not reuse its blocks). A
        failing chunk is dropped (logged), never made visible.
        """
        cpu = self.manager.cpu
        cb = self.chunk_bytes
        t0 = time.perf_counter()
        keys = self.keys(op.token_ids, op.cache_salt)
        keys0 = keys if self.index_ns == self.ns else chunk_keys(op.token_ids, self.index_ns, cache_salt=op.cache_salt)
        for ci in range(op.first_chunk, len(keys)):
            key = keys[ci]
            slots = self.slot_mapping(op.block_ids, ci)
            try:
                if cpu is None:
                    if self.store_engine is None:
                        ops.gather(self.layout, slots, [self.scratch])
                    else:
                        self.store_engine.store(slots, [self.scratch]).synchronize()
                    if self.manager.store(key, self.scratch, timeout_s=None).result():
                        self._on_stored(key, keys0[ci], "disk")
                        self._stat("stored_chunks")
                        self._stat("stored_bytes", cb)
                    continue
                slot = cpu.reserve(key)
                if slot is None:  # present already, or every slot pinned (back-pressure)
                    self._stat("store_skipped")
                    continue
                try:
                    dst = slot.view[:cb]
                    if self.store_engine is not None:
                        ev = self.store_engine.store(slots, [dst])
                        self.pending.setdefault(op.req_id, []).append((ev, slot, key, keys0[ci]))
                        continue
                    ops.gather(self.layout, slots, [dst])
                except BaseException:
                    cpu.abort(slot)
                    raise
                self._commit(slot, key, keys0[ci])
            except Exception:
                log.exception("lmtier: store of chunk %d of request %s failed (dropped)", ci, op.req_id)
        dt = time.perf_counter() - t0
        self._stat("store_ms", dt * 1e3)
        self._stat("store_lat_s", dt)

    def _commit(self, slot: Any, key: bytes, key0: bytes) -> None:
        self.manager.cpu.commit(slot, self.chunk_bytes)
        self._on_stored(key, key0, "cpu")
        self.manager.publish(key)
        self._stat("stored_chunks")
        self._stat("stored_bytes", self.chunk_bytes)

    def poll_stores(self, *, block: bool = False) -> None:
        """Commit the CUDA stores whose copy completed (``block``: wait for all of them first)."""
        for rid in list(self.pending):
            keep = []
            for ev, slot, key, key0 in self.pending[rid]:
                if block:
                    ev.synchronize()
                if ev.query():
                    self._commit(slot, key, key0)
                else:
                    keep.append((ev, slot, key, key0))
            if keep:
                self.pending[rid] = keep
            else:
                del self.pending[rid]

    def finished_sending(self, delayed_frees: Iterable[str] = ()) -> set[str]:
        """Requests whose blocks may be freed now.

        ``delayed_frees``: finished requests whose blocks vLLM keeps for us (``request_finished``
        returned True); they are remembered and returned (once) when none of their stores is in
        flight any more. Polls the CUDA stores first.
        """
        self.delayed.update(delayed_frees)
        if self.store_engine is not None:
            self.poll_stores()
        sending: set[str] = set()
        if self.delayed:
            sending = {r for r in self.delayed if r not in self.pending}
            self.delayed -= sending
        return sending

    def idle(self) -> bool:
        """No load or store in flight and no held request left."""
        return not self.async_loads and not self.pending and not self.delayed

    def close(self) -> None:
        """Wait for background loads and CUDA stores (committing the stores). Idempotent."""
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=True)
        if self.store_engine is not None:
            self.poll_stores(block=True)
