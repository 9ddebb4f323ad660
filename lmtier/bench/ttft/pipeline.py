"""The timed load paths of ``lmtier bench ttft``: the vLLM connector's data path filling a paged KV cache.

Nothing here copies, fetches or decodes KV by itself. Every timed load is a
:class:`lmtier.integration.vllm.worker.ConnectorWorker` load — the code a vLLM user runs (the
connector's worker role drives the same object) — of one :class:`~lmtier.integration.vllm.loadstore.LoadOp`
naming the request's blocks of the bench's paged cache:

* **Tiers** are :class:`lmtier.manager.TierManager` objects built by
  :meth:`~lmtier.manager.TierManager.from_config` (:func:`build_manager`): the CPU pool, the disk tier
  and the Redis / Mooncake tiers, each optionally wrapped in :class:`lmtier.tiers.codec.CodecTier` (the
  ``cachegen`` serde) or, at a PCA level, :class:`lmtier.tiers.codec_pca.PCACodecTier`
  (``codec_pca_model``).
* **CPU-pool hits** are pinned in the pool and copied from their slots; **disk / Redis hits** are
  read by ``manager.fetch_lower`` on the worker's ``--inflight`` I/O threads (several chunks in
  flight) into the worker's reused, page-aligned staging buffers (pinned with CUDA; the bench's
  lower-tier managers have no CPU pool, so nothing is promoted and every timed load reads its
  tier). Codec records: on a CUDA cache the worker decodes them on the GPU into device staging and
  scatters device -> paged blocks (``--codec-decode device``, the worker's default for codec
  tiers), or on the host (``host``).
* **Into the cache**: the worker's ``load_layerwise`` (CUDA: one
  :meth:`lmtier.transfer.CudaTransferEngine.load_layerwise`, one event per ``--layers-per-wait``
  layers); the lean forward calls ``wait_layer(l)`` right before layer ``l`` and
  ``finish_layerwise`` after it, so the forward overlaps the copies. ``load_ms`` uses the worker's
  synchronous ``load``. On the CPU every copy is a :func:`lmtier.ops.scatter`.
* **Destination**: :class:`PagedKV`, a vLLM-style paged cache (physical order LBNHC, K and V side by
  side in ``C = 2 * head_size``) holding the request's tokens in order in blocks ``0, 1, ...``; the
  model reads per-layer strided K/V views of it.

Chunks are ``T = --chunk-tokens`` tokens; a prefix of ``N`` tokens is ``C = ceil(N / T)`` chunks,
the last one stored zero-padded to ``T`` tokens (every tier stores whole chunks). The connector
loads whole chunks, so the cache holds ``C * T`` tokens and the tail chunk's padding lands past
``N`` (the forward writes token ``N`` after the load).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lmtier.config import LMTierConfig
from lmtier.integration.vllm.fetch import DEFAULT_FETCH_BATCH
from lmtier.integration.vllm.worker import ConnectorWorker, LoadOp
from lmtier.keys import Namespace
from lmtier.layout import KVLayout, make_paged_kv_cache, slot_mapping_from_block_ids
from lmtier.manager import TierManager
from lmtier.tiers.factory import DiskFactory, RemoteFactory, default_disk_factory, default_remote_factory

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
        chunk_tokens: when given, the cache also holds the prefix's whole chunks
            (``ceil(N / T) * T`` tokens): the connector's loads write whole chunks, the tail chunk's
            padding included (the forward then writes token ``N``).
        dtype, device: of the cache.

    Attributes:
        buf: ``[L, B, block_size, H, 2 * D]`` (LBNHC), uninitialised; ``B = num_blocks``.
        layout: its :class:`lmtier.layout.KVLayout` (``kind="kv"``), what the load paths write.
        region: ``[L, B * block_size, H, 2 * D]`` view of ``buf``: blocks ``0..B-1`` of one layer
            are contiguous, token ``t`` is row ``t``, K in channels ``[0, D)``, V in ``[D, 2D)``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_heads: int,
        head_size: int,
        num_tokens: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        chunk_tokens: int | None = None,
    ) -> None:
        L, H, D = num_layers, num_heads, head_size
        self.n = num_tokens
        self.block_size = block_size
        whole = -(-num_tokens // chunk_tokens) * chunk_tokens if chunk_tokens else 0
        self.num_blocks = -(-max(num_tokens + 1, whole) // block_size)
        self.buf, views = make_paged_kv_cache(
            "LBNHC",
            num_layers=L,
            num_blocks=self.num_blocks,
            block_size=block_size,
            num_heads=H,
            head_size=D,
            dtype=dtype,
            device=device,
            kind="kv",
        )
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
        return slot_mapping_from_block_ids(
            ids, block_size=self.block_size, tokens_per_chunk=chunk_tokens, num_tokens=[tc for _, tc in spans]
        )


def build_manager(
    *,
    chunk_tokens: int,
    namespace: Namespace,
    cpu_bytes: int | None = None,
    disk_dir: str | None = None,
    disk_bytes: int = 0,
    io_threads: int = 4,
    remote_url: str | None = None,
    serde: str = "naive",
    codec_level: str = "default",
    codec_pca_model: str | None = None,
    remote_timeout_s: float = 30.0,
    remote_options: dict[str, Any] | None = None,
    disk_factory: DiskFactory = default_disk_factory,
    remote_factory: RemoteFactory = default_remote_factory,
) -> TierManager:
    """A :class:`TierManager` from the configuration a user would write (:meth:`LMTierConfig.from_dict`
    then :meth:`TierManager.from_config`).

    Args:
        cpu_bytes: the CPU pool's size (``max_local_cpu_size``), or None for ``local_cpu: false``.
        disk_dir, disk_bytes, io_threads: ``local_disk``, ``max_local_disk_size``, ``disk_io_threads``.
        remote_url, remote_timeout_s: ``remote_url``, ``remote_timeout_s``.
        remote_options: more configuration keys of the remote tier (e.g. ``mooncake_global_segment_size``).
        serde, codec_level: ``local_disk_serde`` / ``remote_serde`` (``naive`` or ``cachegen``) of the
            enabled lower tier, and ``codec_level``.
        codec_pca_model: ``codec_pca_model``, the model file of a PCA ``codec_level`` (``cachegen``
            serde only; the tier is then a :class:`~lmtier.tiers.codec_pca.PCACodecTier`).
        disk_factory, remote_factory: passed to ``from_config`` (to wrap a tier in a
            :class:`~lmtier.tiers.codec.CodecTier` with other tables than the shipped ones).

    Raises:
        lmtier.config.ConfigError: a value the configuration rejects.
    """
    values: dict[str, Any] = {
        "chunk_size": chunk_tokens,
        "local_cpu": cpu_bytes is not None,
        "disk_io_threads": io_threads,
    }
    if cpu_bytes is not None:
        values["max_local_cpu_size"] = cpu_bytes / GIB
    if disk_dir is not None:
        values.update(local_disk=disk_dir, max_local_disk_size=max(disk_bytes, 1 << 26) / GIB, local_disk_serde=serde)
    if remote_url is not None:
        values.update(remote_url=remote_url, remote_serde=serde, remote_timeout_s=remote_timeout_s)
        values.update(remote_options or {})
    if serde == "cachegen":
        values["codec_level"] = codec_level
        if codec_pca_model is not None:
            values["codec_pca_model"] = codec_pca_model
    config = LMTierConfig.from_dict(values)
    return TierManager.from_config(config, namespace, disk_factory=disk_factory, remote_factory=remote_factory)


class Loader:
    """The timed loads into one :class:`PagedKV`, through the vLLM connector's data path.

    One :class:`lmtier.integration.vllm.worker.ConnectorWorker` per tier manager (created on first
    use, over ``kv.layout``), and one :class:`~lmtier.integration.vllm.loadstore.LoadOp` naming the
    request's blocks ``0 .. ceil(C * T / block_size) - 1`` and its prompt prefix ``token_ids``
    (``C * T`` tokens: whole chunks, the keys the chunks were stored under).

    Args:
        kv: the destination cache (built with ``chunk_tokens`` so it holds whole chunks).
        chunk_tokens: ``T``.
        namespace: the chunks' key space (its ``chunk_bytes`` equals ``kv.layout.chunk_bytes(T)``).
        token_ids: the ``C * T`` prompt tokens whose chunks are loaded; ``cache_salt``: their salt.
        layers_per_wait: layers per event of the worker's layer-by-layer loads (CUDA).
        io_threads: the worker's I/O threads (chunk fetches in flight, ``--inflight``).
        fetch_batch: the worker's ``fetch_batch`` (``--fetch-batch``).
        max_staging_bytes: host staging the worker keeps for reuse (loads without a CPU pool).
    """

    def __init__(
        self,
        kv: PagedKV,
        *,
        chunk_tokens: int,
        namespace: Namespace,
        token_ids: list[int],
        cache_salt: str | None,
        layers_per_wait: int,
        io_threads: int,
        max_staging_bytes: int,
        fetch_batch: int = DEFAULT_FETCH_BATCH,
    ) -> None:
        self.kv = kv
        self.T = chunk_tokens
        self.ns = namespace
        self.chunk_bytes = kv.layout.chunk_bytes(chunk_tokens)
        C = len(token_ids) // chunk_tokens
        blocks = -(-C * chunk_tokens // kv.block_size)
        if blocks > kv.num_blocks:
            raise ValueError(f"the cache has {kv.num_blocks} blocks, {C} chunks need {blocks}")
        self.op_args = {
            "token_ids": list(token_ids),
            "cache_salt": cache_salt,
            "start_token": 0,
            "block_ids": list(range(blocks)),
        }
        self.lpw = layers_per_wait
        self.io_threads = io_threads
        self.fetch_batch = fetch_batch
        self.max_staging_bytes = max_staging_bytes
        self.workers: dict[int, tuple[TierManager, ConnectorWorker]] = {}

    def worker(self, manager: TierManager, *, decode_on: str = "auto") -> ConnectorWorker:
        """The connector worker over ``manager`` (``decode_on`` as :class:`ConnectorWorker`'s, fixed
        at the first call for this manager)."""
        got = self.workers.get(id(manager))
        if got is None:
            w = ConnectorWorker(
                self.kv.layout,
                manager,
                chunk_size=self.T,
                block_size=self.kv.block_size,
                namespace=self.ns,
                io_threads=self.io_threads,
                fetch_batch=self.fetch_batch,
                layers_per_wait=self.lpw,
                decode_on=decode_on,
                max_staging_bytes=self.max_staging_bytes,
            )
            w.prepare_layerwise()
            got = self.workers[id(manager)] = (manager, w)
        return got[1]

    def load(
        self, manager: TierManager, forward: Forward, *, decode_on: str = "auto", forward_only_after: bool = False
    ) -> torch.Tensor:
        """Load the request's chunks from ``manager``'s tiers and run ``forward``.

        ``ConnectorWorker.load_layerwise`` (CPU-pool hits pinned, disk/Redis hits fetched in
        parallel; codec records decoded on the GPU into device staging where ``decode_on``
        resolves to ``device``), then ``forward(worker.wait_layer)`` — the forward's layer ``l``
        waits for its layers' copy — then ``finish_layerwise`` and the release of the chunks.
        ``forward_only_after``: ``ConnectorWorker.load`` (the whole load first), then
        ``forward(None)``.

        Raises:
            RuntimeError: a chunk could not be loaded (the worker reported failed blocks), or the
                forward did not wait for every layer.
        """
        w = self.worker(manager, decode_on=decode_on)
        op = LoadOp(req_id="ttft", **self.op_args)
        if forward_only_after:
            failed = w.load(op)
            if failed:
                raise RuntimeError(f"the connector worker failed {len(failed)} block(s) of the load")
            return forward(None)
        failed = w.load_layerwise([op]).get(op.req_id)
        try:
            if failed:
                raise RuntimeError(f"the connector worker failed {len(failed)} block(s) of the load")
            out = forward(w.wait_layer)
        finally:
            late = w.finish_layerwise()
            w.drain_layerwise(block=True)
        if late:
            raise RuntimeError("the forward did not wait for every layer of the layer-by-layer load")
        return out

    def release(self, manager: TierManager) -> None:
        """Close the worker over ``manager`` (its engines' streams and staging go with it), if any."""
        got = self.workers.pop(id(manager), None)
        if got is not None:
            got[1].close()

    def close(self) -> None:
        """Close every worker (waits for whatever they have in flight)."""
        for _, w in self.workers.values():
            w.close()
        self.workers = {}


def landing_views(buf: torch.Tensor, count: int, chunk_bytes: int) -> list[torch.Tensor]:
    """``count`` chunk buffers of ``chunk_bytes`` at 4 KiB-aligned offsets of the uint8 ``buf``."""
    step = math.ceil(chunk_bytes / 4096) * 4096
    if count * step > buf.numel():
        raise ValueError(f"landing buffer of {buf.numel()} bytes holds fewer than {count} chunks")
    return [buf[c * step : c * step + chunk_bytes] for c in range(count)]
