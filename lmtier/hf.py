"""Library helper for Hugging Face transformers: the KV cache of a token sequence <-> canonical chunks.

:class:`KVCacheStore` stores / looks up / retrieves the KV cache of token sequences through a
:class:`lmtier.manager.TierManager`, given a transformers-style per-layer ``(K, V)`` cache
(``DynamicCache`` or the legacy tuple of pairs, each ``[1, num_kv_heads, seq_len, head_size]``).
:func:`pack_kv_chunk` / :func:`unpack_kv_chunk` convert between that layout and the canonical chunk
layout ``[num_layers, 2, chunk_size, num_kv_heads, head_size]`` (see :mod:`lmtier.layout`).
Example: ``examples/library_api.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from lmtier.geometry import TORCH_KV_DTYPES
from lmtier.keys import Namespace, chunk_keys
from lmtier.manager import TierManager

__all__ = ["KVCacheStore", "cache_layers", "pack_kv_chunk", "unpack_kv_chunk", "TORCH_KV_DTYPES"]


def cache_layers(kv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` from a transformers cache (``DynamicCache`` with ``.layers`` or
    ``key_cache``/``value_cache``, or the legacy tuple of pairs), each ``[batch, num_kv_heads,
    seq_len, head_size]`` as the cache holds it (no copy)."""
    layers = getattr(kv, "layers", None)
    if layers is not None and all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(kv, "key_cache") and hasattr(kv, "value_cache"):
        return list(zip(kv.key_cache, kv.value_cache))
    if hasattr(kv, "to_legacy_cache"):
        kv = kv.to_legacy_cache()
    return [(k, v) for k, v in kv]


def pack_kv_chunk(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int, stop: int) -> torch.Tensor:
    """Canonical chunk bytes of tokens ``[start, stop)``.

    Args:
        layers: per-layer ``(K, V)``, each ``[1, num_kv_heads, seq_len, head_size]`` (HF layout).

    Returns:
        ``torch.uint8`` 1-D contiguous tensor on the K/V device: the bytes of
        ``[num_layers][2][stop - start][num_kv_heads][head_size]`` (the canonical layout).
    """
    planes = [
        torch.stack((k[0, :, start:stop].transpose(0, 1), v[0, :, start:stop].transpose(0, 1))) for k, v in layers
    ]
    return torch.stack(planes).contiguous().reshape(-1).view(torch.uint8)


def unpack_kv_chunk(chunk: torch.Tensor, namespace: Namespace) -> torch.Tensor:
    """View canonical chunk bytes as ``[num_layers, 2, chunk_size, num_kv_heads, head_size]`` of
    the namespace's dtype (no copy)."""
    dtype = TORCH_KV_DTYPES[namespace.kv_dtype]
    return chunk.view(dtype).view(namespace.chunk_shape)


