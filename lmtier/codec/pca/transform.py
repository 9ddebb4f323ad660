"""The PCA levels' arithmetic, shared by the encoder, the decoder and the calibration.

Every step is exact integer arithmetic or one correctly rounded float64 operation in a fixed order,
so a CUDA twin can produce the same bits: the integer GEMMs are computed in float64 here, exact
because every partial sum is an integer below 2**53 (``|x_int|, |e_int|, |q|, |d_int| <= 32767`` and
``N <=`` :data:`~.model.MAX_VECTOR_SIZE`, which :class:`~.model.PCAModel` enforces), whatever the
summation order. On CUDA the same integers come from int8 tensor-core GEMMs (:mod:`.imatmul`) and
every float64 step is the same single IEEE operation, so the GPU's results are the CPU's bit for bit.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from . import imatmul, rope
from .model import PCAModel

__all__ = [
    "XMAX",
    "ENERGY_SCALE",
    "EMAX",
    "raw_vectors",
    "to_kv",
    "Forward",
    "transform",
    "transform_vectors",
    "quantize",
    "forward",
    "inverse",
    "vectors",
    "OFFSET",
    "ESCAPE",
    "loud",
    "symbols",
]

XMAX = 32767
"""Largest fixed-point magnitude of the raw vectors and of a coded coefficient (16 bits)."""
ENERGY_SCALE = 8.0
"""A token's energy is measured on a grid ``ENERGY_SCALE`` times finer than the quantizer's step (the
quantized coefficients alone would miss the many components below the step)."""
OFFSET = 127
"""A coefficient ``q`` with ``|q| <= OFFSET`` is coded as the symbol ``q + OFFSET``."""
ESCAPE = 255
"""The symbol of a coefficient beyond :data:`OFFSET` (its value travels raw, 16 bits)."""
NONFINITE = "the chunk holds NaN or inf: only the lossless level stores them"
"""The message of the :class:`~lmtier.codec.quant.CodecInputError` a PCA level raises for such a chunk."""
EMAX = 1 << 20
"""Clip of the fine-grid coefficients in the energy (``N * EMAX**2 <= 2**53`` for
``N <=`` :data:`~.model.MAX_VECTOR_SIZE`)."""


def raw_vectors(kv: torch.Tensor, start: int, inv_freq: np.ndarray | None, layer_group: int) -> torch.Tensor:
    """Canonical KV ``[L, 2, T, H, D]`` (bf16/fp16, CPU or CUDA) at positions ``start ..`` -> float64
    ``[R, 2, T, N]`` on its device: keys RoPE-undone with ``inv_freq`` (:attr:`PCAModel.inv_freq`;
    None: kept), ``G = layer_group`` adjacent layers' heads of a token in one vector."""
    x = kv.double()
    nl, _, t, h, d = x.shape
    if inv_freq is not None:
        cos, sin = rope.cos_sin(inv_freq, start, t, x.device)
        x = torch.stack([rope.apply(x[:, 0], cos, sin, inverse=True), x[:, 1]], 1)
    g = layer_group
    return x.reshape(nl // g, g, 2, t, h * d).permute(0, 2, 3, 1, 4).reshape(nl // g, 2, t, g * h * d)


def to_kv(m: PCAModel, x: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`raw_vectors`: float64 ``[R, 2, T, N]`` -> ``dtype`` ``[L, 2, T, H, D]``
    (RoPE redone; the cast goes through float32: float64 -> float32 -> ``dtype``, each round to
    nearest even)."""
    r, _, t, _ = x.shape
    g, h, d = m.layer_group, m.num_heads, m.head_size
    x = x.reshape(r, 2, t, g, h * d).permute(0, 3, 1, 2, 4).reshape(r * g, 2, t, h, d)
    if m.inv_freq is not None:
        cos, sin = rope.cos_sin(m.inv_freq, start, t, x.device)
        x = torch.stack([rope.apply(x[:, 0], cos, sin), x[:, 1]], 1)
    return x.float().to(dtype)


@lru_cache(maxsize=8)
def _vectors(m: PCAModel, device: str) -> tuple[torch.Tensor, ...]:
    got = tuple(torch.from_numpy(a).to(device=device, dtype=torch.float64) for a in (m.inv_x_scale, m.e_mu, m.mu_raw))
    imatmul.settled(device)  # read by other threads' streams
    return got


def vectors(m: PCAModel, device: str) -> tuple[torch.Tensor, ...]:
    """float64 ``inv_x_scale`` ``[R, 2]``, ``e_mu``, ``mu_raw`` ``[R, 2, N]`` of ``m`` on ``device``
    (contiguous; cached per model and device; marked :func:`.imatmul.in_use` by the current stream)."""
    got = _vectors(m, imatmul.device_key(device))
    imatmul.in_use(*got)
    return got


_HOST_CACHE_BYTES = 1 << 29
"""Models whose two matrices take at most this many bytes as float64 keep float64 copies on the host;
larger ones (an 8B model's: 4 GB) widen each (layer group, K/V) matrix when it is used."""


@lru_cache(maxsize=2)
def _host_mats(m: PCAModel) -> tuple[torch.Tensor, torch.Tensor] | None:
    if 4 * (m.e_int.nbytes + m.d_int.nbytes) > _HOST_CACHE_BYTES:
        return None
    return torch.from_numpy(m.e_int).double(), torch.from_numpy(m.d_int).double()


def _imatmul(m: PCAModel, x: torch.Tensor, which: int) -> torch.Tensor:
    """Exact float64 ``x @ e_int`` (``which`` 0) or ``x @ d_int`` (1) of integer-valued float64 ``x``
    ``[R, 2, T, N]``: float64 GEMMs on the host, int8 tensor-core GEMMs on CUDA."""
    if x.device.type != "cpu":
        return _imatmul_int8(m, x, which)
    cached = _host_mats(m)
    if cached is not None:
        return x @ cached[which]
    mat = m.e_int if which == 0 else m.d_int
    out = torch.empty(*x.shape[:3], mat.shape[-1], dtype=torch.float64)
    for i in range(x.shape[0]):
        for p in range(2):
            torch.matmul(x[i, p], torch.from_numpy(mat[i, p]).double(), out=out[i, p])
    return out


def _imatmul_int8(m: PCAModel, x: torch.Tensor, which: int) -> torch.Tensor:
    """:func:`_imatmul` on int8 GEMMs (:mod:`.imatmul`) on ``x``'s device (the CUDA path; on the host
    only in tests)."""
    r, _, t, n = x.shape
    a = imatmul.prepared(m, x.device)[which]
    xi = x.reshape(r * 2, t, n)
    y = imatmul.matmul(xi, a) if which == 0 else imatmul.matmul_small(xi, a)
    return y.to(torch.float64).reshape(r, 2, t, y.shape[-1])  # -1 is ambiguous at T = 0


class Forward:
    """:func:`quantize`'s result. ``q``: float64 ``[R, 2, T, N]`` integer-valued coefficients (0 on
    exact tokens); ``exact``: bool ``[T]``; ``energy``: float64 ``[R, 2, T]``, ``sum q**2`` of each
    token on a grid :data:`ENERGY_SCALE` times finer than the step (``round(acc * k * ENERGY_SCALE)``,
    clipped to :data:`EMAX`), before the exact ones were zeroed."""

    def __init__(self, q: torch.Tensor, exact: torch.Tensor, energy: torch.Tensor) -> None:
        self.q, self.exact, self.energy = q, exact, energy


def transform(m: PCAModel, kv: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer transform of a chunk: (``acc`` float64 ``[R, 2, T, N]``, integer-valued:
    ``clamp(round_half_even(x * inv_x_scale)) @ e_int - e_mu``; ``clamped`` bool ``[T]``: tokens with
    a raw value beyond the 16-bit fixed point). ``kv``: canonical ``[L, 2, T, H, D]`` bf16/fp16
    (finite), CPU or CUDA, its first token at position ``start``."""
    return transform_vectors(m, raw_vectors(kv, start, m.inv_freq, m.layer_group))


def transform_vectors(m: PCAModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`transform` of raw vectors ``x`` (float64 ``[R, 2, T, N]``, :func:`raw_vectors`' output,
    CPU or CUDA; finite): each token's result depends on its vector alone, so the tokens may come
    from any positions (each vector made at its own)."""
    inv_sx, e_mu, _ = vectors(m, str(x.device))
    xi = torch.round(x * inv_sx[:, :, None, None])
    clamped = (xi.abs() > XMAX).any(-1).any(0).any(0)
    return _imatmul(m, xi.clamp_(-XMAX, XMAX), 0) - e_mu[:, :, None], clamped


def quantize(
    m: PCAModel,
    acc: torch.Tensor,
    clamped: torch.Tensor,
    start: int,
    k: torch.Tensor,
    energy_threshold: torch.Tensor | None,
) -> Forward:
    """Quantized coefficients and exact tokens of :func:`transform`'s output.

    Args:
        k: float64 ``[R, 2, N]`` (:attr:`PCALevelData.k`); energy_threshold: float64 ``[R, 2]`` or
            None (no token is exact for its energy).

    A token is exact when its position is below ``m.exact_first``, a raw value needs more than 16
    bits of fixed point, a coefficient exceeds :data:`XMAX`, or its energy exceeds the threshold of
    some (layer group, K/V).
    """
    t = acc.shape[2]
    y = acc * k[:, :, None, :]  # in-place steps below: two or three [R, 2, T, N] arrays alive, not six
    fine = (y * ENERGY_SCALE).round_().clamp_(-EMAX, EMAX)
    energy = fine.square_().sum(-1)
    del fine
    q = y.round_()
    qc = q.clamp(-XMAX, XMAX)
    big = (qc != q).any(-1).any(0).any(0)
    del q, y
    exact = clamped | big | (torch.arange(start, start + t, device=acc.device) < m.exact_first)
    if energy_threshold is not None:
        exact |= loud(energy, energy_threshold)
    qc[:, :, exact] = 0
    return Forward(qc, exact, energy)


def loud(energy: torch.Tensor, energy_threshold: torch.Tensor) -> torch.Tensor:
    """bool ``[T]``: the tokens whose energy (:class:`Forward`'s ``[R, 2, T]``) exceeds the threshold
    (``[R, 2]``, :attr:`PCALevelData.energy_threshold`) of some (layer group, K/V)."""
    return (energy > energy_threshold[:, :, None]).any(0).any(0)


def symbols(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 symbols, bool escaped) of integer coefficients ``q`` (any shape, ``|q| <=`` :data:`XMAX`):
    ``q + OFFSET``, or :data:`ESCAPE` where ``|q| > OFFSET``."""
    esc = q.abs() > OFFSET
    return torch.where(esc, ESCAPE, q + OFFSET).to(torch.uint8), esc


def forward(
    m: PCAModel, kv: torch.Tensor, start: int, k: torch.Tensor, energy_threshold: torch.Tensor | None
) -> Forward:
    """:func:`quantize` of :func:`transform`: the coefficients and exact tokens of a chunk."""
    return quantize(m, *transform(m, kv, start), start, k, energy_threshold)


def inverse(m: PCAModel, q: torch.Tensor, f: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
    """Decoded ``dtype`` ``[L, 2, T, H, D]`` of coefficients ``q`` (float64 ``[R, 2, T, N]``) with
    ``f`` (float64 ``[R, 2, N]``, :attr:`PCALevelData.f`): ``(q @ d_int) * f + mu_raw``, then
    :func:`to_kv`. Exact tokens come out as the mean; the caller overwrites them."""
    mu_raw = vectors(m, str(q.device))[2]
    x = _imatmul(m, q, 1) * f[:, :, None, :] + mu_raw[:, :, None, :]
    return to_kv(m, x, start, dtype)
