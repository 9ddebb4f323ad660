"""Error-bounded levels: the encoder chooses qmax per (chunk, layer, plane) from a measured error.

An adaptive level (:attr:`lmtier.codec.levels.Level.adaptive`) is defined by the error it
guarantees, not by a table of bits: for every chunk, layer ``l`` and plane ``p`` (K, V) the encoder
picks the smallest qmax of the level's ``qmax_menu`` whose quantization error, **computed exactly**
on the chunk with the quantizer's own arithmetic (:mod:`lmtier.codec.quant`), satisfies
``metric(l, p) <= bound(l, p)`` (:class:`~lmtier.codec.levels.BoundMetric`). The ratio then varies
with the data; the error bound does not. The chosen table (one byte per layer and plane) travels in
the record's metadata (:func:`record_meta`); the kernels already take a per-layer qmax table, so
the CPU/CUDA quantize/dequantize kernels and their bit-exact contract are unchanged.

What is guaranteed (tested in tests/test_codec_bound.py): the chosen qmax meets the bound in the
rotated domain, ``||y_hat - y|| <= bound * ||y||`` (or ``* ||y - mean_T y||``), fp32, where ``y`` is
the rotated row the kernels quantize; the decoded chunk's error differs from it only by the fp32
rounding of the forward transform (a few ulp) and the output cast (``<= 2^-9`` relative for bf16,
``2^-11`` for fp16). If no menu value meets a bound (only possible for planes made of rows with one
dominant rotated coordinate, needing ``bound < 9 sqrt(D) / (16 qmax_max)``, or all rows below the
scale floor ``2^-17 qmax``), the largest menu value is used and :func:`choose_qmax` reports it.

Cost: the search evaluates the error of a few candidates per plane (all layers at once, torch ops
on the chunk's device): one at the menu value nearest 7, then up/down from the value the
``error ~ 1/qmax`` law predicts.
"""

from __future__ import annotations

import torch

from . import quant
from .levels import BoundMetric, Granularity, Level, PlaneQuant, Transform, get_level, resolve

__all__ = ["choose_qmax", "plane_errors", "record_meta", "level_from_meta", "META_MAGIC"]

META_MAGIC = b"QB1"
"""Record metadata of adaptive levels: ``b"QB1"``, then uint8 ``[L, 2]`` (layer-major, K then V)."""


def _rotated(x: torch.Tensor, pq: PlaneQuant) -> torch.Tensor:
    if pq.granularity != Granularity.TOKEN_HEAD:
        raise ValueError("error-bounded planes need per-(token, head) scales")
    return quant.fwht(x) if pq.transform == Transform.HADAMARD else x


def plane_errors(y: torch.Tensor, qmax: torch.Tensor, metric: BoundMetric, denom: torch.Tensor | None = None):
    """Error metric per layer of one plane quantized with ``qmax``.

    Args:
        y: the rotated plane ``[L, T, H, D]`` fp32 (what :func:`lmtier.codec.quant._quantize_plane`
            quantizes).
        qmax: int ``[L]``.
        metric: RELATIVE or CENTERED.
        denom: the metric's denominator per layer (fp64 ``[L]``), if already computed.

    Returns:
        fp64 ``[L]``: ``||y_hat - y|| / ||y||`` (or ``/ ||y - mean_T y||``); 0 where the denominator
        is 0 and the error too, inf where only the denominator is 0.
    """
    nl = y.shape[0]
    qm = qmax.to(torch.float32).reshape(nl, 1, 1)
    a = y.abs().amax(dim=3).transpose(1, 2)  # [L, H, T], the kernels' per-(token, head) absmax
    codes = quant.scale_code_ceil(a / qm)
    s = quant.scale_value(codes).transpose(1, 2)[:, :, :, None]  # [L, T, H, 1]
    safe = torch.where(s == 0, torch.ones_like(s), s)
    qmb = qm.reshape(nl, 1, 1, 1)
    q = torch.clamp(torch.round(y / safe), -qmb, qmb)
    # s == 0 only for all-zero rows, where q == 0: q * s is the dequantized row everywhere
    err = (q * s - y).pow(2).flatten(1).sum(1, dtype=torch.float64).sqrt()
    if denom is None:
        denom = _denominator(y, metric)
    out = err / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where(denom > 0, out, torch.where(err > 0, torch.full_like(out, float("inf")), torch.zeros_like(out)))


