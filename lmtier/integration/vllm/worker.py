"""Worker-side data path of lmtier's vLLM connector, without vLLM.

:class:`ConnectorWorker` executes the load and store operations the connector's scheduler side
decides (:class:`LoadOp`, :class:`StoreOp`) against one paged KV cache (a
:class:`lmtier.layout.KVLayout`) and a :class:`lmtier.manager.TierManager`. It imports nothing from
vLLM, so it can be tested on machines without vLLM (the H200 runner) with real CUDA KV tensors in
vLLM's layouts; the connector's worker role (:class:`lmtier.integration.vllm.worker_role.LMTierWorker`)
translates vLLM's hooks into its calls. Fetching chunks from the tiers is
:class:`lmtier.integration.vllm.fetch.ChunkFetcher`'s job, storing them
:class:`lmtier.integration.vllm.stores.ChunkStorer`'s, and layer-by-layer loads
:class:`lmtier.integration.vllm.layerwise.LayerwiseLoader`'s; this module keeps the load primitives
they share (keys, slot mappings, the fetcher's plan, host and device scatters), the synchronous and
asynchronous loads, and the request bookkeeping.

Data path (slots, sync / layer-by-layer / async loads, device decode, stores, the CUDA ordering
contract): docs/connector_worker.md.

Not thread-safe: one thread (vLLM's worker thread) calls every method; only the chunk fetches
(I/O threads) and the coordination of asynchronous loads run elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor

import torch

from lmtier import ops
from lmtier.affinity import unpin_thread
from lmtier.integration.vllm.fetch import (
    DEFAULT_FETCH_BATCH,
    Chunk,
    ChunkFetcher,
    InjectedFault,
    lower_tiers_are_codec,
)
from lmtier.integration.vllm.layerwise import LayerwiseLoader
from lmtier.integration.vllm.loadpolicy import BusyMeter
from lmtier.integration.vllm.loadstore import (
    AsyncLoad,
    LoadOp,
    StoreOp,
    lazy_once,
    no_faults,
)
from lmtier.integration.vllm.logs import RateLimitedWarning
from lmtier.integration.vllm.stores import ChunkStorer
from lmtier.keys import KeyScope, Namespace, chunk_keys
from lmtier.layout import KVLayout
from lmtier.manager import TierManager
from lmtier.tiers.tenants import tenant_id

__all__ = ["ConnectorWorker", "InjectedFault", "LoadOp", "StoreOp"]

log = logging.getLogger("vllm.lmtier.connector")

FAILED_LOAD_WHY = (
    "a chunk the index named was not read from any tier (a miss, a timeout or an unusable record; the "
    "tier's log lines and counters say which); vLLM recomputes the request's blocks from there, or with "
    "load_failure_policy: fail ends it with finish_reason 'error'"
)
"""The failed-load warning's explanation (:class:`~lmtier.integration.vllm.logs.RateLimitedWarning`,
at most one warning per 30 s)."""


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
            ``load_lat_s``, ``async_loads``, ``layerwise_loads``, ``stored_chunks``, ``stored_bytes``,
            ``store_skipped``,
            ``store_ms``, ``store_lat_s``, ``device_decoded_chunks``: chunks of the device-decode path).
        on_stored: ``on_stored(key, index_key, tier)`` once a chunk is committed: ``tier`` is
            ``"cpu"``, or without a CPU pool ``"disk"`` (or ``"remote"`` without a disk tier).
        on_load_failed: ``on_load_failed(index_keys)`` of the chunks a failed load did not deliver
            (:meth:`load_failed`).
        faults: returns the active fault names (``load``, ``load_sync``, ``load_async``: those
            chunk loads fail); test hook, default none.
        load_threads: background threads coordinating asynchronous loads (created on first use).
        io_threads: threads fetching chunks from disk/remote, one chunk each, so several reads are
            in flight per load (created on first use).
        layer_stream_priority: CUDA stream priority of the layer-by-layer load's copies (None: the
            highest the device offers, so the scatter kernels are not starved by the forward they
            overlap; see benchmarks/bench_layerwise.py).
        layers_per_wait: layers per event of a layer-by-layer load on CUDA (the forward's layer ``l``
            waits for its group of layers; default ``max(1, num_layers // 8)``: fewer, larger
            copies — one layer per event pays a per-copy cost that outweighs the finer overlap,
            benchmarks/RESULTS.md).
        decode_on: where chunks fetched from disk/remote land: ``"host"`` (CPU-pool slots or host
            staging: codec records decoded on the CPU), ``"device"`` (device staging on the
            cache's device: the GPU decodes codec records; on a CPU cache the same pipeline with
            host buffers) or ``"auto"`` (``"device"`` for a CUDA cache whose lower tiers are all
            codec tiers, else ``"host"``).
        device_window: device staging buffers (``chunk_bytes`` each) in flight at most (default
            ``2 * io_threads``).
        max_staging_bytes: host staging buffers kept for reuse (loads without pool slots).
        fetch_batch: chunks one I/O task fetches together when the P2P or the remote tier batches gets
            (:class:`~lmtier.integration.vllm.fetch.ChunkFetcher`).
        load_meter: measures the load bandwidth of each tier
            (:class:`~lmtier.integration.vllm.loadpolicy.BusyMeter`): the manager's lower-tier reads
            (:meth:`lmtier.manager.TierManager.set_load_meter`) and, as tier ``"cpu"`` path
            ``"scatter"``, the copies from host memory into the cache. None: not measured.

    Raises:
        ValueError: the cache's chunk size in bytes differs from the namespace's, sizes are invalid,
            or ``decode_on="device"`` on a CUDA cache with a lower tier that is not a codec tier.

    Attributes (read-only for callers): ``pending`` (req id -> CUDA stores in flight), ``delayed``
    (finished requests whose blocks are held until their stores complete), ``async_loads``
    (req id -> background load in flight), ``device_staging`` (the device-decode path is on),
    ``decode_stream`` (its CUDA stream, None on a CPU cache).
    """

    def __init__(
        self,
        layout: KVLayout,
        manager: TierManager,
        *,
        chunk_size: int,
        block_size: int,
        namespace: Namespace,
        index_namespace: Namespace | None = None,
        on_stat: Callable[[str, float], None] | None = None,
        on_stored: Callable[[bytes, bytes, str], None] | None = None,
        on_load_failed: Callable[[list[bytes]], None] | None = None,
        faults: Callable[[], AbstractSet[str]] | None = None,
        load_threads: int = 2,
        io_threads: int = 4,
        layer_stream_priority: int | None = None,
        layers_per_wait: int | None = None,
        decode_on: str = "auto",
        device_window: int | None = None,
        max_staging_bytes: int = 1 << 30,
        fetch_batch: int = DEFAULT_FETCH_BATCH,
        load_meter: BusyMeter | None = None,
    ) -> None:
        if load_threads < 1 or io_threads < 1:
            raise ValueError(f"lmtier: load_threads ({load_threads}) and io_threads ({io_threads}) must be >= 1")
        if chunk_size <= 0 or block_size <= 0 or chunk_size % block_size:
            raise ValueError(f"lmtier: chunk_size {chunk_size} must be a positive multiple of block_size {block_size}")
        cb = layout.chunk_bytes(chunk_size)
        if cb != namespace.chunk_bytes:
            raise ValueError(
                f"lmtier: chunk bytes {cb} from the KV tensors differ from the namespace's {namespace.chunk_bytes}"
            )
        self.layout = layout
        self.manager = manager
        self.chunk = chunk_size
        self.block_size = block_size
        self.ns = namespace
        self.index_ns = index_namespace if index_namespace is not None else namespace
        self.chunk_bytes = cb
        self._stat = on_stat or (lambda name, value=1: None)
        self._warn_failed_load = RateLimitedWarning(log, 30.0)
        self._on_load_failed = on_load_failed or (lambda keys0: None)
        self._on_stored = on_stored or (lambda key, key0, tier: None)
        self._faults = faults or no_faults
        self._load_threads = load_threads
        self.load_meter = load_meter
        if load_meter is not None:
            manager.set_load_meter(load_meter)
        self.is_cuda = layout.device.type == "cuda"
        self._storer = ChunkStorer(
            layout,
            manager,
            chunk_size=chunk_size,
            chunk_bytes=cb,
            keys=self._both_keys,
            slot_mappings=self.slot_mappings,
            on_stat=self._stat,
            on_stored=self._on_stored,
        )
        self.store_engine = self._storer.engine
        self.load_engine = None
        if self.is_cuda:
            from lmtier.transfer import CudaTransferEngine

            self.load_engine = CudaTransferEngine(layout, chunk_size)
        group = layers_per_wait or max(1, layout.num_layers // 8)
        if not 1 <= group <= layout.num_layers:
            raise ValueError(f"lmtier: layers_per_wait must be in [1, {layout.num_layers}], got {layers_per_wait}")
        self.pending = self._storer.pending  # req -> [(event, slot, key, key0)] (the storer's dict)
        self.delayed: set[str] = set()
        self.async_loads: dict[str, AsyncLoad] = {}
        self._finished_seen: set[str] = set()
        self._load_pool: ThreadPoolExecutor | None = None
        if decode_on not in ("auto", "device", "host"):
            raise ValueError(f"lmtier: decode_on must be 'auto', 'device' or 'host', got {decode_on!r}")
        codec = lower_tiers_are_codec(manager)
        if decode_on == "device" and self.is_cuda and not codec:
            raise ValueError(
                "lmtier: decode_on='device' on a CUDA cache needs every lower tier (disk, remote) to be "
                "a codec tier (serde: cachegen, any codec_level)"
            )
        self.device_staging = decode_on == "device" or (decode_on == "auto" and self.is_cuda and codec)
        self.decode_stream = None  # CUDA device mode: decodes' copies and the device scatters are ordered on it
        self._table_stream = None  # CUDA device mode: current while ops.scatter builds a pointer table (idle)
        self._slot_staging = None  # CUDA device mode: slot-mapping uploads on decode_stream
        if self.device_staging and self.is_cuda:
            prio = -64 if layer_stream_priority is None else layer_stream_priority
            self.decode_stream = torch.cuda.Stream(device=layout.device, priority=prio)
            from lmtier.transfer import SlotStaging

            self._slot_staging = SlotStaging(layout.device, chunk_size * 32)
        self._fetcher = ChunkFetcher(
            manager,
            chunk_size=chunk_size,
            chunk_bytes=cb,
            io_threads=io_threads,
            pin_staging=self.is_cuda,
            faults=self._faults,
            on_stored=self._on_stored,
            max_staging_bytes=max_staging_bytes,
            device_staging=layout.device if self.device_staging else None,
            decode_stream=self.decode_stream,
            window=device_window or 2 * io_threads,
            fetch_batch=fetch_batch,
        )
        self._layers = LayerwiseLoader(
            self, fetcher=self._fetcher, on_stat=self._stat, priority=layer_stream_priority, layers_per_wait=group
        )

    # -------------------------------------------------------------------- load primitives (also layerwise.py's)
    def slot_mapping(self, block_ids: list[int], chunk_index: int, start_token: int = 0) -> torch.Tensor:
        """Slot mapping ``[1, chunk]`` (int64, CPU) of chunk ``chunk_index``; tokens before ``start_token`` are -1."""
        return self.slot_mappings(block_ids, [chunk_index], start_token)

    def slot_mappings(self, block_ids: list[int], chunk_indices: list[int], start_token: int = 0) -> torch.Tensor:
        """Slot mapping ``[len(chunk_indices), chunk]`` (int64, CPU): row ``i`` holds the slots of chunk
        ``chunk_indices[i]`` (``block_ids[t // block_size] * block_size + t % block_size`` for its
        tokens ``t``); tokens before ``start_token`` are -1 (not written by a scatter)."""
        ci = torch.as_tensor(chunk_indices, dtype=torch.int64).view(-1, 1)
        t = ci * self.chunk + torch.arange(self.chunk, dtype=torch.int64).view(1, -1)
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)[t // self.block_size]
        slots = blocks * self.block_size + t % self.block_size
        if start_token > 0:
            slots[t < start_token] = -1
        return slots

    def keys(self, token_ids: list[int], cache_salt: KeyScope | None) -> list[bytes]:
        """This rank's chunk keys of ``token_ids`` (whole chunks only)."""
        return chunk_keys(token_ids, self.ns, cache_salt=cache_salt)

    def index_keys(self, token_ids: list[int], cache_salt: KeyScope | None, keys: list[bytes]) -> list[bytes]:
        """Rank 0's chunk keys (the scheduler's index) for this rank's ``keys``."""
        return keys if self.index_ns == self.ns else chunk_keys(token_ids, self.index_ns, cache_salt=cache_salt)

    def _both_keys(self, token_ids: list[int], cache_salt: KeyScope | None) -> tuple[list[bytes], list[bytes]]:
        keys = self.keys(token_ids, cache_salt)
        return keys, self.index_keys(token_ids, cache_salt, keys)

    def plan(self, op: LoadOp, keys: list[bytes], fault_names: set[str]) -> list[Chunk]:
        """The fetcher's plan of ``op``'s chunks from ``start_token`` on (promotions: its tenant's)."""
        first = op.start_token // self.chunk
        return self._fetcher.plan(
            op.req_id, first, keys, fault_names, tenant=tenant_id(op.cache_salt), skip_tiers=op.skip_tiers
        )

    def scatter(self, slots: torch.Tensor, src: torch.Tensor | list[torch.Tensor]) -> None:
        """Write canonical chunks into the cache; returns when done.

        ``slots``: ``[C, chunk]`` int64 slot mapping (CPU); ``src``: ``C`` uint8 CPU tensors of
        ``chunk_bytes`` (a single tensor for ``C == 1``). One native call (CPU) or one transfer on
        the load engine's stream, waited for (CUDA; pageable sources are pinned first).
        """
        srcs = [src] if isinstance(src, torch.Tensor) else list(src)
        if self.load_engine is not None:
            srcs = [s if s.is_pinned() else s.pin_memory() for s in srcs]
            # GPU time from where the copies may start (the current stream's queued work done) to
            # their end: the host's wait also covers the previous forward still running
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.layout.device))
            self.load_engine.load(slots, srcs).synchronize()
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.load_engine.kernel_stream)
            end.synchronize()
            self.meter_scatter(len(srcs), start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            ops.scatter(self.layout, slots, srcs)
            self.meter_scatter(len(srcs), time.perf_counter() - t0)

    def meter_scatter(self, n_chunks: int, seconds: float) -> None:
        """Report ``n_chunks`` chunks copied from host memory into the cache in ``seconds`` (the CPU
        pool's load bandwidth: tier ``"cpu"``, path ``"scatter"``)."""
        if self.load_meter is not None:
            self.load_meter.record("cpu", "scatter", n_chunks * self.chunk_bytes, seconds)

    def load_failed(self, op: LoadOp, chunk_index: int, key0: Callable[[], list[bytes]], what: str) -> None:
        """A load of ``op`` failed from chunk ``chunk_index`` on: a warning (rate-limited, one per 30 s)
        and the index keys of chunks ``chunk_index ..`` to ``on_load_failed``, so that a scheduler in
        another process stops claiming them where its mirror lists them (a record gone from a remote
        tier, one a rank > 0 lacks, one the disk tier could not delete) until they are stored again.
        ``key0``: the op's index keys (all its chunks), computed on demand."""
        self._warn_failed_load(
            "lmtier: %s of request %s failed at chunk %d: %s", what, op.req_id, chunk_index, FAILED_LOAD_WHY
        )
        try:
            self._on_load_failed(list(key0()[chunk_index:]))
        except Exception:  # noqa: BLE001 - the report is advice; the failure itself is already handled
            log.exception("lmtier: reporting the failed load of request %s", op.req_id)

    def blocks_from(self, op: LoadOp, chunk_index: int = 0) -> list[int]:
        """``op``'s block ids from chunk ``chunk_index`` on (from ``start_token`` when that lies
        later): what a load failing at that chunk leaves unwritten (default: the whole load)."""
        first_block = max(chunk_index * self.chunk, op.start_token) // self.block_size
        return op.block_ids[first_block:]

    def _scatter_chunks(self, op: LoadOp, chunks: list[Chunk]) -> None:
        """Scatter ready chunks (each ``src`` set) into ``op``'s blocks: host chunks in one call
        (done on return), device-staged ones in one more (:meth:`scatter_device`)."""
        host = [c for c in chunks if c.device is None]
        if host:
            self.scatter(self.slot_mappings(op.block_ids, [c.ci for c in host], op.start_token), [c.src for c in host])
        if len(host) < len(chunks):
            self.scatter_device(op, [c for c in chunks if c.device is not None])
        self._stat("loaded_chunks", len(host))
        self._stat("loaded_bytes", len(host) * self.chunk_bytes)

    def scatter_device(self, op: LoadOp, chunks: list[Chunk]) -> None:
        """Scatter device-staged chunks into ``op``'s blocks: on a CPU cache in one native call,
        done on return; on a CUDA cache queued on :attr:`decode_stream` (after the decodes' copies
        into the staging buffers; the caller orders the stream against the compute stream), one
        call per chunk: a chunk's source is one of the few reused staging buffers, so
        :func:`lmtier.ops.scatter`'s cached device pointer tables stay few (a batch of varying
        buffers would build new ones, and evicting one synchronizes the device). A table that is
        built copies synchronously on the current stream: the calls run with an idle side stream
        current, so that copy never waits for the compute stream."""
        slots = self.slot_mappings(op.block_ids, [c.ci for c in chunks], op.start_token)
        if slots.numel() and int(slots.max()) >= self.layout.num_slots:
            raise ValueError(f"lmtier: slot {int(slots.max())} outside the cache's {self.layout.num_slots} slots")
        srcs = [c.src for c in chunks]
        if self.decode_stream is None:
            ops.scatter(self.layout, slots, srcs)
        else:
            dslots = self._slot_staging.upload(slots, self.decode_stream)
            if self._table_stream is None:
                self._table_stream = torch.cuda.Stream(device=self.layout.device)
            with torch.cuda.stream(self._table_stream):
                for i, src in enumerate(srcs):
                    ops.scatter(self.layout, dslots[i : i + 1], [src], stream=self.decode_stream, check=False)
        self._stat("loaded_chunks", len(chunks))
        self._stat("loaded_bytes", len(chunks) * self.chunk_bytes)
        self._stat("device_decoded_chunks", len(chunks))

    def device_begin(self) -> None:
        """Device mode on CUDA: order :attr:`decode_stream` after the current stream's work (the
        blocks a load writes may still be read by kernels queued before it)."""
        if self.decode_stream is not None:
            self.decode_stream.wait_stream(torch.cuda.current_stream(self.layout.device))

    # ------------------------------------------------------------------------------ sync loads
    def load(self, op: LoadOp) -> set[int]:
        """Load ``op`` now (before the forward). Returns the block ids that were not loaded.

        A poisoned op loads nothing and returns every block from ``start_token``. Otherwise CPU-pool
        hits are pinned and every other chunk is fetched from disk/remote on the I/O threads, all at
        once; leading chunks are scattered as soon as they are in host memory, as many per native
        call as are ready. The first chunk that cannot be loaded ends the op: its blocks (from
        ``start_token`` when it lies inside) and all later blocks are returned, and nothing is
        written into them.
        """
        if op.poisoned:
            self._stat("load_failures")
            return set(self.blocks_from(op))
        t0 = time.perf_counter()
        keys = self.keys(op.token_ids, op.cache_salt)
        key0 = lazy_once(lambda: self.index_keys(op.token_ids, op.cache_salt, keys))
        self.device_begin()
        chunks = self.plan(op, keys, {"load", "load_sync"})
        failed_ci = None
        i = 0
        try:
            while i < len(chunks):
                if not self._fetcher.resolve(chunks[i], block=True):
                    failed_ci = chunks[i].ci
                    break
                j = i + 1
                while j < len(chunks) and self._fetcher.resolve(chunks[j], block=False):
                    j += 1
                try:
                    self._scatter_chunks(op, chunks[i:j])
                except Exception:
                    log.exception(
                        "lmtier: scatter of chunks %d..%d of request %s failed",
                        chunks[i].ci,
                        chunks[j - 1].ci,
                        op.req_id,
                    )
                    failed_ci = chunks[i].ci
                    break
                for c in chunks[i:j]:
                    self._fetcher.finish(c, key0)
                self._fetcher.pump(chunks)
                i = j
        finally:
            for c in chunks[i:]:
                self._fetcher.finish(c, key0)
            if self.decode_stream is not None:  # the forward reads what the device scatters wrote
                torch.cuda.current_stream(self.layout.device).wait_stream(self.decode_stream)
        failed: set[int] = set()
        if failed_ci is not None:
            failed.update(self.blocks_from(op, failed_ci))
            self._stat("load_failures")
            self.load_failed(op, failed_ci, key0, "KV load")
        dt = time.perf_counter() - t0
        self._stat("load_ms", dt * 1e3)
        self._stat("load_lat_s", dt)
        return failed

    # ------------------------------------------------------------------------------ layer-by-layer loads
    @property
    def layerwise_in_flight(self) -> bool:
        """A :meth:`load_layerwise` not yet finished (:meth:`finish_layerwise`)."""
        return self._layers.in_flight

    def prepare_layerwise(self) -> None:
        """:meth:`LayerwiseLoader.prepare <lmtier.integration.vllm.layerwise.LayerwiseLoader.prepare>`:
        allocate what layer-by-layer loads need, so a failure shows at registration."""
        self._layers.prepare()

    def load_layerwise(self, ops_: Iterable[LoadOp]) -> dict[str, set[int]]:
        """Start one layer-by-layer load of the synchronous ops ``ops_`` (one engine step's); returns
        ``{req_id: failed block ids}``
        (:meth:`lmtier.integration.vllm.layerwise.LayerwiseLoader.load`)."""
        return self._layers.load(ops_)

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until layer ``layer`` of the in-flight layer-by-layer load
        is in the cache (:meth:`lmtier.integration.vllm.layerwise.LayerwiseLoader.wait_layer`)."""
        self._layers.wait_layer(layer)

    def finish_layerwise(self) -> dict[str, set[int]]:
        """End the in-flight layer-by-layer load after the forward; returns the blocks to report as
        failed (:meth:`lmtier.integration.vllm.layerwise.LayerwiseLoader.finish`)."""
        return self._layers.finish()

    def drain_layerwise(self, *, block: bool = False) -> None:
        """Release the chunks of finished layer-by-layer loads whose copies completed
        (:meth:`lmtier.integration.vllm.layerwise.LayerwiseLoader.drain`)."""
        self._layers.drain(block=block)

    # ------------------------------------------------------------------------------ async loads
    def start_load(self, op: LoadOp) -> None:
        """Start fetching ``op``'s chunks into host memory in the background (see :meth:`poll_loads`)."""
        if op.req_id in self.async_loads:  # cannot happen (one load per admission); never report twice
            log.error("lmtier: request %s already has an async load in flight; ignoring the second", op.req_id)
            return
        if self._load_pool is None:
            self._load_pool = ThreadPoolExecutor(
                self._load_threads, thread_name_prefix="lmtier-load", initializer=unpin_thread
            )
        self._stat("async_loads")
        self.async_loads[op.req_id] = AsyncLoad(op, self._load_pool.submit(self._fetch, op), time.perf_counter())

    def _fetch(self, op: LoadOp) -> tuple[list[Chunk], bool]:
        """Background thread: bring every chunk of ``op`` into host memory.

        CPU-pool hits are pinned; the other chunks are read from disk/remote on the I/O threads in
        parallel, straight into reserved pool slots. Returns ``(chunks, ok)`` once every fetch
        finished: ``ok`` is False if any chunk failed (nothing of the op is then scattered). Every
        chunk's holdings are released by :meth:`poll_loads` on the worker thread.
        """
        if op.poisoned:
            return [], False
        chunks: list[Chunk] = []
        try:
            keys = self.keys(op.token_ids, op.cache_salt)
            chunks = self.plan(op, keys, {"load", "load_async"})
        except Exception:
            log.exception("lmtier: async load of request %s failed", op.req_id)
            return chunks, False
        ok = True
        for c in chunks:
            ok = bool(self._fetcher.resolve(c, block=True)) and ok
        return chunks, ok

    def poll_loads(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        """Scatter the background loads that completed; returns ``(finished, failed)`` request ids.

        A failed load is in both sets (vLLM's ``finished_recving`` / ``failed_recving``) and writes
        nothing. ``finished_req_ids``: requests vLLM finished (aborted); their loads are completed
        without writing (nothing reads those blocks) and reported as finished, not failed.
        """
        if not self.async_loads:  # (every step) nothing in flight: no finished id needs keeping
            if self._finished_seen:
                self._finished_seen.clear()
            return set(), set()
        self._finished_seen |= set(finished_req_ids)
        done: set[str] = set()
        failed: set[str] = set()
        for rid, a in list(self.async_loads.items()):
            if not a.future.done():
                continue
            del self.async_loads[rid]
            try:
                chunks, ok = a.future.result()
            except Exception:
                log.exception("lmtier: async load of request %s failed", rid)
                chunks, ok = [], False
            op = a.op
            key0 = lazy_once(
                lambda op=op: self.index_keys(op.token_ids, op.cache_salt, self.keys(op.token_ids, op.cache_salt))
            )
            try:
                if rid in self._finished_seen:  # aborted while loading: nothing reads these blocks
                    ok = True
                elif ok and chunks:
                    self.device_begin()
                    self._scatter_chunks(op, chunks)
                    if self.decode_stream is not None:
                        torch.cuda.current_stream(self.layout.device).wait_stream(self.decode_stream)
            except Exception:
                log.exception("lmtier: scatter of async load of request %s failed", rid)
                ok = False
            finally:
                for c in chunks:
                    self._fetcher.finish(c, key0)
            dt = time.perf_counter() - a.t0
            self._stat("load_lat_s", dt)
            self._stat("load_ms", dt * 1e3)
            done.add(rid)
            if not ok:
                self._stat("load_failures")
                self.load_failed(
                    op, chunks[0].ci if chunks else op.start_token // self.chunk, key0, "background KV load"
                )
                failed.add(rid)
        self._finished_seen.intersection_update(self.async_loads)  # keep ids of loads still in flight only
        return done, failed

    # ------------------------------------------------------------------------------ stores
    def store(self, op: StoreOp) -> None:
        """Store chunks ``[op.first_chunk, len(op.token_ids) // chunk)`` from ``op.block_ids``
        (:meth:`lmtier.integration.vllm.stores.ChunkStorer.store`: on CUDA the chunks are committed
        by :meth:`poll_stores` once their copy arrived; until then the request is in ``pending``)."""
        self._storer.store(op)

    def poll_stores(self, *, block: bool = False) -> None:
        """Commit the CUDA stores whose copy completed (``block``: wait for all of them first)."""
        self._storer.poll_stores(block=block)

    def finished_sending(self, delayed_frees: Iterable[str] = ()) -> set[str]:
        """Requests whose blocks may be freed now.

        ``delayed_frees``: finished requests whose blocks vLLM keeps for us (``request_finished``
        returned True); they are remembered and returned (once) when none of their stores is in
        flight any more. Polls the CUDA stores first.
        """
        self.delayed.update(delayed_frees)
        if self._layers.draining:
            self.drain_layerwise()
        if self.store_engine is not None:
            self.poll_stores()
        sending: set[str] = set()
        if self.delayed:
            sending = {r for r in self.delayed if r not in self.pending}
            self.delayed -= sending
        return sending

    def idle(self) -> bool:
        """No load or store in flight and no held request left."""
        return not self.async_loads and not self.pending and not self.delayed and self._layers.idle()

    def close(self) -> None:
        """Wait for background loads, a layer-by-layer load and CUDA stores (committing the stores). Idempotent."""
        self.finish_layerwise()
        self.drain_layerwise(block=True)
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=True)
        self._fetcher.close()
        if self.store_engine is not None:
            self.poll_stores(block=True)
