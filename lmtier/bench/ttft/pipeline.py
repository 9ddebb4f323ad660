"""The timed load paths of ``lmtier bench ttft``: lmtier's own product code filling a paged KV cache.

Nothing here copies or decodes KV by itself. Per load:

* **Tiers** are :class:`lmtier.manager.TierManager` objects built by
  :meth:`~lmtier.manager.TierManager.from_config` (:func:`build_manager`): the CPU pool, the disk tier
  and the Redis tier, each optionally wrapped in :class:`lmtier.tiers.codec.CodecTier` (the
  ``cachegen`` serde).
* **CPU-pool hits** are pinned in the pool (``manager.cpu.acquire``) and copied from their slots,
  as the vLLM connector's worker does (:mod:`lmtier.integration.vllm.worker`).
* **Disk / Redis hits** are read by ``manager.fetch_lower`` on ``--inflight`` I/O threads (several
  chunks in flight) into page-aligned landing buffers (pinned with CUDA): O_DIRECT / direct socket
  reads land there without a bounce; codec records are decoded by ``CodecTier.get_into`` on the
  host (the connector's path today), or — ``--codec-decode device`` — into device buffers on the
  GPU, then scattered by :func:`lmtier.ops.scatter`.
* **Host -> device**: on CUDA one :meth:`lmtier.transfer.CudaTransferEngine.load_layerwise` over all
  chunks (the worker's ``load_layerwise``: one event per ``--layers-per-wait`` layers); the lean
  forward waits for layer ``l``'s event right before layer ``l`` (the ``wait_layer`` pattern), so
  the forward overlaps the copies. On the CPU one :func:`lmtier.ops.scatter`.
* **Destination**: :class:`PagedKV`, a vLLM-style paged cache (physical order LBNHC, K and V side by
  side in ``C = 2 * head_size``) of ``ceil((N + 1) / block_size)`` blocks holding the request's
  tokens in order; the model reads per-layer strided K/V views of it.

Chunks are ``T = --chunk-tokens`` tokens; a prefix of ``N`` tokens is ``ceil(N / T)`` chunks, the
last one stored zero-padded to ``T`` tokens (every tier stores whole chunks) and loaded with padding
slots (-1) past ``N``, so only the ``N`` prefix tokens are written.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from lmtier import ops
from lmtier.config import LMTierConfig
from lmtier.keys import Namespace
from lmtier.layout import KVLayout, make_paged_kv_cache, slot_mapping_from_block_ids
from lmtier.manager import DiskFactory, RemoteFactory, TierManager, default_disk_factory, default_remote_factory

__all__ = ["PagedKV", "Loader", "build_manager", "chunk_spans", "landing_views", "GIB"]

GIB = float(1 << 30)

Forward = Callable[[Callable[[int], None] | None], torch.Tensor]
"""``forward(wait)``: the lean last-token forward; ``wait(l)`` (or None) runs before layer ``l``'s attention."""


