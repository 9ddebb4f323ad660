"""Pipelined store/load between a CUDA paged KV cache and host chunk buffers.

Default path ("staged"), chosen by measurement (benchmarks/RESULTS.md): the gather kernel copies
a group of chunks from the paged cache into a small *device* staging buffer (device memory moves at
TB/s, so the kernel holds SMs for microseconds), then the copy engine moves each contiguous chunk
over PCIe with ``cudaMemcpyAsync``. Two staging slots and two streams overlap the gather of group
``g + 1`` with the DMA of group ``g``. Loads run the mirror image (DMA into staging, scatter).

"zerocopy" lets the kernel write/read mapped pinned host memory directly. It reaches the link
speed too, but an SM waiting on PCIe starves concurrent kernels (FACTS.md: a concurrent GEMM ran
64-283 % slower), so it is opt-in.

Ordering: every store first waits for ``wait_stream`` (default: the current stream), so blocks
written by the forward pass are read only after that work; the returned event completes when every
byte is in host memory — the caller must not free or reuse the blocks (store) or read the blocks
(load) before it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lmtier import _C, ops
from lmtier.layout import KVLayout

MODES = ("staged", "zerocopy")


class CudaTransferEngine:
    """Moves canonical chunks between one CUDA paged cache and host (pinned) chunk buffers.

    Args:
        layout: the CUDA cache.
        tokens_per_chunk: T; chunk bytes = ``layout.chunk_bytes(T)``.
        group_chunks: chunks per gather/scatter launch (staging holds ``2 * group_chunks`` chunks).
        mode: "staged" (default) or "zerocopy".
        zerocopy_max_ctas: grid cap for the zero-copy kernel (limits SMs held on PCIe).
    """

    def __init__(self, layout: KVLayout, tokens_per_chunk: int, *, group_chunks: int = 2,
                 mode: str = "staged", zerocopy_max_ctas: int = 32) -> None:
        if layout.device.type != "cuda":
            raise ValueError(f"CudaTransferEngine needs a CUDA cache, got {layout.device}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if group_chunks < 1:
            raise ValueError(f"group_chunks must be >= 1, got {group_chunks}")
        self.layout = layout
        self.tokens = tokens_per_chunk
        self.chunk_bytes = layout.chunk_bytes(tokens_per_chunk)
        self.group = group_chunks
        self.mode = mode
        self.zerocopy_max_ctas = zerocopy_max_ctas
        dev = layout.device
        self.kernel_stream = torch.cuda.Stream(dev)
        self.copy_stream = torch.cuda.Stream(dev)
        self.staging = (torch.empty(2, group_chunks, self.chunk_bytes, dtype=torch.uint8, device=dev)
                        if mode == "staged" else None)
        self._slot_free = [torch.cuda.Event(), torch.cuda.Event()]
        for e in self._slot_free:
            e.record(self.copy_stream)

    def _check(self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor]) -> None:
        if slot_mapping.dim() != 2 or slot_mapping.shape[1] != self.tokens:
            raise ValueError(f"slot_mapping must be [C, {self.tokens}], got {tuple(slot_mapping.shape)}")
        if len(host) != slot_mapping.shape[0]:
            raise ValueError(f"{len(host)} host buffers for {slot_mapping.shape[0]} chunks")
        for i, h in enumerate(host):
            if h.device.type != "cpu" or h.dtype != torch.uint8 or not h.is_contiguous() or h.numel() < self.chunk_bytes:
                raise ValueError(f"host buffer {i}: need a contiguous CPU uint8 tensor of >= {self.chunk_bytes} bytes")
            if not h.is_pinned():
                raise ValueError(f"host buffer {i} is not pinned memory")

    def _prepare_slots(self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor]) -> torch.Tensor:
        self._check(slot_mapping, host)
        if slot_mapping.device.type == "cpu":  # validate on the host: no device sync
            ops._check_slots(self.layout, slot_mapping)
            return slot_mapping.to(self.layout.device, non_blocking=True)
        ops._check_slots(self.layout, slot_mapping)
        return slot_mapping

    def store(self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor], *,
              wait_stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """Gather ``C`` chunks (``slot_mapping [C, T]`` int64 on the cache's device) into ``host``."""
        host = list(host)
        slot_mapping = self._prepare_slots(slot_mapping, host)
        ready = torch.cuda.Event()
        ready.record(wait_stream or torch.cuda.current_stream(self.layout.device))
        done = torch.cuda.Event()
        if self.mode == "zerocopy":
            self.kernel_stream.wait_event(ready)
            ops.gather(self.layout, slot_mapping, host, stream=self.kernel_stream,
                       max_ctas=self.zerocopy_max_ctas, check=False)
            done.record(self.kernel_stream)
            return done
        self.kernel_stream.wait_event(ready)
        for g, start in enumerate(range(0, len(host), self.group)):
            n = min(self.group, len(host) - start)
            s = g % 2
            stage = self.staging[s]
            self.kernel_stream.wait_event(self._slot_free[s])
            ops.gather(self.layout, slot_mapping[start:start + n], stage[:n], stream=self.kernel_stream, check=False)
            gathered = torch.cuda.Event()
            gathered.record(self.kernel_stream)
            self.copy_stream.wait_event(gathered)
            for i in range(n):
                _C.memcpy_async(host[start + i].data_ptr(), stage[i].data_ptr(), self.chunk_bytes,
                                self.copy_stream.cuda_stream)
            self._slot_free[s] = torch.cuda.Event()
            self._slot_free[s].record(self.copy_stream)
        done.record(self.copy_stream)
        return done

    def load(self, slot_mapping: torch.Tensor, host: Sequence[torch.Tensor], *,
             wait_stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """Scatter ``C`` host chunks into the cache at ``slot_mapping``; returns the completion event."""
        host = list(host)
        slot_mapping = self._prepare_slots(slot_mapping, host)
        ready = torch.cuda.Event()
        ready.record(wait_stream or torch.cuda.current_stream(self.layout.device))
        done = torch.cuda.Event()
        if self.mode == "zerocopy":
            self.kernel_stream.wait_event(ready)
            ops.scatter(self.layout, slot_mapping, host, stream=self.kernel_stream,
                        max_ctas=self.zerocopy_max_ctas, check=False)
            done.record(self.kernel_stream)
            return done
        self.copy_stream.wait_event(ready)
        for g, start in enumerate(range(0, len(host), self.group)):
            n = min(self.group, len(host) - start)
            s = g % 2
            stage = self.staging[s]
            self.copy_stream.wait_event(self._slot_free[s])
            for i in range(n):
                _C.memcpy_async(stage[i].data_ptr(), host[start + i].data_ptr(), self.chunk_bytes,
                                self.copy_stream.cuda_stream)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
            self.kernel_stream.wait_event(copied)
            ops.scatter(self.layout, slot_mapping[start:start + n], stage[:n], stream=self.kernel_stream, check=False)
            self._slot_free[s] = torch.cuda.Event()
            self._slot_free[s].record(self.kernel_stream)
        done.record(self.kernel_stream)
        return done
