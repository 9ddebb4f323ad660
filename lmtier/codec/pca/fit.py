"""Calibration of a :class:`~.model.PCAModel` from KV of known positions (and, optionally, the model
metric of :mod:`lmtier.codec.pca.hf`).

The scheme is transform coding (Goyal, "Theoretical foundations of transform coding", IEEE SPM 2001)
as KVTC applies it to KV caches (Staniszewski & Lancucki, "KV Cache Transform Coding for Compact
Storage in LLM Inference", ICLR 2026), with a basis per group of adjacent layers, one uniform step per
(layer group, K/V) and the loudest tokens kept exact (benchmarks/codec_pca.py, RESULTS §4.1f-h).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from lmtier.codec import rans

from . import transform as tf
from .levels import PCA_LEVELS, PCALevel
from .model import MAX_VECTOR_SIZE, PCALevelData, PCAModel

__all__ = ["fit"]


def _int_columns(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int16 ``a_int`` ``[..., M, N]``, float64 scale ``[..., N]``) with ``a ~ a_int * scale`` per column."""
    scale = a.abs().amax(-2).clamp_min(1e-300) / tf.XMAX
    return torch.round(a / scale[..., None, :]).to(torch.int16), scale


def _block_diag(m: torch.Tensor, g: int) -> torch.Tensor:
    """``[L, 2, n, n]`` -> ``[L / g, 2, g n, g n]``: the ``g`` layers of a group on the diagonal."""
    nl, _, n, _ = m.shape
    out = torch.zeros(nl // g, 2, g * n, g * n, dtype=torch.float64)
    for j in range(g):
        out[:, :, j * n : (j + 1) * n, j * n : (j + 1) * n] = m[j::g]
    return out


def _sqrt_metric(metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, v = torch.linalg.eigh(metric.double())
    w = w.clamp_min(w.amax(-1, keepdim=True) * 1e-8)
    vt = v.transpose(-1, -2)
    return v @ torch.diag_embed(w.sqrt()) @ vt, v @ torch.diag_embed(w.rsqrt()) @ vt


def fit(
    kvs: Sequence[torch.Tensor],
    starts: Sequence[int],
    *,
    inv_freq: np.ndarray | None,
    layer_group: int,
    metric: torch.Tensor | None = None,
    levels: Iterable[PCALevel] = tuple(PCA_LEVELS.values()),
    outlier_share: float = 0.002,
    exact_first: int = 1,
    x_headroom: float = 2.0,
    name: str = "",
    info: dict | None = None,
) -> PCAModel:
    """Fit the PCA model data on calibration KV.

    Args:
        kvs: canonical KV ``[L, 2, T_i, H, D]`` (bf16/fp16, CPU; finite), post-RoPE as the model
            caches it; a few thousand tokens of varied text in all (the covariance of ``N = G*H*D``
            values per vector needs several times ``N`` tokens).
        starts: the position of each tensor's first token.
        inv_freq: float64 ``[D/2]`` rotary inverse frequencies (None: keys coded with RoPE kept).
        layer_group: ``G``, adjacent layers per basis (divides ``L``).
        metric: float64 ``[L, 2, H*D, H*D]`` (:func:`lmtier.codec.pca.hf.collect`): squared errors
            are weighed by it (None: plain squared error).
        levels: the levels to fit: each gets its relative step ``c``
            (:class:`~.levels.PCALevel`), or for a level given by ``calibration_ratio`` the ``c`` at
            which the calibration KV codes at that ratio (ideal bits of the level's own tables, escapes
            and exact tokens at 16 bits per value; record framing not counted). The ideal ratio each
            level reaches on the calibration KV is stored in ``info["calibration_ratios"]``.
        outlier_share: share of the calibration tokens (positions >= ``exact_first``) whose energy
            score is above the threshold, i.e. kept exact; in [0, 1).
        exact_first: positions below it are always exact.
        x_headroom: the 16-bit fixed point of the raw vectors covers ``x_headroom`` times the
            calibration's largest magnitude per (layer group, K/V); tokens beyond it are exact.
        name, info: stored in the model (free text; JSON-able facts).

    Returns:
        The :class:`PCAModel` (its rANS tables count the calibration's symbols of non-exact tokens).

    Memory and time: the fit runs one layer group at a time (its basis, then each pass of the level
    search), so besides ``kvs`` and the model's arrays only one group's float64 vectors of each
    sequence (``[2, T_i, N]``, a few of them at once) and a few values per token are alive. Each
    pass recomputes the group's transform from ``kvs``: the levels of a fixed ``c`` share one pass, a
    ``calibration_ratio`` level takes one per secant step. The model bytes are those of fitting all
    groups at once (each group gets the same float64 operations on the same values, and the
    integer ones are exact; compared on small fits and on 8B-geometry fits of 2,048-4,096 tokens).

    Raises:
        ValueError: inconsistent shapes, ``G`` not dividing ``L``, ``G*H*D`` above
            :data:`~.model.MAX_VECTOR_SIZE`, an odd head size with RoPE,
            ``outlier_share`` out of range, a tensor of no tokens, fewer than 2 tokens, non-finite KV,
            a (layer group, K/V) whose calibration KV does not vary.
        RuntimeError: no step reaches a ``calibration_ratio`` level's ratio within 0.5 % in 12 secant
            steps; or (an internal error) a token's coefficients differed when recomputed.
    """
    if not kvs or len(kvs) != len(starts):
        raise ValueError(f"need one start per KV tensor and at least one tensor, got {len(kvs)} / {len(starts)}")
    nl, _, _, h, d = kvs[0].shape
    if any(kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != (nl, 2, h, d) for kv in kvs):
        raise ValueError("calibration KV tensors must all be canonical [L, 2, T, H, D] of one geometry")
    if layer_group < 1 or nl % layer_group:
        raise ValueError(f"layer_group {layer_group} must divide the {nl} layers")
    if not 0 <= outlier_share < 1:
        raise ValueError(f"outlier_share must be in [0, 1), got {outlier_share}")
    if x_headroom < 1:
        raise ValueError(f"x_headroom must be >= 1, got {x_headroom}")
    empty = [i for i, kv in enumerate(kvs) if kv.shape[2] == 0]
    if empty:
        raise ValueError(f"calibration KV tensors {empty} hold no tokens (T = 0): leave them out")
    if sum(kv.shape[2] for kv in kvs) < 2:
        raise ValueError("calibration needs at least 2 tokens")
    if not all(bool(torch.isfinite(kv).all()) for kv in kvs):
        raise ValueError("calibration KV holds NaN or inf")
    g, hd = layer_group, h * d
    r, n = nl // g, g * hd
    if n > MAX_VECTOR_SIZE:
        raise ValueError(f"vector size N = G*H*D = {n} exceeds {MAX_VECTOR_SIZE}: use a smaller layer_group")
    if metric is not None and tuple(metric.shape) != (nl, 2, hd, hd):
        raise ValueError(f"metric must be [L={nl}, 2, {hd}, {hd}], got {tuple(metric.shape)}")
    inv_freq = None if inv_freq is None else np.ascontiguousarray(inv_freq, np.float64)
    if inv_freq is not None and (d % 2 or inv_freq.shape != (d // 2,)):
        raise ValueError(f"inv_freq must be float64 [{d // 2}] and the head size even, got {inv_freq.shape}, D={d}")
    # the metric's square root and its inverse (None without a metric: the identity, never multiplied,
    # which leaves every product as it was and saves two N x N products per calibration token)
    s, s_inv = (None, None) if metric is None else (_block_diag(m, g) for m in _sqrt_metric(metric))
    count = sum(kv.shape[2] for kv in kvs)
    f64 = dict(dtype=torch.float64)
    mu_raw, var, se, sd = (torch.empty(r, 2, n, **f64) for _ in range(4))
    peak = torch.empty(r, 2, **f64)
    e_int, d_int = torch.empty(r, 2, n, n, dtype=torch.int16), torch.empty(r, 2, n, n, dtype=torch.int16)
    for i in range(r):  # one layer group at a time: its vectors of every sequence, not the model's
        got = _group_basis(kvs, starts, i, inv_freq, g, count, s, s_inv)
        mu_raw[i], peak[i], var[i], e_int[i], se[i], d_int[i], sd[i] = (a[0] for a in got)
    del s, s_inv
    rms = var.mean(-1).sqrt()  # [R, 2]
    if bool((rms == 0).any()):
        r0, p0 = (int(i) for i in torch.nonzero(rms == 0)[0])
        raise ValueError(
            f"calibration KV of layers {r0 * g}-{r0 * g + g - 1} ({'KV'[p0]}) does not vary: no step can be "
            "fitted to it (calibrate on real KV)"
        )
    sx = peak.clamp_min(1e-30) * x_headroom / tf.XMAX
    mu_int = torch.round(mu_raw / sx[:, :, None]).to(torch.int32)
    e_mu = np.empty((r, 2, n), np.int64)  # exact integers, one layer group at a time
    for i in range(r):
        e_mu[i] = (mu_int[i].numpy().astype(np.int64)[:, None, :] @ e_int[i].numpy().astype(np.int64))[:, 0]
    base = PCAModel(
        name=name,
        num_layers=nl,
        num_heads=h,
        head_size=d,
        layer_group=g,
        inv_freq=inv_freq,
        exact_first=exact_first,
        inv_x_scale=(1.0 / sx).numpy(),
        mu_int=mu_int.numpy(),
        e_int=e_int.numpy(),
        e_mu=e_mu,
        d_int=d_int.numpy(),
        mu_raw=mu_raw.numpy(),
        levels={"": _placeholder_level(r, n)},  # replaced by the fitted levels below
        info={**(info or {}), "calibration_tokens": count, "outlier_share": outlier_share},
    )
    groups = [_group_model(base, i) for i in range(r)]
    levels = tuple(levels)
    values = count * nl * 2 * h * d

    def level_data(cs: list[float]) -> list[_Fitted]:
        return _level_data(base, groups, cs, rms, se, sx, sd, kvs, starts, outlier_share)

    fixed = list(dict.fromkeys(lv.c for lv in levels if lv.c is not None))
    known = dict(zip(fixed, level_data(fixed))) if fixed else {}  # the fixed steps share one pass
    fitted, ratios = {}, {}
    for lv in levels:
        data, bits = _fit_level(base, lv, values, lambda c: known[c] if c in known else level_data([c])[0])
        fitted[lv.name], ratios[lv.name] = data, 16.0 / bits
    return dataclasses.replace(base, levels=fitted, info={**base.info, "calibration_ratios": ratios})


def _group_basis(kvs, starts, i: int, inv_freq, g: int, count: int, s, s_inv) -> tuple[torch.Tensor, ...]:
    """Layer group ``i``'s calibration statistics and integer transforms, from its raw vectors (float64
    ``[1, 2, T_j, N]`` per sequence, the only per-token data alive): ``(mu_raw [1, 2, N], peak
    [1, 2], var [1, 2, N] (descending), e_int [1, 2, N, N], se [1, 2, N], d_int, sd)``: the
    operations of the all-groups fit on this group's slice (the same bits, compared)."""
    rows = slice(i * g, (i + 1) * g)
    xs = [tf.raw_vectors(kv[rows], int(st), inv_freq, g) for kv, st in zip(kvs, starts)]
    mu = sum(x.sum(2) for x in xs) / count  # [1, 2, N]
    peak = torch.stack([x.abs().amax((2, 3)) for x in xs]).amax(0)
    n = xs[0].shape[3]
    cov = torch.zeros(1, 2, n, n, dtype=torch.float64)
    for x in xs:
        y = x - mu[:, :, None]
        if s is not None:
            y = y @ s[i : i + 1]
        cov += y.transpose(2, 3) @ y
    del xs, y
    var, u = torch.linalg.eigh(cov / count)
    var, u = var.flip(-1).clamp_min(0), u.flip(-1)
    e, se = _int_columns(u if s is None else s[i : i + 1] @ u)  # raw -> coefficients
    d, sd = _int_columns(u.transpose(2, 3) if s_inv is None else u.transpose(2, 3) @ s_inv[i : i + 1])
    return mu, peak, var, e, se, d, sd


def _group_model(base: PCAModel, i: int) -> PCAModel:
    """Layer group ``i`` of ``base`` as a model of its ``G`` layers (views of ``base``'s arrays): what
    :func:`.transform.transform` and :func:`.transform.quantize` need to run on that group alone."""
    one = slice(i, i + 1)
    arrays = {a: getattr(base, a)[one] for a in ("inv_x_scale", "mu_int", "e_int", "e_mu", "d_int", "mu_raw")}
    n = base.vector_size
    return dataclasses.replace(base, num_layers=base.layer_group, levels={"": _placeholder_level(1, n)}, **arrays)


def _fit_level(base: PCAModel, lv: PCALevel, values: int, level_data) -> tuple[PCALevelData, float]:
    """``(the level's data, its ideal bits per value on the calibration KV)``: at ``lv.c``, or for a
    ``calibration_ratio`` level at the ``c`` whose ideal coded size of the calibration KV is that ratio
    within 0.5 %: secant steps on (log2 c, bits per value), which is near linear (each active
    component's rate falls by one bit per doubling of the step). ``level_data(c)``: a :class:`_Fitted`."""

    def at(c: float) -> tuple[float, PCALevelData]:
        data = level_data(c)
        return data.info_bits / values, data.level

    if lv.c is not None:
        b, data = at(lv.c)
        return data, b
    target = 16.0 / lv.calibration_ratio
    x0 = math.log2(0.25)
    b0, _ = at(2.0**x0)
    x1 = x0 + (b0 - target) / 2.0  # first guess: a slope of -2 bits per doubling
    for _ in range(12):
        b1, data = at(2.0**x1)
        if abs(b1 / target - 1) < 0.005:
            return data, b1
        slope = (b1 - b0) / (x1 - x0) if x1 != x0 and b1 != b0 else -0.5
        x0, b0, x1 = x1, b1, x1 + (target - b1) / min(slope, -0.05)
    raise RuntimeError(
        f"PCA level {lv.name}: no step codes the calibration KV at {lv.calibration_ratio}x within 0.5 % "
        f"(last: {16.0 / b0:.3f}x)"
    )


class _Fitted:
    def __init__(self, level: PCALevelData, info_bits: float) -> None:
        self.level, self.info_bits = level, info_bits


def _level_data(
    base: PCAModel, groups: list[PCAModel], cs: list[float], rms, se, sx, sd, kvs, starts, share: float
) -> list[_Fitted]:
    """The levels' data at relative steps ``cs`` and the ideal bits of the calibration KV under each
    (static tables of its own counts, escapes and exact tokens at 16 bits per value).

    One layer group at a time (``groups``: :func:`_group_model`), every step on the same transform
    output; per sequence only that group's ``[1, 2, T, N]`` arrays are alive. The first pass counts
    the symbols of every token and keeps what spans the groups, all per token: energies (float64
    ``[R, 2, T]``), escapes and the exact flags of :func:`.transform.quantize`. Then the energy
    threshold (over all groups) tells the exact tokens, and a second pass takes their symbols out of
    the counts again, their transform recomputed on those few tokens: the integer arithmetic
    (:mod:`.transform`) gives every token the same coefficients whatever tokens it runs with."""
    r, n, g = base.rows, base.vector_size, base.layer_group
    steps = [c * rms for c in cs]  # [R, 2] each
    ks = [se * sx[:, :, None] / step[:, :, None] for step in steps]
    lens = [kv.shape[2] for kv in kvs]
    energy = [[torch.empty(r, 2, t, dtype=torch.float64) for t in lens] for _ in cs]
    flags = [[torch.zeros(t, dtype=torch.bool) for t in lens] for _ in cs]
    escapes = [[torch.zeros(t, dtype=torch.int64) for t in lens] for _ in cs]
    counts = [torch.zeros(r * 2 * n, 256, dtype=torch.int64) for _ in cs]
    for i, m in enumerate(groups):
        for j, (kv, st) in enumerate(zip(kvs, starts)):
            acc, clamped = tf.transform(m, kv[i * g : (i + 1) * g], int(st))
            for li, k in enumerate(ks):
                fw = tf.quantize(m, acc, clamped, int(st), k[i : i + 1], None)
                energy[li][j][i], flags[li][j] = fw.energy[0], flags[li][j] | fw.exact
                hist, esc = _histogram(fw.q)
                counts[li][i * 2 * n : (i + 1) * 2 * n] += hist
                escapes[li][j] += esc
            del acc, fw
    thrs = [_threshold(base, e, starts, share) for e in energy]
    exact = [[f | tf.loud(e, thr) for f, e in zip(fl, en)] for fl, en, thr in zip(flags, energy, thrs)]
    _uncount_exact(groups, kvs, starts, ks, exact, energy, counts)
    per_token = base.num_layers * 2 * base.num_heads * base.head_size
    fitted = []
    for c, step, k, thr, cnt, ex, es in zip(cs, steps, ks, thrs, counts, exact, escapes):
        exact_values = sum(int(x.sum()) for x in ex) * per_token
        esc = sum(int(e[~x].sum()) for e, x in zip(es, ex))
        tables = np.stack([rans.build_table(row, alphabet_size=256) for row in cnt.numpy()])
        ideal = torch.from_numpy(tables / 4096.0).log2_().neg_().mul_(cnt)  # counts * -log2 p, in place
        bits = float(ideal.sum()) + 16.0 * (exact_values + esc)
        f = sd * step[:, :, None]
        fitted.append(_Fitted(PCALevelData(c, step.numpy(), k.numpy(), f.numpy(), thr.numpy(), tables), bits))
    return fitted


def _uncount_exact(groups, kvs, starts, ks, exact, energy, counts) -> None:
    """Take the symbols of the exact tokens (``exact[level][sequence]``, bool ``[T]``) out of each
    level's ``counts`` (int64 ``[R * 2 * N, 256]``, which counted every token), their coefficients
    recomputed one layer group at a time: the raw vectors of each run of consecutive exact tokens
    (at its positions), one transform of them all (:func:`.transform.transform_vectors`), then
    :func:`.transform.quantize` of each run (its start decides ``exact_first``, as in the first pass).

    Raises:
        RuntimeError: a recomputed token's energy differs from the first pass's (the integer
            arithmetic of :mod:`.transform` rules it out; the counts would be wrong).
    """
    g, n, inv_freq = groups[0].layer_group, groups[0].vector_size, groups[0].inv_freq
    runs = [(j, a, b) for j in range(len(kvs)) for a, b in _runs(torch.stack([ex[j] for ex in exact]).any(0))]
    if not runs:
        return
    for i, m in enumerate(groups):
        layers, rows = slice(i * g, (i + 1) * g), slice(i * 2 * n, (i + 1) * 2 * n)
        x = torch.cat([tf.raw_vectors(kvs[j][layers, :, a:b], int(starts[j]) + a, inv_freq, g) for j, a, b in runs], 2)
        acc, clamped = tf.transform_vectors(m, x)
        del x
        for li, k in enumerate(ks):
            qs, off = [], 0
            for j, a, b in runs:
                out, t = exact[li][j][a:b], slice(off, off + b - a)
                fw = tf.quantize(m, acc[:, :, t], clamped[t], int(starts[j]) + a, k[i : i + 1], None)
                same = (fw.energy[0] == energy[li][j][i][:, a:b]).all(0) | ~out
                if not bool(same.all()):
                    at = a + int(torch.nonzero(~same)[0, 0])
                    raise RuntimeError(f"PCA fit: token {at} of sequence {j} got another energy when recomputed")
                qs.append(fw.q[:, :, out])
                off += b - a
            counts[li][rows] -= _histogram(torch.cat(qs, 2))[0]


def _threshold(base: PCAModel, energy: list[torch.Tensor], starts, share: float) -> torch.Tensor:
    """int64 ``[R, 2]`` energy thresholds: ``share`` of the tokens at positions >= ``exact_first``
    exceed them (their largest energy relative to each (layer group, K/V)'s median); ``energy``:
    :class:`.transform.Forward`'s float64 ``[R, 2, T]`` of each sequence. No threshold (int64 max)
    at ``share`` 0 or without such tokens."""
    pos = [torch.arange(int(st), int(st) + e.shape[2]) >= base.exact_first for e, st in zip(energy, starts)]
    e = torch.cat([en[:, :, p] for en, p in zip(energy, pos)], -1)  # [R, 2, T']
    thr = torch.full((base.rows, 2), np.iinfo(np.int64).max, dtype=torch.int64)
    if share > 0 and e.shape[-1]:
        med = e.median(-1).values.clamp_min(1.0)
        score = (e / med[:, :, None]).amax(1).amax(0)
        cut = float(torch.quantile(score, 1 - share))
        thr = torch.floor(cut * med).to(torch.int64)
    return thr


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[a, b)`` runs of consecutive True of bool ``mask`` ``[T]``."""
    idx = torch.nonzero(mask)[:, 0].tolist()
    runs: list[tuple[int, int]] = []
    for t in idx:
        if runs and runs[-1][1] == t:
            runs[-1] = (runs[-1][0], t + 1)
        else:
            runs.append((t, t + 1))
    return runs


def _histogram(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The symbols (:func:`.transform.symbols`) of one layer group's coefficients ``q`` (float64
    ``[1, 2, T, N]``, integer-valued): (int64 ``[2 * N, 256]`` counts, row ``p * N + n`` for
    coefficient ``n`` of K/V ``p``; int64 ``[T]`` escaped coefficients per token). The temporaries
    are ``T * N`` values."""
    n = q.shape[3]
    lanes = 256 * torch.arange(n, dtype=torch.int64)
    hist = torch.empty(2 * n, 256, dtype=torch.int64)
    esc = 0
    for p in range(2):
        sym, big = tf.symbols(q[0, p].to(torch.int64))  # [T, N]
        esc = esc + big.sum(1)
        hist[p * n : (p + 1) * n] = torch.bincount((sym.to(torch.int64) + lanes).reshape(-1), minlength=256 * n).view(
            n, 256
        )
    return hist, esc


def _placeholder_level(r: int, n: int) -> PCALevelData:
    """A level of the right shapes (the model needs one before its levels are fitted)."""
    z = np.zeros((r, 2, n))
    return PCALevelData(
        0.0, np.ones((r, 2)), z, z, np.zeros((r, 2), np.int64), np.full((r * 2 * n, 256), 16, np.uint16)
    )
