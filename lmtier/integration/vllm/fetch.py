"""Bringing a load's chunks into host memory: CPU-pool hits pinned, the others fetched in parallel.

:class:`ChunkFetcher` is the part of :class:`lmtier.integration.vllm.worker.ConnectorWorker`'s load
path that talks to the tiers. For each chunk of a load it pins a CPU-pool hit (``acquire``), or
fetches the chunk from disk/remote on its I/O threads — several reads in flight — straight into a
CPU-pool slot reserved for it (promotion without a second copy; committed once the chunk is
released) or, when no slot can be reserved, into a reused staging buffer. Every chunk it hands out
must be given back through :meth:`ChunkFetcher.finish`.

This module imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from lmtier.manager import TierManager

__all__ = ["Chunk", "ChunkFetcher", "InjectedFault"]

log = logging.getLogger("vllm.lmtier.connector")


class InjectedFault(RuntimeError):
    """Raised internally when a fault hook makes a load fail (tests)."""


class Chunk:
    """One chunk of a load: where its bytes are and what holds them until it is scattered.

    ``src`` (uint8 CPU tensor of ``chunk_bytes``) is set once the bytes are in host memory, held by
    exactly one of: ``read`` (a pinned CPU-pool read handle: a pool hit), ``write`` (a CPU-pool slot
    reserved for promotion, filled from disk/remote, committed after the scatter) or ``staging``
    (a worker staging buffer, when no slot could be reserved). ``future``: the background fetch
    while it runs; ``ok``: ``None`` (not known yet), True (bytes ready) or False (miss/failure).
    """

    __slots__ = ("ci", "key", "src", "read", "write", "staging", "future", "ok")

    def __init__(self, ci: int, key: bytes | None) -> None:
        self.ci, self.key = ci, key
        self.src = self.read = self.write = self.staging = self.future = None
        self.ok: bool | None = None


class ChunkFetcher:
    """Fetches chunks of ``chunk_bytes`` bytes from ``manager``'s tiers into host memory.

    Args:
        manager: the tiers; ``manager.cpu`` (the CPU pool) may be None.
        chunk_bytes: bytes of one chunk of this rank (canonical record payload).
        io_threads: threads fetching chunks from disk/remote, one chunk each (created on first use).
        pin_staging: allocate staging buffers in pinned memory (a CUDA cache reads them).
        faults: returns the active fault names (test hook; see :meth:`plan`).
        on_stored: ``on_stored(key, index_key, "cpu")`` when a promoted chunk was committed.

    Thread-safe: :meth:`plan` / :meth:`resolve` / :meth:`finish` of different loads may run on
    different threads (the worker thread, the background load threads).
    """

    def __init__(self, manager: TierManager, *, chunk_bytes: int, io_threads: int, pin_staging: bool,
                 faults: Callable[[], set[str]], on_stored: Callable[[bytes, bytes, str], None]) -> None:
        self.manager = manager
        self.chunk_bytes = chunk_bytes
        self._faults = faults
        self._on_stored = on_stored
        self._pin = pin_staging
        self._io_threads = io_threads
        self._io_pool: ThreadPoolExecutor | None = None
        # Staging buffers for fetched chunks that get no pool slot (no pool, or every slot pinned):
        # reused, at most one per I/O thread kept, so the load path allocates nothing once warm.
        self._staging: list[torch.Tensor] = []
        self._staging_lock = threading.Lock()
        self._staging_max = io_threads

    def close(self) -> None:
        """Wait for the I/O threads (fetches in flight finish). Idempotent."""
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=True)

    def _io(self) -> ThreadPoolExecutor:
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="lmtier-io")
        return self._io_pool

    def _staging_get(self) -> torch.Tensor:
        with self._staging_lock:
            if self._staging:
                return self._staging.pop()
        self.manager.count("load_staging_allocs")
        return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pin)

    def _staging_put(self, buf: torch.Tensor) -> None:
        with self._staging_lock:
            if len(self._staging) < self._staging_max:
                self._staging.append(buf)

    # ------------------------------------------------------------------------------ chunk fetches
    def plan(self, req_id: str, first_chunk: int, keys: list[bytes], fault_names: set[str]) -> list[Chunk]:
        """Chunks ``[first_chunk, len(keys))`` of request ``req_id``, in order: CPU-pool hits pinned now,
        the others fetched from disk/remote on the I/O threads (several in flight). Stops after
        the first chunk known to fail (an injected fault, a short pool entry), which is returned
        with ``ok = False``. Every returned chunk must go through :meth:`finish`.

        ``fault_names``: this load fails at its first chunk when one of them is active (test hook)."""
        cb = self.chunk_bytes
        cpu = self.manager.cpu
        chunks: list[Chunk] = []
        for ci in range(first_chunk, len(keys)):
            c = Chunk(ci, keys[ci])
            chunks.append(c)
            try:
                if self._faults() & fault_names:
                    raise InjectedFault(f"load of chunk {ci} of request {req_id}")
                slot = cpu.acquire(keys[ci]) if cpu is not None else None
                if slot is not None:
                    c.read = slot
                    c.ok = slot.nbytes >= cb
                    if c.ok:
                        c.src = slot.view[:cb]
            except InjectedFault as e:
                log.warning("lmtier: injected fault: %s fails", e)
                c.ok = False
            except Exception:
                log.exception("lmtier: load of chunk %d of request %s failed", ci, req_id)
                c.ok = False
            if c.ok is False:
                break
        # Fetch the others only now that every pool hit is pinned: a fetch's slot reservation may
        # evict, and must not evict a chunk this load is about to read.
        for c in chunks:
            if c.ok is None:
                # Not in the pool (a disk/remote hit, or a pool hit evicted since the scheduler
                # looked: the write-through copy on disk usually still has it).
                try:
                    c.future = self._io().submit(self._fetch_chunk, c.key)
                except Exception:
                    log.exception("lmtier: load of chunk %d of request %s failed", c.ci, req_id)
                    c.ok = False
        return chunks

    def _fetch_chunk(self, key: bytes) -> Chunk | None:
        """I/O thread: bring chunk ``key`` from disk/remote into host memory, straight into a
        reserved CPU-pool slot (promotion without a second copy) or, when none can be reserved, a
        staging buffer. Returns the filled chunk (``ci`` unset) or None on a miss."""
        cb = self.chunk_bytes
        cpu = self.manager.cpu
        c = Chunk(-1, key)
        try:
            if cpu is not None:
                c.write = cpu.reserve(key)
                if c.write is None:  # being written or committed by someone else meanwhile, or pool full
                    c.read = cpu.acquire(key)
                    if c.read is not None:
                        if c.read.nbytes < cb:
                            cpu.release(c.read)
                            return None
                        c.src, c.ok = c.read.view[:cb], True
                        return c
            if c.write is not None:
                dst = c.write.view[:cb]
            else:
                c.staging = dst = self._staging_get()
            if self.manager.fetch_lower(key, dst) != cb:
                self._drop_fetched(c)
                return None
            c.src, c.ok = dst, True
            return c
        except BaseException:
            self._drop_fetched(c)
            raise

    def _drop_fetched(self, c: Chunk) -> None:
        """Give back what an unsuccessful fetch holds (nothing becomes visible)."""
        cpu = self.manager.cpu
        if c.write is not None:
            cpu.abort(c.write)
            c.write = None
        if c.read is not None:
            cpu.release(c.read)
            c.read = None
        if c.staging is not None:
            self._staging_put(c.staging)
            c.staging = None

    def resolve(self, c: Chunk, *, block: bool) -> bool | None:
        """Whether chunk ``c``'s bytes are ready (True), failed (False) or still in flight (None,
        only when not ``block``)."""
        if c.ok is None:
            f = c.future
            if not block and not f.done():
                return None
            try:
                got = f.result()
            except Exception:
                log.exception("lmtier: fetch of chunk %d failed", c.ci)
                got = None
            if got is None:
                c.ok = False
            else:
                c.src, c.read, c.write, c.staging, c.ok = got.src, got.read, got.write, got.staging, True
        return c.ok

    def finish(self, c: Chunk, key0: Callable[[], list[bytes]]) -> None:
        """Release what chunk ``c`` holds (waiting for its fetch first). A promotion slot that was
        filled is committed — its bytes are a verified chunk, scattered or not — and reported to
        the index (``on_stored(..., "cpu")``) so later hits load it from the pool."""
        if c.ok is None:
            self.resolve(c, block=True)
        cpu = self.manager.cpu
        if c.read is not None:
            cpu.release(c.read)
            c.read = None
        if c.write is not None:
            slot, c.write = c.write, None
            if c.ok:
                try:
                    self.manager.commit(slot, self.chunk_bytes, promoted=True)
                except Exception:
                    log.exception("lmtier: commit of a promoted chunk failed")
                    cpu.abort(slot)
                else:
                    self._on_stored(c.key, key0()[c.ci], "cpu")
            else:
                cpu.abort(slot)
        if c.staging is not None:
            self._staging_put(c.staging)
            c.staging = None
        c.src = None
