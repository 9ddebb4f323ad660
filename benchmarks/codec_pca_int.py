"""Experiment (issue 19): the PCA transform of ``codec_pca`` in exact integer arithmetic, as a product
encoder could run it on int8 tensor cores and on the CPU with the same bytes.

Integer sums do not depend on their order, so a GEMM of integers is bit-identical on cuBLAS/CUTLASS's
IMMA kernels and on any CPU loop: the CPU/GPU byte identity of the encoder needs no fixed-order float
kernel. :class:`IntBasis` measures what the integer rounding of the inputs and matrices costs:

- the KV (RoPE undone, bf16 -> float) becomes fixed point: ``x_int = clamp(round(x / sx), +-(2**(b-1) - 1))``
  with ``sx`` per (layer group, plane) from the calibration KV's largest magnitude (``x_bits`` = 16:
  two int8 GEMMs of its high and low bytes);
- the encode matrix ``E = M^1/2 U`` (metric then basis, per layer group) is rounded to ``m_bits``
  (int8: ``E_int = round(E / se)``, ``se_j = max_i |E_ij| / 127``) per column, the decode matrix
  ``D = U^T M^-1/2`` per output channel;
- encode ``y_j = se_j * sx * sum_i (x_int - mu_int)_i E_int[i, j]``, decode
  ``x_i = step * sd_i * sum_j q_j D_int[j, i] + mu`` (exact integer sums; float64 holds them exactly
  here, every partial sum being an integer below 2**53).

The float ``Basis`` is the reference; the difference in KL at the same steps is the cost.
"""

from __future__ import annotations

import torch
from codec_pca import Basis


def _block_diag(m: torch.Tensor | None, group: int, n: int, rows: int) -> torch.Tensor:
    """``[L, 2, n, n]`` per-layer matrices (None: identity) -> ``[L / group, 2, g n, g n]`` block diagonal."""
    if m is None:
        return torch.eye(group * n, dtype=torch.float64).expand(rows, 2, group * n, group * n)
    out = torch.zeros(rows, 2, group * n, group * n, dtype=torch.float64)
    for j in range(group):
        out[:, :, j * n : (j + 1) * n, j * n : (j + 1) * n] = m[j::group]
    return out


def _int_columns(a: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``a_int`` int-valued float64 in ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``, scale per column
    ``[..., 1, N]``), ``a ~ a_int * scale``."""
    scale = a.abs().amax(-2, keepdim=True).clamp_min(1e-300) / ((1 << (bits - 1)) - 1)
    return torch.round(a / scale), scale


class IntBasis(Basis):
    """:class:`codec_pca.Basis` (``scope="layer"``) whose transform and inverse are integer GEMMs.

    Args: those of :class:`Basis`, plus ``x_bits`` (the fixed-point width of the KV, 2..24) and
    ``m_bits`` (the width of the encode matrix's entries, 2..16; 8 for int8 tensor cores) and ``d_bits``
    (the decode matrix's; default ``m_bits``).
    Attributes beyond :class:`Basis`: ``sx`` ``[R, 2]`` (fixed-point step of the KV), ``clamped`` (the
    count of KV values clamped so far: values beyond the calibration's largest magnitude).

    Raises:
        ValueError: ``scope="head"`` or ``x_bits`` out of range.
    """

    def __init__(
        self,
        cal,
        cos,
        sin,
        undo_rope,
        metric=None,
        group=1,
        scope="layer",
        x_bits: int = 16,
        m_bits: int = 8,
        d_bits: int | None = None,
    ):
        d_bits = m_bits if d_bits is None else d_bits
        if scope != "layer":
            raise ValueError("IntBasis supports scope='layer' only")
        if not 2 <= x_bits <= 24:
            raise ValueError(f"x_bits must be in 2..24, got {x_bits}")
        if not (2 <= m_bits <= 16 and 2 <= d_bits <= 16):
            raise ValueError(f"m_bits and d_bits must be in 2..16, got {m_bits}, {d_bits}")
        super().__init__(cal, cos, sin, undo_rope, metric, group, scope)
        rows, n = self.u.shape[0], self.u.shape[-1] // group
        s = _block_diag(self.sqrt_m, group, n, rows)
        s_inv = _block_diag(self.inv_sqrt_m, group, n, rows)
        self.e_int, self.se = _int_columns(s @ self.u, m_bits)  # [R, 2, N, N]: raw -> coefficients
        self.d_int, self.sd = _int_columns(self.u.transpose(2, 3) @ s_inv, d_bits)  # coefficients -> raw
        self.mu_raw = (self.mu[:, :, None] @ s_inv)[:, :, 0]  # [R, 2, N]
        self.xmax = (1 << (x_bits - 1)) - 1
        peak = torch.stack([self.vectors(kv, weighted=False).abs().amax((2, 3)) for kv in cal]).amax(0)
        self.sx = peak.clamp_min(1e-300) / self.xmax  # [R, 2]
        self.mu_int = torch.round(self.mu_raw / self.sx[:, :, None])
        self.clamped = 0

    def _transform(self, kv: torch.Tensor) -> torch.Tensor:
        x = torch.round(self.vectors(kv, weighted=False) / self.sx[:, :, None, None])
        self.clamped += int((x.abs() > self.xmax).sum())
        x = x.clamp(-self.xmax, self.xmax) - self.mu_int[:, :, None]
        acc = x @ self.e_int  # exact: integers below 2**53
        return (acc * self.se * self.sx[:, :, None, None]).transpose(2, 3).contiguous()

    def decode(self, q: torch.Tensor, step: torch.Tensor, shape) -> torch.Tensor:
        acc = q.transpose(2, 3).double() @ self.d_int  # [R, 2, T, N], exact
        x = acc * self.sd * step[:, :, None, None] + self.mu_raw[:, :, None]
        return self.kv(x, shape, weighted=False)
