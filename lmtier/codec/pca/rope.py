"""Rotary position embedding (RoPE) of the keys, undone before the PCA transform and redone after it.

vLLM caches keys *after* RoPE; the PCA basis is fitted on keys with RoPE undone (a rotation by the
position's angle mixes channel pairs differently at every position and hides the keys' correlation).
The rotation is HF's / vLLM's "neox" style (``rotate_half``: channel ``i`` pairs with ``i + D/2``).
"""

from __future__ import annotations

import numpy as np
import torch


def cos_sin(
    inv_freq: np.ndarray, start: int, tokens: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``cos``, ``sin`` ``[tokens, D]`` at positions ``start .. start + tokens - 1``, on
    ``device`` (default the host; always computed on the host).

    Args:
        inv_freq: float64 ``[D/2]``, the model's rotary inverse frequencies
            (:attr:`lmtier.codec.pca.model.PCAModel.inv_freq`).
        start, tokens: first position and count (>= 0).

    The angles are ``position * inv_freq`` in float64 and ``cos``/``sin`` NumPy's float64 functions on
    the host, so every encoder and decoder of one machine uses the same table (a CUDA encoder uploads
    it). They differ from the model's own float32 table in the last bits; that only moves the basis'
    input a little: decoding applies the exact inverse rotation of encoding's.

    Raises:
        ValueError: a negative ``start`` or ``tokens``.
    """
    if start < 0 or tokens < 0:
        raise ValueError(f"start and tokens must be >= 0, got {start}, {tokens}")
    ang = np.arange(start, start + tokens, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None]
    ang = np.concatenate([ang, ang], axis=1)
    return torch.from_numpy(np.cos(ang)).to(device), torch.from_numpy(np.sin(ang)).to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Keys float64 ``[..., T, H, D]`` rotated by their positions' angles (``inverse``: by minus them).

    ``k * cos + rotate_half(k) * sin`` (``-`` for the inverse), each product and the sum rounded in
    float64 in that order: the arithmetic a CUDA twin must repeat (no fused multiply-add).
    ``cos``, ``sin``: :func:`cos_sin`'s ``[T, D]``.
    """
    c, s = cos[:, None, :], sin[:, None, :]
    a, b = k * c, _rotate_half(k) * s
    return a - b if inverse else a + b
