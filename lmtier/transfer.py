"""Pipelined store/load between a CUDA paged KV cache and host chunk buffers.

Default path ("staged"), chosen by measurement (benchmarks/RESULTS.md): the gather kernel copies a
*piece* — a range of layers of one chunk, contiguous in the layer-major canonical layout — from the
paged cache into a small device staging ring (device memory moves at TB/s, so the kernel holds SMs
for microseconds), then the copy engine moves the piece over PCIe with ``cudaMemcpyAsync``. The ring
and two streams overlap the gather of piece ``i + 1`` with the DMA of piece ``i``, so even a single
chunk runs close to the link speed. Loads are the mirror image (DMA into staging, then scatter).

"zerocopy" lets the kernel write/read mapped pinned host memory directly. It reaches the link too,
but SMs waiting on PCIe starve concurrent kernels (FACTS.md and our interference benchmark: a
concurrent GEMM runs 39-123 % slower), so it is opt-in.

Ordering: every transfer first waits for ``wait_stream`` (default: the current stream), so blocks
written by the forward pass are read only after that work; the returned event completes when every
byte has arrived. The caller must not reuse the blocks (store) or read them (load) before it.
One engine runs one transfer at a time in stream order; use one engine per direction for
concurrent stores and loads.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from lmtier import _C, ops
from lmtier.layout import KVLayout

MODES = ("staged", "zerocopy")


class CudaTransferEngine:
    """Moves canonical chunks between one CUDA paged cache and pinned host chunk buffers.

    Args:
        layout: the CUDA cache.
        tokens_per_chunk: T; chunk bytes = ``layout.chunk_bytes(T)``.
        layers_per_piece: layers per pipeline piece (default: a quarter of the layers).
        ring: staging ring slots (pieces in flight).
        mode: "staged" (default) or "zerocopy".
        zerocopy_max_ctas: grid cap for the zero-copy kernel (limits SMs held on PCIe).
    """

    def __init__(self, layout: KVLayout, tokens_per_chunk: int, *, layers_per_piece: int | None = None,
                 ring: int = 3, mode: str = "staged", zerocopy_max_ctas: int = 32) -> None:
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
        self.layer_bytes = self.chunk_bytes // L
        self.mode = mode
        self.zerocopy_max_ctas = zerocopy_max_ctas
        # (first layer, sub-layout) per piece; a sub-layout addresses layers [l0, l0 + n).
        self.pieces = [
            (l0, dataclasses.replace(layout, num_layers=min(lpp, L - l0),
                                     layer_ptrs=layout.layer_ptrs[l0:l0 + lpp], _cache={}))
            for l0 in range(0, L, lpp)
        ]
        dev = layout.device
        self.kernel_stream = torch.cuda.Stream(dev)
        self.copy_stream = torch.cuda.Stream(dev)
        self.ring = ring
        self.staging = (torch.empty(ring, lpp * self.layer_bytes, dtype=torch.uint8, device=dev)
                        if mode == "staged" else None)
        self._free: list[torch.cuda.Event] = []
        for _ in range(ring):
            e = torch.cuda.Event()
            e.record(self.copy_stream)
            self._free.append(e)
        self._next = 0

    def _prepare(self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor]) -> torch.Tensor:
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 2 or slot_mapping.shape[1] != self.tokens:
            raise ValueError(f"slot_mapping must be [C, {self.tokens}] int64")
        if len(host) != slot_mapping.shape[0]:
            raise ValueError(f"{len(host)} host buffers for {slot_mapping.shape[0]} chunks")
        for i, h in enumerate(host):
            if h.device.type != "cpu" or h.dtype != torch.uint8 or not h.is_contiguous() or h.numel() < self.chunk_bytes:
                raise ValueError(f"host buffer {i}: need a contiguous CPU uint8 tensor of >= {self.chunk_bytes} bytes")
            if not h.is_pinned():
                raise ValueError(f"host buffer {i} is not pinned memory")
        ops._check_slots(self.layout, slot_mapping)  # on the host when the mapping is (no device sync)
        return slot_mapping.to(self.layout.device, non_blocking=True)

    def _ready(self, wait_stream) -> torch.cuda.Event:
        ready = torch.cuda.Event()
        ready.record(wait_stream or torch.cuda.current_stream(self.layout.device))
        return ready

    def store(self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor], *,
              wait_stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """Gather ``C`` chunks (``slot_mapping [C, T]`` int64, CPU or cache device) into ``host``.

        Returns an event that completes when every byte is in ``host``. Raises ``ValueError`` on
        bad arguments before anything is enqueued.
        """
        host = list(host)
        slots = self._prepare(slot_mapping, host)
        ready = self._ready(wait_stream)
        done = torch.cuda.Event()
        self.kernel_stream.wait_event(ready)
        if self.mode == "zerocopy":
            ops.gather(self.layout, slots, host, stream=self.kernel_stream, max_ctas=self.zerocopy_max_ctas, check=False)
            done.record(self.kernel_stream)
            return done
        cs = self.copy_stream.cuda_stream
        for c in range(len(host)):
            for l0, sub in self.pieces:
                r = self._next
                self._next = (r + 1) % self.ring
                nbytes = sub.num_layers * self.layer_bytes
                stage = self.staging[r, :nbytes]
                self.kernel_stream.wait_event(self._free[r])
                ops.gather(sub, slots[c:c + 1], stage.view(1, nbytes), stream=self.kernel_stream, check=False)
                gathered = torch.cuda.Event()
                gathered.record(self.kernel_stream)
                self.copy_stream.wait_event(gathered)
                _C.memcpy_async(host[c].data_ptr() + l0 * self.layer_bytes, stage.data_ptr(), nbytes, cs)
                self._free[r] = torch.cuda.Event()
                self._free[r].record(self.copy_stream)
        done.record(self.copy_stream)
        return done

    def load(self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor], *,
             wait_stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """Scatter ``C`` host chunks into the cache at ``slot_mapping``; returns the completion event.

        Padding slots (< 0) are not written. Raises ``ValueError`` on bad arguments.
        """
        host = list(host)
        slots = self._prepare(slot_mapping, host)
        ready = self._ready(wait_stream)
        done = torch.cuda.Event()
        if self.mode == "zerocopy":
            self.kernel_stream.wait_event(ready)
            ops.scatter(self.layout, slots, host, stream=self.kernel_stream, max_ctas=self.zerocopy_max_ctas, check=False)
            done.record(self.kernel_stream)
            return done
        self.copy_stream.wait_event(ready)
        self.kernel_stream.wait_event(ready)
        cs = self.copy_stream.cuda_stream
        for c in range(len(host)):
            for l0, sub in self.pieces:
                r = self._next
                self._next = (r + 1) % self.ring
                nbytes = sub.num_layers * self.layer_bytes
                stage = self.staging[r, :nbytes]
                self.copy_stream.wait_event(self._free[r])
                _C.memcpy_async(stage.data_ptr(), host[c].data_ptr() + l0 * self.layer_bytes, nbytes, cs)
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
                self.kernel_stream.wait_event(copied)
                ops.scatter(sub, slots[c:c + 1], stage.view(1, nbytes), stream=self.kernel_stream, check=False)
                self._free[r] = torch.cuda.Event()
                self._free[r].record(self.kernel_stream)
        done.record(self.kernel_stream)
        return done
