"""The store half of :class:`lmtier.integration.vllm.worker.ConnectorWorker`: paged blocks -> the tiers.

:class:`ChunkStorer` gathers a :class:`~lmtier.integration.vllm.loadstore.StoreOp`'s chunks out of
the paged KV cache into CPU-pool slots (one native call per op) and commits them (visible to
lookups, written through to disk/remote); on a CUDA cache the gather runs on a
:class:`lmtier.transfer.CudaTransferEngine`'s side streams and the slots are committed once its
event completed (:meth:`ChunkStorer.poll_stores`). Without a CPU pool each chunk is gathered into a
scratch buffer and handed to ``manager.store``. See the worker module for the ordering contract.

This module imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from lmtier import ops
from lmtier.integration.vllm.loadstore import StoreOp
from lmtier.layout import KVLayout
from lmtier.manager import TierManager
from lmtier.tiers.tenants import tenant_id

__all__ = ["ChunkStorer"]

log = logging.getLogger("vllm.lmtier.connector")


class ChunkStorer:
    """Executes :class:`StoreOp` s for one paged cache (see the module doc).

    Args:
        layout: the paged cache; ``chunk_size``: tokens per chunk (chunk ``ci`` is stored at
            position ``ci * chunk_size``: :meth:`~lmtier.tiers.base.Tier.takes_position`);
            ``chunk_bytes``: its bytes.
        manager: the tiers.
        keys: ``keys(token_ids, cache_salt) -> (this rank's chunk keys, the index's chunk keys)``.
        slot_mappings: ``slot_mappings(block_ids, chunk_indices) -> [C, chunk]`` int64 CPU slots.
        on_stat, on_stored: as :class:`~lmtier.integration.vllm.worker.ConnectorWorker`'s.

    Attributes: ``pending`` (req id -> [(event, slot, key, index key)] CUDA stores in flight),
    ``engine`` (the CUDA engine, None on CPU), ``scratch`` (the no-pool gather buffer).
    """

    def __init__(
        self,
        layout: KVLayout,
        manager: TierManager,
        *,
        chunk_size: int,
        chunk_bytes: int,
        keys: Callable[[list[int], str | None], tuple[list[bytes], list[bytes]]],
        slot_mappings: Callable[[list[int], list[int]], torch.Tensor],
        on_stat: Callable[..., None],
        on_stored: Callable[[bytes, bytes, str], None],
    ) -> None:
        self.layout = layout
        self.manager = manager
        self.chunk_size = chunk_size
        self.chunk_bytes = chunk_bytes
        self._keys = keys
        self.slot_mappings = slot_mappings
        self._stat = on_stat
        self._on_stored = on_stored
        is_cuda = layout.device.type == "cuda"
        self.scratch = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=is_cuda)
        self.engine = None
        if is_cuda:
            from lmtier.transfer import CudaTransferEngine

            self.engine = CudaTransferEngine(layout, chunk_size)
        self.pending: dict[str, list[tuple[Any, Any, bytes, bytes]]] = {}

    def slot_mapping(self, block_ids: list[int], ci: int) -> torch.Tensor:
        return self.slot_mappings(block_ids, [ci])

    def store(self, op: StoreOp) -> None:
        """Store chunks ``[op.first_chunk, len(op.token_ids) // chunk)`` from ``op.block_ids``.

        Chunk ``ci`` is stored at position ``ci * chunk_size`` (its first token's; kept with its
        slot and passed to the lower tiers that take positions).
        CPU cache: every chunk gets a pool slot (``reserve`` as the tenant of ``op.cache_salt``; none
        when the chunk is present already, every slot is pinned or its tenant may evict nothing —
        skipped; a victim it evicts is not written back here: :meth:`TierManager.no_write_back`),
        all are gathered in one native call, then committed and written through. CUDA
        cache: one gather is queued on the side streams after the current stream's work, and the
        chunks are committed by :meth:`poll_stores` once it arrived (until then the request is in
        ``pending``; do not reuse its blocks). A failing chunk is dropped (logged), never made
        visible.
        """
        cpu = self.manager.cpu
        cb = self.chunk_bytes
        t0 = time.perf_counter()
        keys, keys0 = self._keys(op.token_ids, op.cache_salt)
        tenant = tenant_id(op.cache_salt)
        if cpu is None:
            for ci in range(op.first_chunk, len(keys)):
                try:
                    slots = self.slot_mapping(op.block_ids, ci)
                    if self.engine is None:
                        ops.gather(self.layout, slots, [self.scratch])
                    else:
                        self.engine.store(slots, [self.scratch]).synchronize()
                    pos = ci * self.chunk_size
                    where = self.manager.store_in(
                        keys[ci], self.scratch, timeout_s=None, tenant=tenant, position=pos
                    ).result()
                    if where is not None:
                        self._on_stored(keys[ci], keys0[ci], where)
                        self._stat("stored_chunks")
                        self._stat("stored_bytes", cb)
                except Exception:
                    log.exception("lmtier: store of chunk %d of request %s failed (dropped)", ci, op.req_id)
        else:
            batch: list[tuple[int, Any]] = []  # (chunk index, write slot)
            with self.manager.no_write_back():  # victims reach disk by write-through, not in the step
                for ci in range(op.first_chunk, len(keys)):
                    try:
                        slot = cpu.reserve(keys[ci], tenant=tenant, position=ci * self.chunk_size)
                    except Exception:
                        log.exception("lmtier: store of chunk %d of request %s failed (dropped)", ci, op.req_id)
                        continue
                    if slot is None:  # present already, or every slot pinned (back-pressure)
                        self._stat("store_skipped")
                        continue
                    batch.append((ci, slot))
            if batch:
                try:
                    slots = self.slot_mappings(op.block_ids, [ci for ci, _ in batch])
                    dsts = [s.view[:cb] for _, s in batch]
                    if self.engine is not None:
                        ev = self.engine.store(slots, dsts)
                        self.pending.setdefault(op.req_id, []).extend((ev, s, keys[ci], keys0[ci]) for ci, s in batch)
                    else:
                        ops.gather(self.layout, slots, dsts)
                        for ci, s in batch:
                            self._commit(s, keys[ci], keys0[ci])
                except Exception:
                    log.exception("lmtier: store of %d chunks of request %s failed (dropped)", len(batch), op.req_id)
                    for _, s in batch:
                        try:
                            cpu.abort(s)
                        except RuntimeError:  # committed before the failure
                            pass
        dt = time.perf_counter() - t0
        self._stat("store_ms", dt * 1e3)
        self._stat("store_lat_s", dt)

    def _commit(self, slot: Any, key: bytes, key0: bytes) -> None:
        self.manager.commit(slot, self.chunk_bytes)  # visible, STORED published, written through
        self._on_stored(key, key0, "cpu")
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
