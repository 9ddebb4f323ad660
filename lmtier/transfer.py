"""Pipelined store/load between a CUDA paged KV cache and host chunk buffers.

Default path ("staged"), chosen by measurement (benchmarks/RESULTS.md): the gather kernel copies a
*piece* — a range of layers of one chunk, contiguous in the layer-major canonical layout — from the
paged cache into a small device staging ring (device memory moves at TB/s, so the kernel holds SMs
for microseconds), then the copy engine moves the piece over PCIe with ``cudaMemcpyAsync``. The ring
and two streams overlap the gather of piece ``i + 1`` with the DMA of piece ``i``, so even a single
chunk runs close to the link speed. Loads are the mirror image (DMA into staging, then scatter).

The staged pipeline is enqueued entirely in C++ (``lmtier._C.StagedCopier``): a whole batch costs
microseconds of host time, so even one 32 MiB chunk starts its first DMA almost immediately.

"zerocopy" lets the kernel write/read mapped pinned host memory directly. It reaches the link too,
but SMs waiting on PCIe starve concurrent kernels (our interference benchmark, benchmarks/RESULTS.md §1: a
concurrent GEMM runs 39-123 % slower), so it is opt-in.

Ordering: every transfer first waits for ``wait_stream`` (default: the current stream), so blocks
written by the forward pass are read only after that work; the returned event completes when every
byte has arrived. The caller must not reuse the blocks (store) or read them (load) before it.
One engine runs one transfer at a time in stream order; use one engine per direction for
concurrent stores and loads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from lmtier import _C, ops
from lmtier.layout import KVLayout

MODES = ("staged", "zerocopy")


class SlotStaging:
    """Uploads slot mappings to a device through pinned host buffers that are reused, never freed.

    The upload is queued on a caller's stream, which may wait for a forward's queued work. A
    ``pin_memory()`` per upload would allocate page-locked memory whenever torch's cached block is
    still held by an upload that has not run yet, and a page-locked allocation is an implicitly
    synchronizing call (it waits for the device's queued work). So each buffer is taken only once
    its last upload ran (its event), and a new one is allocated only when every buffer is still in
    flight or too small (rare: the set grows to what the traffic needs). Used by the connector
    worker's device-decode scatters and by :class:`CudaTransferEngine` for host slot mappings.
    Thread-safe.

    Args:
        device: the CUDA device of the uploaded mappings.
        numel: int64 elements of each initial buffer; ``count``: initial buffers.
    """

    def __init__(self, device: torch.device, numel: int, count: int = 4) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._bufs: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [
            (torch.empty(numel, dtype=torch.int64, pin_memory=True), None) for _ in range(count)
        ]

    def upload(self, slot_mapping: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
        """``slot_mapping`` (CPU, int64, any shape) as a device tensor of the same shape, copied on
        ``stream`` (use it on that stream, or order other streams after it)."""
        n = slot_mapping.numel()
        with self._lock:
            for i, (buf, ev) in enumerate(self._bufs):  # noqa: B007 - i is used after the loop
                if buf.numel() >= n and (ev is None or ev.query()):
                    break
            else:
                size = max(n, max(b.numel() for b, _ in self._bufs))
                self._bufs.append((torch.empty(size, dtype=torch.int64, pin_memory=True), None))
                i, buf = len(self._bufs) - 1, self._bufs[-1][0]
            buf[:n].copy_(slot_mapping.reshape(-1))
            with torch.cuda.stream(stream):
                out = buf[:n].to(self.device, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            self._bufs[i] = (buf, ev)
        return out.view(slot_mapping.shape)


class CudaTransferEngine:
    """Moves canonical chunks between one CUDA paged cache and pinned host chunk buffers.

    Args:
        layout: the CUDA cache.
        tokens_per_chunk: T; chunk bytes = ``layout.chunk_bytes(T)``.
        layers_per_piece: layers per pipeline piece (default: a quarter of the layers, at least 1;
            small pieces shorten the pipeline's fill, which is what limits a single chunk).
        ring: staging ring slots (pieces in flight), >= 2.
        mode: "staged" (default) or "zerocopy".
        zerocopy_max_ctas: grid cap for the zero-copy kernel (limits SMs held on PCIe).
        priority: CUDA priority of the engine's two streams (0: normal; lower numbers are higher,
            values beyond the device's range are clamped to it by torch). A high priority lets the gather/scatter
            kernels take SMs ahead of a running forward's queued blocks (layer-by-layer loads).

    Device memory: ``ring * layers_per_piece * layout.chunk_bytes(T) / num_layers`` bytes of staging.
    """

    def __init__(
        self,
        layout: KVLayout,
        tokens_per_chunk: int,
        *,
        layers_per_piece: int | None = None,
        ring: int = 3,
        mode: str = "staged",
        zerocopy_max_ctas: int = 32,
        priority: int = 0,
    ) -> None:
        if layout.device.type != "cuda":
            raise ValueError(f"CudaTransferEngine needs a CUDA cache, got {layout.device}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if tokens_per_chunk <= 0:
            raise ValueError(f"tokens_per_chunk must be > 0, got {tokens_per_chunk}")
        L = layout.num_layers
        lpp = layers_per_piece or max(1, -(-L // 4))
        if not 1 <= lpp <= L:
            raise ValueError(f"layers_per_piece must be in [1, {L}], got {layers_per_piece}")
        if ring < 2:
            raise ValueError(f"ring must be >= 2, got {ring}")
        self.layout = layout
        self.tokens = tokens_per_chunk
        self.chunk_bytes = layout.chunk_bytes(tokens_per_chunk)
        self.mode = mode
        self.zerocopy_max_ctas = zerocopy_max_ctas
        dev = layout.device
        self.kernel_stream = torch.cuda.Stream(dev, priority=priority)
        self.copy_stream = torch.cuda.Stream(dev, priority=priority)
        self._slot_staging = SlotStaging(dev, 32 * tokens_per_chunk)  # host slot mappings (_upload_slots)
        self._copier = None
        if mode == "staged":
            layer_t = layout.layer_ptr_tensor(dev)
            with torch.cuda.device(dev):
                self._copier = _C.StagedCopier(
                    layer_t.data_ptr(),
                    layout.num_layers,
                    layout.num_planes,
                    layout.num_heads,
                    layout.head_size,
                    layout.elem_bytes,
                    layout.block_size,
                    layout.num_blocks,
                    [p.as_tuple() for p in layout.planes],
                    tokens_per_chunk,
                    lpp,
                    ring,
                    layout.vec_bytes(),
                    self.kernel_stream.cuda_stream,
                    self.copy_stream.cuda_stream,
                )

    def _prepare(self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor], wait_stream) -> torch.Tensor:
        """Check the arguments (``ValueError`` before anything is enqueued), order the engine's
        streams after ``wait_stream`` and return the slot mapping on the device."""
        if (
            not isinstance(slot_mapping, torch.Tensor)
            or slot_mapping.dim() != 2
            or slot_mapping.shape[1] != self.tokens
        ):
            raise ValueError(f"slot_mapping must be [C, {self.tokens}] int64")
        if len(host) != slot_mapping.shape[0]:
            raise ValueError(f"{len(host)} host buffers for {slot_mapping.shape[0]} chunks")
        for i, h in enumerate(host):
            if (
                h.device.type != "cpu"
                or h.dtype != torch.uint8
                or not h.is_contiguous()
                or h.numel() < self.chunk_bytes
            ):
                raise ValueError(f"host buffer {i}: need a contiguous CPU uint8 tensor of >= {self.chunk_bytes} bytes")
            if not h.is_pinned():
                raise ValueError(f"host buffer {i} is not pinned memory")
        ops._check_slots(self.layout, slot_mapping)  # on the host when the mapping is (no device sync)
        self._order_after(wait_stream)
        return self._upload_slots(slot_mapping)

    def _order_after(self, wait_stream) -> None:
        """Order both engine streams after ``wait_stream``'s queued work (default: the current stream)."""
        ready = torch.cuda.Event()
        ready.record(wait_stream or torch.cuda.current_stream(self.layout.device))
        self.kernel_stream.wait_event(ready)
        self.copy_stream.wait_event(ready)

    def _upload_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """``slot_mapping`` on the cache device, and :attr:`kernel_stream` (its only reader) ordered
        after the current stream, where a host mapping is uploaded through :class:`SlotStaging`'s
        reused page-locked buffers. A pageable copy is staged by the driver, which may first wait for
        the stream's queued work: seen on an H100 as a store() that blocked 0.5 s behind the forward
        (tests/test_gpu_connector_worker.py). Measured on the H200, uploading on the kernel stream
        instead, through reused pinned buffers, cost the single-chunk transfer up to ~18 points of the
        memcpy ceiling: RESULTS §1.1."""
        dev = self.layout.device
        cur = torch.cuda.current_stream(dev)
        if slot_mapping.device.type == "cpu":
            slots = self._slot_staging.upload(slot_mapping, cur).contiguous()
        else:
            slots = slot_mapping.to(dev, non_blocking=True).contiguous()
        self.kernel_stream.wait_stream(cur)
        return slots

    def _transfer(self, store: bool, slot_mapping, host, wait_stream) -> torch.cuda.Event:
        host = list(host)
        slots = self._prepare(slot_mapping, host, wait_stream)
        done = torch.cuda.Event()
        if self.mode == "zerocopy":
            fn = ops.gather if store else ops.scatter
            fn(self.layout, slots, host, stream=self.kernel_stream, max_ctas=self.zerocopy_max_ctas, check=False)
            done.record(self.kernel_stream)
        else:
            ptrs = [h.data_ptr() for h in host]
            if store:
                self._copier.store(slots.data_ptr(), ptrs)
                done.record(self.copy_stream)
            else:
                self._copier.load(slots.data_ptr(), ptrs)
                done.record(self.kernel_stream)
        slots.record_stream(self.kernel_stream)
        return done

    def store(
        self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor], *, wait_stream: torch.cuda.Stream | None = None
    ) -> torch.cuda.Event:
        """Gather ``C`` chunks (``slot_mapping [C, T]`` int64, CPU or cache device) into pinned ``host`` buffers.

        Returns an event that completes when every byte is in ``host``. Raises ``ValueError`` on
        bad arguments before anything is enqueued.
        """
        return self._transfer(True, slot_mapping, host, wait_stream)

    def load(
        self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor], *, wait_stream: torch.cuda.Stream | None = None
    ) -> torch.cuda.Event:
        """Scatter ``C`` pinned host chunks into the cache at ``slot_mapping``; returns the completion event.

        Padding slots (< 0) are not written. Raises ``ValueError`` on bad arguments.
        """
        return self._transfer(False, slot_mapping, host, wait_stream)

    def load_layerwise(
        self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor], *, wait_stream: torch.cuda.Stream | None = None
    ) -> list[torch.cuda.Event]:
        """Scatter ``C`` pinned host chunks into the cache layer by layer; returns one event per layer.

        Same arguments and checks as :meth:`load`, but the copies are enqueued layer-major (every
        chunk's piece ``p`` — ``layers_per_piece`` layers — before any chunk's piece ``p + 1``) and an
        event is recorded after each piece: ``events[l]`` completes once layer ``l`` (and every earlier
        layer) of every chunk is in the cache, so a forward can wait for layer ``l`` alone
        (``stream.wait_event(events[l])``, the ``wait_for_layer_load`` pattern) while later layers are
        still copying. Layers of one piece share an event; ``events[-1]`` completes the whole load.
        Staged mode only (``ValueError`` in zero-copy mode). ``layers_per_piece=1`` gives one event
        per layer.
        """
        if self.mode != "staged":
            raise ValueError("load_layerwise needs the staged mode")
        host = list(host)
        slots = self._prepare(slot_mapping, host, wait_stream)
        ptrs = [h.data_ptr() for h in host]
        cp = self._copier
        events: list[torch.cuda.Event] = []
        for p in range(cp.num_pieces):
            cp.load_pieces(slots.data_ptr(), ptrs, p, p + 1)
            ev = torch.cuda.Event()
            ev.record(self.kernel_stream)
            last = cp.piece_first_layer(p + 1) if p + 1 < cp.num_pieces else self.layout.num_layers
            events.extend([ev] * (last - cp.piece_first_layer(p)))
        slots.record_stream(self.kernel_stream)
        return events
