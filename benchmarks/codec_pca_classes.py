"""Experiment (issue 19): PCA coefficients entropy-coded per token energy class (``codec_pca.py
--token-classes K``).

The static tables of ``codec_pca.PCAScheme`` model each component by one distribution for all
tokens. The KV's energy varies from token to token (a few tokens are far louder than the rest, and a
token loud in one layer group tends to be loud in the next), so a component's distribution is a
mixture of narrow and wide ones. Gain-adaptive (classified) entropy coding splits that mixture:
each token's vector in each (layer group, plane) gets a class ``k`` in ``0 .. K-1`` from its energy,
the class is sent as side information (one symbol per token, layer group and plane, coded with a
static table per (layer group, plane)), and every coefficient is coded with a static table of its
(layer group, plane, component, class). The quantizer, the decode and so the quality are unchanged:
the class only changes the rate. (Classification of transform coefficients by block energy:
Chen & Smith, "Adaptive coding of monochrome and color images", IEEE Trans. Commun. 1977.)

Rate = the ideal coder's cost with 12-bit tables (``codec_rates.normalize_table``, every symbol of
the 256 in the support, as ``PCAScheme``'s static tables), without the per-chunk fallback of
``codec_rates.StaticCoderModel``. The product's rANS switches tables per run of symbols, not per
symbol, so real bytes of this coder are not counted.
"""

from __future__ import annotations

import codec_pca as P
import codec_rates as CR
import torch


def energy(q: torch.Tensor) -> torch.Tensor:
    """float64 ``[R, 2, T]``: ``log2(1 + sum_n |q_n|)`` of integer coefficients ``[R, 2, N, T]``."""
    return torch.log2(1 + q.abs().sum(2).double())


def _symbols(q: torch.Tensor) -> torch.Tensor:
    """int64 ``[R, 2, N, T]``: :func:`codec_pca.symbols` of ``q`` in ``q``'s shape (escapes as their
    symbol; their raw bits are counted by the caller)."""
    return P.symbols(q)[0].reshape(q.shape).to(torch.int64)


class ClassCoder:
    """Static tables per (layer group, plane, component, energy class), fitted on the tune split.

    Args:
        qs: integer coefficients ``[R, 2, N, T_i]`` of the tune texts (``T_i`` may differ).
        classes: ``K >= 1``; ``K = 1`` is the plain static coder (no side information).

    Raises:
        ValueError: ``classes < 1`` or shapes that disagree."""

    def __init__(self, qs: list[torch.Tensor], classes: int):
        if classes < 1:
            raise ValueError(f"classes must be >= 1, got {classes}")
        if len({tuple(q.shape[:3]) for q in qs}) != 1:
            raise ValueError(f"coefficient shapes disagree: {[tuple(q.shape) for q in qs]}")
        self.k = classes
        r, _, n, _ = qs[0].shape
        e = torch.cat([energy(q) for q in qs], -1)  # [R, 2, T]
        qt = torch.linspace(0, 1, classes + 1, dtype=torch.float64)[1:-1]
        self.edges = (  # [R, 2, K-1]: the tune split's quantiles of the energy
            torch.quantile(e.reshape(r * 2, -1), qt, dim=1).T.reshape(r, 2, classes - 1)
            if classes > 1
            else torch.zeros(r, 2, 0, dtype=torch.float64)
        )
        counts = torch.zeros(r * 2 * n * classes * 256, dtype=torch.int64)
        side = torch.zeros(r * 2 * classes, dtype=torch.int64)
        for q in qs:
            cls = self.classify(q)
            counts += torch.bincount(self._index(q, cls).reshape(-1), minlength=counts.numel())
            side += torch.bincount(self._side_index(cls).reshape(-1), minlength=side.numel())
        ones = torch.ones(r * 2 * n * classes, 256, dtype=torch.bool)
        self.logp = torch.log2(CR.normalize_table(counts.reshape(-1, 256), ones).double() / 4096).reshape(-1)
        side = side.reshape(r * 2, classes)
        self.side_logp = torch.log2(CR.normalize_table(side, torch.ones_like(side, dtype=torch.bool)).double() / 4096)
        self.side_logp = self.side_logp.reshape(-1)

    def classify(self, q: torch.Tensor) -> torch.Tensor:
        """int64 ``[R, 2, T]``: each token's class in ``0 .. K-1`` (the number of edges below its energy)."""
        return (energy(q)[..., None] > self.edges[:, :, None, :]).sum(-1)

    def _index(self, q: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
        r, _, n, t = q.shape
        row = torch.arange(r * 2 * n, dtype=torch.int64).reshape(r, 2, n, 1)
        return (row * self.k + cls[:, :, None, :]) * 256 + _symbols(q)

    def _side_index(self, cls: torch.Tensor) -> torch.Tensor:
        r = cls.shape[0]
        return torch.arange(r * 2, dtype=torch.int64).reshape(r, 2, 1) * self.k + cls

    def bits(self, q: torch.Tensor) -> float:
        """Bits of coefficients ``[R, 2, N, T]`` (symbols, and with ``K > 1`` the classes; escapes' raw
        bits not included)."""
        cls = self.classify(q)
        b = -float(self.logp[self._index(q, cls)].sum())
        return b - float(self.side_logp[self._side_index(cls)].sum()) if self.k > 1 else b
