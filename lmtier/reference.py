"""Plain PyTorch references for gather/scatter, used by the tests.

They do not use :class:`KVLayout`'s strides: K and V are read from the per-layer views by their
documented meaning (``view[..., :D]`` / ``view[..., D:]`` for "kv", the slab split for "cpu_slab"),
so a stride mistake in the fast path cannot cancel out in the comparison.
"""

from __future__ import annotations

from typing import Sequence

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


def gather_ref(views: Sequence[torch.Tensor], slot_mapping: torch.Tensor, *, kind: str = "kv") -> torch.Tensor:
    """Canonical chunks ``[C, L, P, T, H, D]`` (cache dtype) for ``slot_mapping [C, T]``; padding rows are 0."""
    C, T = slot_mapping.shape
    out = []
    for view in views:
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


def scatter_ref(views: Sequence[torch.Tensor], slot_mapping: torch.Tensor, chunks: torch.Tensor, *,
                kind: str = "kv") -> None:
    """Write canonical chunks ``[C, L, P, T, H, D]`` into the views at ``slot_mapping``; skips padding."""
    C, T = slot_mapping.shape
    valid = slot_mapping >= 0
    for li, view in enumerate(views):
        planes = _planes(view, kind)
        N = planes[0].shape[2]
        s = slot_mapping[valid].to(view.device)
        blk, off = s // N, s % N
        for pi, p in enumerate(planes):
            src = chunks[:, li, pi].to(view.device)[valid.to(view.device)]  # [n, H, D]
            p[blk, :, off, :] = src