def chunk_spans(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``(first token, tokens)`` of each chunk of an ``n``-token prefix (the last may be short)."""
    return [(s, min(chunk_tokens, n - s)) for s in range(0, n, chunk_tokens)]


class PagedKV:
    """The KV cache the lean forward reads: vLLM's paged layout, the request's blocks in order.

    Args:
        num_layers, num_heads, head_size: the model's KV geometry (KV heads).
        num_tokens: ``N``, the prefix length; the cache holds ``N + 1`` tokens (the new one at ``N``).
        block_size: tokens per block (a divisor of the chunk size).
        dtype, device: of the cache.

    Attributes:
        buf: ``[L, B, block_size, H, 2 * D]`` (LBNHC), uninitialised.
        layout: its :class:`lmtier.layout.KVLayout` (``kind="kv"``), what the load paths write.
        region: ``[L, B * block_size, H, 2 * D]`` view of ``buf``: blocks ``0..B-1`` of one layer
            are contiguous, token ``t`` is row ``t``, K in channels ``[0, D)``, V in ``[D, 2D)``.
    """

    def __init__(self, *, num_layers: int, num_heads: int, head_size: int, num_tokens: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        L, H, D = num_layers, num_heads, head_size
        self.n = num_tokens
        self.block_size = block_size
        self.num_blocks = -(-(num_tokens + 1) // block_size)
        self.buf, views = make_paged_kv_cache("LBNHC", num_layers=L, num_blocks=self.num_blocks, block_size=block_size,
                                              num_heads=H, head_size=D, dtype=dtype, device=device, kind="kv")
        self.layout = KVLayout.from_layer_views(views, kind="kv")
        self.region = self.buf.view(L, self.num_blocks * block_size, H, 2 * D)
        self.L, self.H, self.D = L, H, D

    def k_of(self, l: int) -> torch.Tensor:
        """Layer ``l``'s keys of tokens ``0..N`` as ``[1, H, N + 1, D]`` (a strided view)."""
        return self.region[l, : self.n + 1, :, : self.D].permute(1, 0, 2).unsqueeze(0)

    def v_of(self, l: int) -> torch.Tensor:
        """Layer ``l``'s values of tokens ``0..N`` as ``[1, H, N + 1, D]`` (a strided view)."""
        return self.region[l, : self.n + 1, :, self.D :].permute(1, 0, 2).unsqueeze(0)

    def new_k(self, l: int) -> torch.Tensor:
        """``[H, D]``: where the new token's (position ``N``) key of layer ``l`` goes."""
        return self.region[l, self.n, :, : self.D]

    def new_v(self, l: int) -> torch.Tensor:
        return self.region[l, self.n, :, self.D :]

    def views(self):
        """``(k_of, v_of, new_k, new_v)`` for :class:`lmtier.bench.ttft.model.LeanDecoder`."""
        return self.k_of, self.v_of, self.new_k, self.new_v

    def canonical(self, n: int | None = None) -> torch.Tensor:
        """Tokens ``0..n-1`` (default ``N``) as a canonical-order view ``[L, 2, n, H, D]``."""
        n = self.n if n is None else n
        return self.region[:, :n].view(self.L, n, self.H, 2, self.D).permute(0, 3, 1, 2, 4)

    def slot_mapping(self, chunk_tokens: int) -> torch.Tensor:
        """``[C, T]`` int64 (CPU) slots of the prefix's chunks; tokens at or past ``N`` are -1."""
        if chunk_tokens % self.block_size:
            raise ValueError(f"block size {self.block_size} does not divide the chunk size {chunk_tokens}")
        spans = chunk_spans(self.n, chunk_tokens)
        per = chunk_tokens // self.block_size
        ids = torch.arange(len(spans) * per, dtype=torch.int64).view(len(spans), per)
        ids = torch.where(ids < self.num_blocks, ids, torch.full_like(ids, -1))
        return slot_mapping_from_block_ids(ids, block_size=self.block_size, tokens_per_chunk=chunk_tokens,
                                           num_tokens=[tc for _, tc in spans])


def build_manager(*, chunk_tokens: int, namespace: Namespace, cpu_bytes: int | None = None,
                  disk_dir: str | None = None, disk_bytes: int = 0, io_threads: int = 4,
                  remote_url: str | None = None, serde: str = "naive", codec_level: str = "default",
                  remote_timeout_s: float = 30.0, disk_factory: DiskFactory = default_disk_factory,
                  remote_factory: RemoteFactory = default_remote_factory) -> TierManager:
    """A :class:`TierManager` from the configuration a user would write (:meth:`LMTierConfig.from_dict`
    then :meth:`TierManager.from_config`).

    Args:
        cpu_bytes: the CPU pool's size (``max_local_cpu_size``), or None for ``local_cpu: false``.
        disk_dir, disk_bytes, io_threads: ``local_disk``, ``max_local_disk_size``, ``disk_io_threads``.
        remote_url, remote_timeout_s: ``remote_url``, ``remote_timeout_s``.
        serde, codec_level: ``local_disk_serde`` / ``remote_serde`` (``naive`` or ``cachegen``) of the
            enabled lower tier, and ``codec_level``.
        disk_factory, remote_factory: passed to ``from_config`` (to wrap a tier in a
            :class:`~lmtier.tiers.codec.CodecTier` with other tables than the shipped ones).

    Raises:
        lmtier.config.ConfigError: a value the configuration rejects.
    """
    values: dict[str, Any] = {"chunk_size": chunk_tokens, "local_cpu": cpu_bytes is not None,
                              "disk_io_threads": io_threads}
    if cpu_bytes is not None:
        values["max_local_cpu_size"] = cpu_bytes / GIB
    if disk_dir is not None:
        values.update(local_disk=disk_dir, max_local_disk_size=max(disk_bytes, 1 << 26) / GIB, local_disk_serde=serde)
    if remote_url is not None:
        values.update(remote_url=remote_url, remote_serde=serde, remote_timeout_s=remote_timeout_s)
    if serde == "cachegen":
        values["codec_level"] = codec_level
    config = LMTierConfig.from_dict(values)
    return TierManager.from_config(config, namespace, disk_factory=disk_factory, remote_factory=remote_factory)


class Loader:
    """The load paths into one :class:`PagedKV` (one context length).

    Args:
        kv: the destination cache.
        chunk_tokens: ``T``; ``chunk_bytes``: ``kv.layout.chunk_bytes(T)``.
        layers_per_wait: layers per event of the layer-by-layer copy (CUDA).
        ring: staging ring slots of the :class:`~lmtier.transfer.CudaTransferEngine`.
        io_pool: the I/O threads that run ``fetch_lower`` (``--inflight`` of them).

    CUDA: two engines on the cache, like the connector's worker — ``layer_engine`` for
    ``load_layerwise`` (highest stream priority, ``layers_per_piece = layers_per_wait``) and
    ``engine`` for whole loads (``load_ms``).
    """

    def __init__(self, kv: PagedKV, *, chunk_tokens: int, layers_per_wait: int, ring: int,
                 io_pool: ThreadPoolExecutor) -> None:
        self.kv = kv
        self.T = chunk_tokens
        self.chunk_bytes = kv.layout.chunk_bytes(chunk_tokens)
        self.device = kv.layout.device
        self.cuda = self.device.type == "cuda"
        self.slots = kv.slot_mapping(chunk_tokens)
        self.num_chunks = int(self.slots.shape[0])
        self.io = io_pool
        self.engine = self.layer_engine = None
        self.slots_dev = self.slots.to(self.device)
        if self.cuda:
            from lmtier.transfer import CudaTransferEngine

            self.layer_engine = CudaTransferEngine(kv.layout, chunk_tokens, layers_per_piece=layers_per_wait,
                                                   ring=ring, priority=-64)
            self.engine = CudaTransferEngine(kv.layout, chunk_tokens, ring=ring)

    # ---- host -> cache -----------------------------------------------------------------------

    def copy_in(self, srcs: list[torch.Tensor]) -> Callable[[int], None] | None:
        """Copy host chunks ``srcs`` (uint8, ``chunk_bytes`` each, pinned on CUDA) into the cache.

        CUDA: one ``load_layerwise`` after the current stream's work; returns ``wait(l)``, which
        makes the current stream wait for layer ``l``. CPU: one ``ops.scatter``, done on return
        (returns None)."""
        if not self.cuda:
            ops.scatter(self.kv.layout, self.slots, srcs)
            return None
        events = self.layer_engine.load_layerwise(self.slots, srcs)
        cur = torch.cuda.current_stream(self.device)
        return lambda l: cur.wait_event(events[l])

    def copy_all(self, srcs: list[torch.Tensor]) -> None:
        """The same copy in one piece, for the load alone (``load_ms``): ``CudaTransferEngine.load``
        (the current stream waits for it) or ``ops.scatter``."""
        if not self.cuda:
            ops.scatter(self.kv.layout, self.slots, srcs)
            return
        ev = self.engine.load(self.slots, srcs)
        torch.cuda.current_stream(self.device).wait_event(ev)

    def drain(self) -> None:
        """Wait for every copy this loader queued (before the host buffers are released)."""
        if self.cuda:
            for e in (self.layer_engine, self.engine):
                e.kernel_stream.synchronize()
                e.copy_stream.synchronize()

    # ---- the load paths ------------------------------------------------------------------------

    def from_pool(self, manager: TierManager, keys: list[bytes], forward: Forward, *,
                  forward_only_after: bool = False) -> torch.Tensor:
        """CPU-pool hits: pin every chunk's slot, copy from the slots (layer by layer on CUDA,
        overlapped with ``forward``), release the slots once the copies are done.

        ``forward_only_after``: copy in one piece and run ``forward(None)`` after it (no overlap).
        Raises ``RuntimeError`` if a chunk is not in the pool."""
        cpu = manager.cpu
        held = []
        try:
            for c, key in enumerate(keys):
                s = cpu.acquire(key)
                if s is None or s.nbytes < self.chunk_bytes:
                    raise RuntimeError(f"CPU pool: chunk {c} missing or short")
                held.append(s)
            srcs = [s.view[: self.chunk_bytes] for s in held]
            if forward_only_after:
                self.copy_all(srcs)
                return forward(None)
            return forward(self.copy_in(srcs))
        finally:
            self.drain()
            for s in held:
                cpu.release(s)

    def fetch(self, manager: TierManager, keys: list[bytes], landing: list[torch.Tensor]) -> None:
        """``manager.fetch_lower`` of every chunk into ``landing[c]`` on the I/O threads (all in flight
        at once, the pool's threads bounding it); raises ``RuntimeError`` on a miss or short read."""
        futs = [self.io.submit(manager.fetch_lower, key, landing[c]) for c, key in enumerate(keys)]
        bad = None
        for c, f in enumerate(futs):
            got = f.result()
            if got != self.chunk_bytes and bad is None:
                bad = (c, got)
        if bad is not None:
            raise RuntimeError(f"chunk {bad[0]} missing or short ({bad[1]} of {self.chunk_bytes} bytes)")

    def from_lower(self, manager: TierManager, keys: list[bytes], landing: list[torch.Tensor],
                   forward: Forward) -> torch.Tensor:
        """Disk / Redis hits (raw or codec records decoded on the host): fetch every chunk into the
        host ``landing`` buffers, then copy them in as :meth:`from_pool` does."""
        try:
            self.fetch(manager, keys, landing)
            return forward(self.copy_in(landing[: len(keys)]))
        finally:
            self.drain()

    def from_lower_device(self, manager: TierManager, keys: list[bytes], landing: torch.Tensor,
                          forward: Forward) -> torch.Tensor:
        """Codec records decoded on the GPU: ``fetch_lower`` into device chunk buffers
        (``landing [C, chunk_bytes]`` uint8 on the cache's device; ``CodecTier.get_into`` decodes
        there), then one device-side ``ops.scatter`` on the current stream, then ``forward``."""
        self.fetch(manager, keys, [landing[c] for c in range(len(keys))])
        ops.scatter(self.kv.layout, self.slots_dev, landing[: len(keys)], check=False)
        return forward(None)


def landing_views(buf: torch.Tensor, count: int, chunk_bytes: int) -> list[torch.Tensor]:
    """``count`` chunk buffers of ``chunk_bytes`` at 4 KiB-aligned offsets of the uint8 ``buf``."""
    step = math.ceil(chunk_bytes / 4096) * 4096
    if count * step > buf.numel():
        raise ValueError(f"landing buffer of {buf.numel()} bytes holds fewer than {count} chunks")
    return [buf[c * step : c * step + chunk_bytes] for c in range(count)]
