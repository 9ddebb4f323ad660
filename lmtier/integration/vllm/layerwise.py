"""Layer-by-layer loads of :class:`lmtier.integration.vllm.worker.ConnectorWorker` (vLLM's
``wait_for_layer_load`` pattern).

:class:`LayerwiseLoader` plans and fetches the chunks of one engine step's synchronous
:class:`~lmtier.integration.vllm.loadstore.LoadOp` s through the worker's load primitives (keys, the
fetcher's plan, the device scatter), copies every ready chunk into the cache in one layer-major
transfer (CUDA: :meth:`lmtier.transfer.CudaTransferEngine.load_layerwise`, one event per group of
``layers_per_wait`` layers), lets the forward wait per layer (:meth:`LayerwiseLoader.wait_layer`),
reports the blocks of layers the forward never waited for, and releases the chunks once the copies
completed. The worker's ``load_layerwise`` / ``wait_layer`` / ``finish_layerwise`` /
``drain_layerwise`` / ``prepare_layerwise`` call it; docs/connector_worker.md describes the data path.

This module imports nothing from vLLM. Not thread-safe: the worker's thread calls every method.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from lmtier import ops
from lmtier.integration.vllm.fetch import Chunk, ChunkFetcher
from lmtier.integration.vllm.loadstore import LayerwiseLoad, LoadOp, lazy_once

if TYPE_CHECKING:
    from lmtier.integration.vllm.worker import ConnectorWorker

__all__ = ["LayerwiseLoader"]

log = logging.getLogger("vllm.lmtier.connector")


class LayerwiseLoader:
    """The layer-by-layer loads of one :class:`~lmtier.integration.vllm.worker.ConnectorWorker`.

    Args:
        worker: the worker whose cache is loaded; its load primitives (``keys``, ``index_keys``,
            ``plan``, ``blocks_from``, ``slot_mappings``, ``scatter_device``, ``device_begin``,
            ``meter_scatter``), ``layout``, chunk size and ``decode_stream`` are used.
        fetcher: the worker's chunk fetcher (resolves and releases the planned chunks).
        on_stat: the worker's ``on_stat`` (``loaded_chunks``, ``loaded_bytes``, ``load_failures``,
            ``layerwise_loads``, ``load_ms``, ``load_lat_s``).
        priority: CUDA stream priority of the copies (None: the device's highest).
        layers_per_wait: layers per event on CUDA, in ``[1, num_layers]`` (the worker checks it).

    Attributes (read-only for callers): ``active`` (the load the forward may still wait on, or
    None), ``draining`` (finished loads whose copies may still run, CUDA), ``engine`` (the
    :class:`lmtier.transfer.CudaTransferEngine` of the copies, built by :meth:`prepare`; None on a
    CPU cache or before).
    """

    def __init__(
        self,
        worker: ConnectorWorker,
        *,
        fetcher: ChunkFetcher,
        on_stat: Callable[..., None],
        priority: int | None,
        layers_per_wait: int,
    ) -> None:
        self._worker = worker
        self._fetcher = fetcher
        self._stat = on_stat
        self.layout = worker.layout
        self.chunk = worker.chunk
        self.chunk_bytes = worker.chunk_bytes
        self.is_cuda = worker.is_cuda
        self.decode_stream = worker.decode_stream
        self._priority = priority
        self.layers_per_wait = layers_per_wait
        self.engine = None  # CudaTransferEngine (one event per piece), built on first use
        self.active: LayerwiseLoad | None = None
        self.draining: list[LayerwiseLoad] = []  # finished, copies possibly still running (CUDA)

    def idle(self) -> bool:
        """No load in flight and none draining."""
        return self.active is None and not self.draining

    @property
    def in_flight(self) -> bool:
        """A :meth:`load` not yet finished (:meth:`finish`)."""
        return self.active is not None

    def prepare(self) -> None:
        """Allocate what layer-by-layer loads need (CUDA: the layer engine's streams and staging
        ring), so a failure shows at registration, not in the middle of serving. Raises what the
        allocation raises (e.g. ``RuntimeError`` out of device memory)."""
        if self.is_cuda and self.engine is None:
            from lmtier.transfer import CudaTransferEngine

            # None: -64, which torch clamps to the device's highest stream priority
            prio = -64 if self._priority is None else self._priority
            self.engine = CudaTransferEngine(
                self.layout, self.chunk, layers_per_piece=self.layers_per_wait, priority=prio
            )
            self._warm_engine()

    def _warm_engine(self) -> None:
        """Launch the layer engine's kernels once, writing nothing (every slot is padding). Under
        CUDA's lazy module loading (the default) a kernel's first launch loads it, and that waits
        for the device's queued work: inside a forward, the host would stall until the compute
        stream drained."""
        padding = torch.full((1, self.chunk), -1, dtype=torch.int64)
        scratch = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self.engine.load_layerwise(padding, [scratch])[-1].synchronize()

    def load(self, ops_: Iterable[LoadOp]) -> dict[str, set[int]]:
        """Start one layer-by-layer load of the synchronous ops ``ops_`` (one engine step's).

        Every op's chunks are planned and resolved as in :meth:`ConnectorWorker.load` (pool hits
        pinned, other chunks fetched on the I/O threads and waited for); an op keeps its chunks up to
        the first one that cannot be loaded. All kept chunks of all ops are then copied in one
        layer-major transfer: on a CUDA cache it is queued after the current stream's work and layer
        ``l`` is ready once :meth:`wait_layer` ``(l)`` returned (on the stream current then); on a CPU
        cache the copy is done on return. Call :meth:`finish` after the forward.

        Returns ``{req_id: failed block ids}`` for the ops that did not load whole (as
        :meth:`ConnectorWorker.load`: a poisoned op fails from ``start_token``, otherwise from the
        first chunk that failed); their other chunks still load. If planning or queuing raises, every op fails from its
        ``start_token`` (nothing of it is reported loaded). A previous layer-by-layer load still in
        flight is finished first and its report (see :meth:`finish`) merged in.
        """
        ops_ = list(ops_)
        failed: dict[str, set[int]] = {}
        for rid, blocks in self.finish().items():
            failed.setdefault(rid, set()).update(blocks)
        if self.draining:
            self.drain()
        t0 = time.perf_counter()
        parts: list = []  # (op, its ready host chunks, key0, pinned copies) for the layer-major copy
        loaded: list[tuple[LoadOp, int]] = []  # (op, first chunk it loads): what a missed wait_layer fails
        current: tuple[list[Chunk], Callable[[], list[bytes]]] | None = None  # the op being planned
        events = timing = device_event = None
        start = None
        if self.decode_stream is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.layout.device))
            self._worker.device_begin()
        n_dev = 0
        try:
            for op in ops_:
                if op.poisoned:
                    self._stat("load_failures")
                    failed.setdefault(op.req_id, set()).update(self._worker.blocks_from(op))
                    continue
                keys = self._worker.keys(op.token_ids, op.cache_salt)
                key0 = lazy_once(lambda op=op, keys=keys: self._worker.index_keys(op.token_ids, op.cache_salt, keys))
                current = ([], key0)
                chunks = self._worker.plan(op, keys, {"load", "load_sync"})
                current = (chunks, key0)
                n_ok = 0
                host: list[Chunk] = []
                while n_ok < len(chunks) and self._fetcher.resolve(chunks[n_ok], block=True):
                    # device-staged chunks are scattered as they land (with the ready ones after
                    # them) and their buffers released; host chunks wait for the layer-major copy
                    j = n_ok + 1
                    while j < len(chunks) and self._fetcher.resolve(chunks[j], block=False):
                        j += 1
                    dev = [c for c in chunks[n_ok:j] if c.device is not None]
                    host += [c for c in chunks[n_ok:j] if c.device is None]
                    if dev:
                        self._worker.scatter_device(op, dev)
                        n_dev += len(dev)
                        for c in dev:
                            self._fetcher.finish(c, key0)
                        self._fetcher.pump(chunks)
                    n_ok = j
                if n_ok < len(chunks):
                    failed.setdefault(op.req_id, set()).update(self._worker.blocks_from(op, chunks[n_ok].ci))
                    self._stat("load_failures")
                    self._worker.load_failed(op, chunks[n_ok].ci, key0, "layer-by-layer KV load")
                for c in chunks[n_ok:]:
                    self._fetcher.finish(c, key0)
                current = None
                if n_ok:
                    loaded.append((op, chunks[0].ci))
                if host:
                    parts.append((op, host, key0, []))
            if n_dev and self.decode_stream is not None:
                device_event = torch.cuda.Event(enable_timing=True)
                device_event.record(self.decode_stream)
            if parts:
                slots = torch.cat(
                    [
                        self._worker.slot_mappings(op.block_ids, [c.ci for c in cs], op.start_token)
                        for op, cs, _, _ in parts
                    ]
                )
                srcs = []
                for _, cs, _, keep in parts:
                    for c in cs:
                        src = c.src
                        if self.is_cuda and not src.is_pinned():
                            src = src.pin_memory()
                            keep.append(src)
                        srcs.append(src)
                if self.is_cuda:
                    self.prepare()
                    dev = self.layout.device
                    timing = (start or torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    if start is None:
                        timing[0].record(torch.cuda.current_stream(dev))
                    events = self.engine.load_layerwise(slots, srcs)
                    if device_event is not None:  # the load ends after both kinds of copies
                        self.engine.kernel_stream.wait_event(device_event)
                    timing[1].record(self.engine.kernel_stream)
                else:
                    t_copy = time.perf_counter()
                    ops.scatter(self.layout, slots, srcs)
                    self._worker.meter_scatter(len(srcs), time.perf_counter() - t_copy)
                n = sum(len(cs) for _, cs, _, _ in parts)
                self._stat("loaded_chunks", n)
                self._stat("loaded_bytes", n * self.chunk_bytes)
            elif device_event is not None:
                timing = (start, device_event)
            if loaded:
                self._stat("layerwise_loads", len(loaded))
        except Exception:
            # Planning or queuing failed: every op fails from its start token — those already
            # planned, the one being planned and those after it (none of it may be read); on CUDA,
            # whatever was queued is waited for before the chunks' host memory is released.
            log.exception("lmtier: layer-by-layer load of %d request(s) failed", len(ops_))
            if self.engine is not None:
                self.engine.copy_stream.synchronize()
                self.engine.kernel_stream.synchronize()
            if self.decode_stream is not None:
                self.decode_stream.synchronize()
            held = [(cs, key0) for _, cs, key0, _ in parts] + ([current] if current is not None else [])
            for cs, key0 in held:
                self._release_chunks(cs, key0)
            for op in ops_:
                if not op.poisoned:
                    failed.setdefault(op.req_id, set()).update(self._worker.blocks_from(op))
                    self._stat("load_failures")
            return failed
        if loaded:
            self.active = LayerwiseLoad(
                parts, events, self.layout.num_layers, t0, timing, device_event=device_event, loaded=loaded
            )
        return failed

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until layer ``layer`` of the in-flight layer-by-layer load
        is in the cache (CUDA; the host does not block). No-op without one."""
        lw = self.active
        if lw is None:
            return
        if not 0 <= layer < len(lw.waited):
            raise IndexError(f"lmtier: layer {layer} outside [0, {len(lw.waited)})")
        if lw.events is not None:
            torch.cuda.current_stream(self.layout.device).wait_event(lw.events[layer])
        if lw.device_event is not None:  # device-staged chunks: every layer at once
            torch.cuda.current_stream(self.layout.device).wait_event(lw.device_event)
        lw.waited[layer] = True

    def finish(self) -> dict[str, set[int]]:
        """End the in-flight layer-by-layer load (after the forward) without blocking the host.

        Returns ``{req_id: blocks it wrote}`` when some layer was never waited for through
        :meth:`wait_layer` — the forward may have read that layer before its copy landed, so the
        caller must report those blocks as failed (vLLM recomputes them) — else ``{}`` (also without
        a load in flight). The load's chunks (pinned pool slots, staging buffers) are released once
        its copies completed: at once on the CPU, on CUDA by :meth:`drain` (called here without
        blocking, and by later loads, :meth:`ConnectorWorker.finished_sending` and
        :meth:`ConnectorWorker.close`).
        """
        lw, self.active = self.active, None
        if lw is None:
            return {}
        self.draining.append(lw)
        self.drain(block=False)
        if all(lw.waited):
            return {}
        missed = [i for i, w in enumerate(lw.waited) if not w]
        log.warning(
            "lmtier: layer-by-layer load: the forward never waited for %d layer(s) (first: %d); "
            "its blocks are reported as failed",
            len(missed),
            missed[0],
        )
        out: dict[str, set[int]] = {}
        for op, first in lw.loaded:
            out.setdefault(op.req_id, set()).update(self._worker.blocks_from(op, first))
        return out

    def _release_chunks(self, chunks: list[Chunk], key0: Callable[[], list[bytes]]) -> None:
        """:meth:`ChunkFetcher.finish` each of a layer-by-layer load's chunks once its copies are done; one
        that fails to release is logged and the others are still released."""
        for c in chunks:
            try:
                self._fetcher.finish(c, key0)
            except Exception:
                log.exception("lmtier: releasing chunk %d of a layer-by-layer load failed", c.ci)

    def drain(self, *, block: bool = False) -> None:
        """Release the chunks of finished layer-by-layer loads whose copies completed (``block``:
        wait for them first) and record their ``load_ms`` / ``load_lat_s`` (CUDA: GPU time from the
        load's start on the current stream to its last copy)."""
        keep = []
        for lw in self.draining:
            if lw.timing is not None:
                if block:
                    lw.timing[1].synchronize()
                elif not lw.timing[1].query():
                    keep.append(lw)
                    continue
            for _, cs, key0, _ in lw.parts:
                self._release_chunks(cs, key0)
            ms = (
                lw.timing[0].elapsed_time(lw.timing[1])
                if lw.timing is not None
                else (time.perf_counter() - lw.t0) * 1e3
            )
            if lw.timing is not None and lw.parts and lw.device_event is None:
                # CUDA, host chunks only: the GPU time of their copies (the CPU path timed its scatter)
                self._worker.meter_scatter(sum(len(cs) for _, cs, _, _ in lw.parts), ms / 1e3)
            self._stat("load_ms", ms)
            self._stat("load_lat_s", ms / 1e3)
        self.draining = keep