def _denominator(y: torch.Tensor, metric: BoundMetric) -> torch.Tensor:
    yd = y.double()
    if metric == BoundMetric.CENTERED:
        yd = yd - yd.mean(dim=1, keepdim=True)
    return yd.pow(2).flatten(1).sum(1).sqrt()


def _choose_plane(y: torch.Tensor, pq: PlaneQuant, menu: torch.Tensor, nl: int) -> tuple[list[int], bool]:
    bound = torch.tensor(pq.bound_table(nl), dtype=torch.float64, device=y.device)
    denom = _denominator(y, pq.metric)
    n = menu.numel()

    def passes(idx: torch.Tensor) -> torch.Tensor:
        return plane_errors(y, menu[idx], pq.metric, denom) <= bound

    start = torch.full((nl,), int(torch.argmin((menu - 7).abs())), dtype=torch.int64, device=y.device)
    e0 = plane_errors(y, menu[start], pq.metric, denom)
    want = menu[start].double() * e0 / bound  # error ~ c / qmax
    idx = torch.searchsorted(menu.double(), want * 0.97).clamp(max=n - 1)
    ok = passes(idx)
    # up until every layer passes (or sits at the menu's end)
    while True:
        up = ~ok & (idx < n - 1)
        if not bool(up.any()):
            break
        idx = torch.where(up, idx + 1, idx)
        ok = torch.where(up, passes(idx), ok)
    # down while the next smaller value still passes
    while True:
        cand = torch.where(ok & (idx > 0), idx - 1, idx)
        move = cand != idx
        if not bool(move.any()):
            break
        ok_c = passes(cand)
        take = move & ok_c
        if not bool(take.any()):
            break
        idx = torch.where(take, cand, idx)
    return [int(v) for v in menu[idx].tolist()], bool(ok.all())


def choose_qmax(chunk: torch.Tensor, level) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """qmax per layer for K and V of one chunk under an adaptive level.

    Args:
        chunk: canonical ``[L, 2, T, H, D]`` bf16/fp16, CPU or CUDA, finite.
        level: an adaptive level (name, id or :class:`~lmtier.codec.levels.Level`).

    Returns:
        ``(qmax_k, qmax_v, met)``: tuples of L menu values; ``met`` False when some plane could not
        meet its bound even at the menu's largest qmax (that plane then uses the largest).

    Raises:
        ValueError: not an adaptive level. CodecInputError: non-finite or out-of-range values.
    """
    lv = get_level(level)
    if not lv.adaptive:
        raise ValueError(f"level {lv.name!r} is not adaptive")
    quant._check_chunk(chunk)
    x = chunk.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise quant.CodecInputError("KV chunk contains NaN or inf; only 'lossless' can store it")
    nl = x.shape[0]
    menu = torch.tensor(lv.qmax_menu, dtype=torch.int64, device=x.device)
    out, met = [], True
    for p, pq in ((0, lv.k), (1, lv.v)):
        q, ok = _choose_plane(_rotated(x[:, p], pq), pq, menu, nl)
        out.append(tuple(q))
        met &= ok
    return out[0], out[1], met


def record_meta(level: Level) -> bytes:
    """Record metadata of a :func:`resolve` d adaptive level (its per-layer qmax table)."""
    nl = len(level.k.groups)
    qk, qv = level.k.qmax_table(nl), level.v.qmax_table(nl)
    return META_MAGIC + bytes(v for pair in zip(qk, qv) for v in pair)


def level_from_meta(level: Level, meta, num_layers: int) -> Level:
    """The resolved level of a record of adaptive ``level`` from its metadata.

    Raises ValueError on metadata that is not a qmax table of ``num_layers`` layers in the menu."""
    m = bytes(meta)
    if len(m) != len(META_MAGIC) + 2 * num_layers or not m.startswith(META_MAGIC):
        raise ValueError(f"codec record of adaptive level {level.name!r} lacks its qmax table")
    t = m[len(META_MAGIC) :]
    return resolve(level, tuple(t[0::2]), tuple(t[1::2]))