class KVCacheStore:
    """Store and retrieve the KV cache of token sequences for a Hugging Face-style model.

    Args:
        manager: the :class:`TierManager`.
        namespace: must describe the model's cache (``kv_planes=2``: separate K and V).

    Example: see ``examples/library_api.py``.
    """

    def __init__(self, manager: TierManager, namespace: Namespace) -> None:
        if namespace.kv_planes != 2:
            raise ValueError("KVCacheStore supports K/V caches (kv_planes=2), not MLA")
        if namespace.kv_dtype not in TORCH_KV_DTYPES:
            raise ValueError(f"KVCacheStore: unsupported kv_dtype {namespace.kv_dtype!r}")
        self.manager = manager
        self.namespace = namespace

    def lookup(self, token_ids: Any, *, cache_salt: str | bytes | None = None) -> int:
        """Number of leading tokens of ``token_ids`` whose KV is cached (a multiple of chunk_size)."""
        keys = chunk_keys(token_ids, self.namespace, cache_salt=cache_salt)
        return len(self.manager.lookup(keys)) * self.namespace.chunk_size

    def store(
        self, token_ids: Any, kv: Any, *, cache_salt: str | bytes | None = None, timeout_s: float | None = None
    ) -> list[Future]:
        """Store the KV of every full chunk of ``token_ids`` (asynchronously).

        Args:
            token_ids: the ``seq_len`` tokens the cache was computed for (1-D).
            kv: per-layer ``(K, V)`` of shape ``[1, num_kv_heads, >= seq_len, head_size]``
                (a transformers ``DynamicCache`` or legacy tuple), dtype matching the namespace.
            timeout_s: queue wait per chunk (default ``None``: wait for room, never drop).

        Chunk ``c`` is stored at position ``c * chunk_size`` (its first token's: the tiers that take
        positions, :meth:`~lmtier.tiers.base.Tier.takes_position`, need it).

        Returns:
            one ``Future[bool]`` per full chunk (the tail shorter than chunk_size is not stored).

        Raises:
            ValueError: the cache's geometry/dtype does not match the namespace or is too short.
        """
        ns = self.namespace
        layers = cache_layers(kv)
        keys = chunk_keys(token_ids, ns, cache_salt=cache_salt)
        if len(layers) != ns.num_layers:
            raise ValueError(f"KVCacheStore.store: cache has {len(layers)} layers, namespace {ns.num_layers}")
        want = TORCH_KV_DTYPES[ns.kv_dtype]
        for i, (k, v) in enumerate(layers):
            if k.dim() != 4 or k.shape != v.shape or k.shape[0] != 1:
                raise ValueError(f"KVCacheStore.store: layer {i} K/V must be [1, H, S, D], got {tuple(k.shape)}")
            if k.shape[1] != ns.num_kv_heads or k.shape[3] != ns.head_size or k.dtype != want or v.dtype != want:
                raise ValueError(
                    f"KVCacheStore.store: layer {i} is {tuple(k.shape)} {k.dtype}, namespace wants "
                    f"[1, {ns.num_kv_heads}, S, {ns.head_size}] {want}"
                )
            if k.shape[2] < len(keys) * ns.chunk_size:
                raise ValueError(f"KVCacheStore.store: layer {i} holds {k.shape[2]} tokens, fewer than the sequence")
        futures = []
        for c, key in enumerate(keys):
            data = pack_kv_chunk(layers, c * ns.chunk_size, (c + 1) * ns.chunk_size)
            futures.append(self.manager.store(key, data, timeout_s=timeout_s, position=c * ns.chunk_size))
        return futures

    def retrieve(
        self, token_ids: Any, *, cache_salt: str | bytes | None = None, device: str | torch.device = "cpu"
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """KV of the longest cached prefix of ``token_ids`` (a chunk promoted into the CPU pool keeps
        its position, ``c * chunk_size``, as :meth:`store` names it).

        Returns:
            ``(num_tokens, layers)``: ``num_tokens`` is a multiple of chunk_size (0 on a miss) and
            ``layers`` the per-layer ``(K, V)``, each ``[1, num_kv_heads, num_tokens, head_size]``
            in the namespace dtype on ``device`` (empty list when ``num_tokens == 0``). A chunk
            that disappears between lookup and retrieve shortens the prefix; it is never garbage.
        """
        ns = self.namespace
        keys = chunk_keys(token_ids, ns, cache_salt=cache_salt)
        keys = keys[: len(self.manager.lookup(keys))]
        staging = torch.empty(ns.chunk_bytes, dtype=torch.uint8)
        chunks = []
        for c, key in enumerate(keys):
            n = self.manager.retrieve_into(key, staging, position=c * ns.chunk_size)
            if n != ns.chunk_bytes:
                break
            chunks.append(unpack_kv_chunk(staging, ns).to(device, copy=True))
        if not chunks:
            return 0, []
        full = torch.cat(chunks, dim=2)  # [L, 2, T, H, D]
        layers = [
            (full[i, 0].transpose(0, 1).unsqueeze(0).contiguous(), full[i, 1].transpose(0, 1).unsqueeze(0).contiguous())
            for i in range(ns.num_layers)
        ]
        return len(chunks) * ns.chunk_size, layers
