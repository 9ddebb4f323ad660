"""The PCA codec levels (`lmtier.codec.pca`) on small synthetic KV (L=4, H=2, D=16, G=2: R=2 layer
groups of N=64 values): the records are the documented integer arithmetic (a NumPy int64 reference
reproduces every coefficient, exact token and decoded bit), the error of a non-exact token is bounded
by half a step plus the fixed-point and int16-matrix terms, exact tokens come back bit for bit,
records and model files are deterministic and carry the model id, and positions are the stored
start's. The refusals of bad inputs, records, model files and fits: ``test_codec_pca_refusals``."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct

import numpy as np
import pytest
import torch

from lmtier.codec import format as fmt
from lmtier.codec import levels as codec_levels
from lmtier.codec import pca, rans
from lmtier.codec.pca import model as pca_model
from lmtier.codec.pca import rope
from lmtier.codec.pca import transform as tf
from lmtier.codec.pca.levels import PCA_LEVELS_BY_ID

L, H, D, G = 4, 2, 16, 2
R, N = L // G, G * H * D
RANK = 6  # latent factors per (layer, plane): the basis has a low rank to find
INV_FREQ = 1.0 / 10000.0 ** (np.arange(0, D, 2, dtype=np.float64) / D)
LEVEL_NAMES = ("pca_high", "pca_default")
LOUD = 30.0  # a planted loud token is this many times an ordinary one

_g = torch.Generator().manual_seed(1234)
_MIX = torch.randn(L, 2, RANK, H * D, generator=_g, dtype=torch.float64)
_SCALE = torch.exp(0.7 * torch.randn(L, 2, H * D, generator=_g, dtype=torch.float64))  # per channel
_MEAN = 0.5 * torch.randn(L, 2, H * D, generator=_g, dtype=torch.float64)


def _kv(tokens: int, start: int, seed: int, *, loud=(), dtype=torch.bfloat16) -> torch.Tensor:
    """Canonical KV ``[L, 2, T, H, D]`` at positions ``start ..``: correlated Gaussian (RANK factors
    plus 10 % noise, per-channel scales and means), keys rotated by RoPE *after* the correlation is
    made (as a model caches them), tokens ``loud`` multiplied by LOUD."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(L, 2, tokens, RANK, generator=g, dtype=torch.float64) @ _MIX
    z = z + 0.1 * torch.randn(L, 2, tokens, H * D, generator=g, dtype=torch.float64)
    x = (z * _SCALE[:, :, None] + _MEAN[:, :, None]).reshape(L, 2, tokens, H, D)
    cos, sin = rope.cos_sin(INV_FREQ, start, tokens)
    x = torch.stack([rope.apply(x[:, 0], cos, sin), x[:, 1]], 1)
    for t in loud:
        x[:, :, t] *= LOUD
    return x.to(dtype)


def _calibration() -> tuple[list[torch.Tensor], list[int]]:
    return [_kv(256, 0, 1, loud=(40, 200)), _kv(160, 300, 2, loud=(10,))], [0, 300]


def _spd_metric(seed: int) -> torch.Tensor:
    """Random SPD ``[L, 2, H*D, H*D]``, block-diagonal over heads (as :func:`pca.hf.metric_from`)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(L, 2, H * D, H * D, dtype=torch.float64)
    for h in range(H):
        a = torch.randn(L, 2, D, D, generator=g, dtype=torch.float64)
        out[:, :, h * D : (h + 1) * D, h * D : (h + 1) * D] = a @ a.transpose(-1, -2) / D + 0.1 * torch.eye(D)
    return out


SYNTHETIC_LEVELS = tuple(
    dataclasses.replace(lv, c=None, calibration_ratio=r)
    for lv, r in zip(pca.PCA_LEVELS.values(), (5.0, 8.0), strict=True)
)
"""The PCA levels with their steps searched so that the synthetic calibration KV codes at 5x / 8x
(``calibration_ratio``): the synthetic KV is not a model's, and at the shipped relative steps its
escapes and loud tokens (which the tests build on) would fall elsewhere. The shipped steps are fitted
on SmolLM2 by tests/test_codec_pca_calibrate.py."""


@functools.cache
def fitted(kind: str) -> pca.PCAModel:
    """The synthetic calibration's model: ``"plain"`` (outlier share 0.01) or ``"metric"`` (and a
    random SPD metric); fitted once per test session (test_codec_pca_refusals uses them too)."""
    kvs, starts = _calibration()
    metric = _spd_metric(5) if kind == "metric" else None
    name = "synthetic" if kind == "plain" else ""
    return pca.fit(
        kvs,
        starts,
        inv_freq=INV_FREQ,
        layer_group=G,
        metric=metric,
        outlier_share=0.01,
        name=name,
        levels=SYNTHETIC_LEVELS,
    )


@pytest.fixture(scope="module")
def model() -> pca.PCAModel:
    return fitted("plain")


@pytest.fixture(scope="module")
def metric_model() -> pca.PCAModel:
    return fitted("metric")


@pytest.fixture(scope="module")
def quiet_model() -> pca.PCAModel:
    """No outliers (``outlier_share=0``), the first 2 positions exact."""
    kvs, starts = _calibration()
    return pca.fit(
        kvs, starts, inv_freq=INV_FREQ, layer_group=G, outlier_share=0.0, exact_first=2, levels=SYNTHETIC_LEVELS
    )


# ---------------------------------------------------------------------------------------------------
# A NumPy reference of the documented record layout and arithmetic (lmtier.codec.pca.codec/transform)


def _parts(record: bytes) -> tuple[fmt.RecordInfo, list[bytes], tuple[int, int, int]]:
    """(header, every section's bytes, metadata (start, exact tokens, escapes); the model digest is
    :func:`pca.codec.record_meta`'s)."""
    rec = fmt.unpack(record)
    s = rec.info.sections_per_layer
    secs = [bytes(rec.section(i // s, i % s)) for i in range(rec.info.num_sections)]
    return rec.info, secs, tuple(pca.codec.record_meta(record)[:3])


def _repack(record: bytes, *, info=None, secs=None, meta=None, digest=None) -> bytes:
    """``record`` with some parts replaced, checksum recomputed (a hostile, well-formed record)."""
    i, s, m = _parts(record)
    d = pca.codec.record_meta(record).model_digest if digest is None else digest
    return fmt.pack(info or i, s if secs is None else secs, struct.pack("<qII16s", *(meta or m), d))


def _coded(record: bytes, m: pca.PCAModel, level: str) -> tuple[np.ndarray, np.ndarray]:
    """The record's coefficients int64 ``[R, 2, T, N]`` (symbols ``q + 127`` per component run, 255
    escaped to the int16 section) and exact-token bitmap bool ``[T]``."""
    info, secs, _ = _parts(record)
    t, r, n = info.num_tokens, m.rows, m.vector_size
    t32 = -(-t // 32) * 32
    streams = [np.frombuffer(s, np.uint8) for s in secs[: 2 * r]]
    tables = m.levels[level].tables  # stream i codes with its own N tables, named within a call of B streams
    b = 0xFFFF // n  # the streams whose table ids fit 16 bits below the adaptive id share a call
    call = lambda i: tables[i // b * b * n : (i // b + 1) * b * n]  # noqa: E731
    sym = np.stack([rans.decode([st], call(i))[0] for i, st in enumerate(streams)])
    sym = sym.reshape(r, 2, n, t32)[..., :t]
    q = sym.astype(np.int64) - 127
    q[sym == 255] = np.frombuffer(secs[2 * r], "<i2")
    exact = np.unpackbits(np.frombuffer(secs[2 * r + 1], np.uint8), count=t, bitorder="little").astype(bool)
    return q.transpose(0, 1, 3, 2), exact


def _cos_sin(start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    ang = np.arange(start, start + tokens, dtype=np.float64)[:, None] * INV_FREQ[None]
    ang = np.concatenate([ang, ang], 1)[:, None]  # [T, 1, D]
    return np.cos(ang), np.sin(ang)


def _rotate(k: np.ndarray, start: int, sign: float) -> np.ndarray:
    """``k * cos + sign * rotate_half(k) * sin``, each product rounded, then the sum (no FMA)."""
    cos, sin = _cos_sin(start, k.shape[-3])
    half = np.concatenate([-k[..., D // 2 :], k[..., : D // 2]], -1)
    a, b = k * cos, half * sin
    return a + b if sign > 0 else a - b


def _raw(kv: torch.Tensor, start: int) -> np.ndarray:
    """float64 ``[R, 2, T, N]``: keys RoPE-undone, the G layers of a group concatenated per token."""
    x = kv.double().numpy()
    x = np.stack([_rotate(x[:, 0], start, -1), x[:, 1]], 1)
    t = x.shape[2]
    return x.reshape(R, G, 2, t, H * D).transpose(0, 2, 3, 1, 4).reshape(R, 2, t, N)


def _ref_encode(m: pca.PCAModel, level: str, kv: torch.Tensor, start: int) -> tuple[np.ndarray, np.ndarray]:
    """(q int64 ``[R, 2, T, N]``, exact bool ``[T]``) as :class:`pca.PCAModel`'s docstring defines
    them, in int64 where the codec computes in exact float64."""
    lv = m.levels[level]
    xi = np.rint(_raw(kv, start) * m.inv_x_scale[:, :, None, None])
    clamped = (np.abs(xi) > tf.XMAX).any((0, 1, 3))
    acc = np.clip(xi, -tf.XMAX, tf.XMAX).astype(np.int64) @ m.e_int.astype(np.int64) - m.e_mu[:, :, None]
    y = acc * lv.k[:, :, None]
    q = np.rint(y)
    fine = np.clip(np.rint(y * tf.ENERGY_SCALE), -tf.EMAX, tf.EMAX).astype(np.int64)
    energy = (fine * fine).sum(-1)
    positions = np.arange(start, start + kv.shape[2])
    exact = clamped | (np.abs(q) > tf.XMAX).any((0, 1, 3)) | (positions < m.exact_first)
    exact |= (energy > lv.energy_threshold[:, :, None]).any((0, 1))
    q = q.astype(np.int64)
    q[:, :, exact] = 0
    return q, exact


def _ref_decode(m: pca.PCAModel, level: str, q: np.ndarray, start: int, dtype: torch.dtype) -> torch.Tensor:
    """``(q @ d_int) * f + mu_raw``, RoPE redone, float64 -> float32 -> ``dtype``."""
    lv = m.levels[level]
    x = (q @ m.d_int.astype(np.int64)).astype(np.float64) * lv.f[:, :, None] + m.mu_raw[:, :, None]
    t = q.shape[2]
    x = x.reshape(R, 2, t, G, H * D).transpose(0, 3, 1, 2, 4).reshape(L, 2, t, H, D)
    x = np.stack([_rotate(x[:, 0], start, +1), x[:, 1]], 1)
    return torch.from_numpy(x.astype(np.float32)).to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def _error_bound(m: pca.PCAModel, level: str, kv: torch.Tensor, dec: torch.Tensor, start: int) -> np.ndarray:
    """Per (layer group, K/V, token): ``bound - ||decoded - chunk||_2`` over the token's N values.

    With ``sx = 1 / inv_x_scale``, the encode basis actually used ``Be = e_int * se`` (``se = k *
    step / sx`` per column) and the decode one ``Bd = d_int * sd`` (``sd = f / step``), a raw vector
    ``u`` (RoPE undone) and its coefficients ``c = (u - mu_raw) @ Be``:

    * encode: ``sx * (x_int - mu_int) = u - mu_raw + delta`` with ``|delta_i| <= sx`` (two roundings
      to the fixed point), and ``step * y = sx * (x_int - mu_int) @ Be`` exactly, so
      ``|step * q_j - c_j| <= step / 2 + sx * ||Be[:, j]||_1 =: b_j`` (``q = round(y)``);
    * decode: ``x = step * q @ Bd + mu_raw``, so ``x - u = (step q - c) @ Bd + (u - mu_raw) @ (Be Bd - I)``
      and ``||x - u|| <= ||b|| ||Bd||_2 + ||u - mu_raw|| ||Be Bd - I||_2``;
    * RoPE is a rotation per (token, head): it keeps the norm; the output's rounding to float32 then
      bf16/fp16 adds at most ``2**-8 * ||decoded||`` (relative rounding 2**-9 and 2**-24).

    A relative ``1e-9`` and an absolute ``1e-6`` cover the float64 roundings.
    """
    lv = m.levels[level]
    step, sx = lv.step, 1.0 / m.inv_x_scale  # [R, 2]
    be = m.e_int * (lv.k * (step / sx)[:, :, None])[:, :, None, :]  # [R, 2, N in, N coefficients]
    bd = m.d_int * (lv.f / step[:, :, None])[:, :, None, :]  # [R, 2, N coefficients, N out]
    b = step[:, :, None] / 2 + sx[:, :, None] * np.abs(be).sum(2)  # [R, 2, N]
    eye = np.eye(N)
    u_mu = np.linalg.norm(_raw(kv, start) - m.mu_raw[:, :, None], axis=-1)  # [R, 2, T]
    bound = np.zeros(u_mu.shape)
    for r in range(R):
        for p in range(2):
            mix = np.linalg.norm(be[r, p] @ bd[r, p] - eye, 2)
            bound[r, p] = np.linalg.norm(b[r, p]) * np.linalg.norm(bd[r, p], 2) + u_mu[r, p] * mix
    vec = lambda x: x.double().numpy().reshape(R, G, 2, x.shape[2], H * D).transpose(0, 2, 3, 1, 4)  # noqa: E731
    err = np.linalg.norm((vec(dec) - vec(kv)).reshape(R, 2, -1, N), axis=-1)
    out = np.linalg.norm(vec(dec).reshape(R, 2, -1, N), axis=-1)
    return bound * (1 + 1e-9) + 2.0**-8 * out + 1e-6 - err


# ---------------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("level", LEVEL_NAMES)
@pytest.mark.parametrize("which", ["model", "metric_model"])
def test_records_are_the_documented_integer_arithmetic(request, which, level):
    """The record's coefficients and exact tokens are the NumPy int64 reference's, and the decoded
    chunk is the reference decode of them bit for bit (exact tokens: the input's bits)."""
    m = request.getfixturevalue(which)
    kv = _kv(50, 0, 7, loud=(20,))
    record = pca.encode(kv, start=0, model=m, level=level)
    q, exact = _coded(record, m, level)
    ref_q, ref_exact = _ref_encode(m, level, kv, 0)
    np.testing.assert_array_equal(exact, ref_exact)
    np.testing.assert_array_equal(q, ref_q)
    assert exact[0] and exact[20] and exact.sum() < 10
    dec = pca.decode(record, model=m)
    want = _ref_decode(m, level, ref_q, 0, kv.dtype)
    want[:, :, torch.from_numpy(exact)] = kv[:, :, torch.from_numpy(exact)]
    assert torch.equal(_bits(dec), _bits(want))


@pytest.mark.parametrize("level", LEVEL_NAMES)
@pytest.mark.parametrize("which", ["model", "metric_model"])
def test_exact_tokens_are_bit_for_bit_and_the_others_within_the_bound(request, which, level):
    """Position 0 and a planted loud token come back bit for bit; every other token's error obeys
    :func:`_error_bound` (half a step per coefficient plus the fixed-point and int16 terms)."""
    m = request.getfixturevalue(which)
    kv = _kv(64, 0, 8, loud=(33,))
    record = pca.encode(kv, start=0, model=m, level=level)
    info, _, (start, n_exact, _) = _parts(record)
    _, exact = _coded(record, m, level)
    assert (info.level_id, info.table_id, start) == (pca.get_pca_level(level).level_id, m.model_id, 0)
    assert exact[0] and exact[33] and n_exact == exact.sum() < 8
    dec = pca.decode(record, model=m)
    assert torch.equal(_bits(dec[:, :, exact]), _bits(kv[:, :, exact]))
    slack = _error_bound(m, level, kv, dec, 0)[:, :, ~exact]
    assert slack.min() >= 0, f"bound exceeded by {-slack.min()}"
    assert not torch.equal(dec[:, :, ~exact], kv[:, :, ~exact])  # lossy: not a copy


def test_error_scales_with_the_levels_step(model):
    """Relative to the calibration's RMS coefficient spread ``rms = step / c`` (the plain model's basis
    is orthonormal up to its int16 rounding), the error of a chunk's non-exact tokens is at most
    ``c / 2`` (every coefficient errs at most half a step; :func:`_error_bound` holds the exact terms)
    and grows with ``c`` (each level's fitted one): pca_high's (the smaller c) is below 1.5 times
    ``c_high / c_default`` of pca_default's (coefficients below half a step are zeroed at both levels)."""
    kv = _kv(96, 5, 9)
    rel = {}
    for name in LEVEL_NAMES:
        record = pca.encode(kv, start=5, model=model, level=name)
        _, exact = _coded(record, model, name)
        c = model.levels[name].c
        err = _raw(pca.decode(record, model=model), 5) - _raw(kv, 5)  # [R, 2, T, N]
        spread = (~exact).sum() * N * ((model.levels[name].step / c) ** 2).sum()
        rel[name] = float(np.linalg.norm(err[:, :, ~exact]) / spread**0.5)
        assert c / 12 < rel[name] < c / 2, (name, rel[name])
    c_high, c_default = model.levels["pca_high"].c, model.levels["pca_default"].c
    assert c_high < c_default
    assert rel["pca_high"] < 1.5 * c_high / c_default * rel["pca_default"], rel


def test_step_is_c_times_the_rms_spread_in_the_metrics_space(model, metric_model):
    """``step = c * rms`` per (layer group, K/V), ``rms**2`` the mean variance of the calibration's
    raw vectors (RoPE undone), weighed by the metric ``M`` when one was given: ``trace(M Cov) / N``
    (``M``: the group's layers' blocks on the diagonal)."""
    kvs, starts = _calibration()
    u = np.concatenate([_raw(kv, s) for kv, s in zip(kvs, starts)], 2)  # [R, 2, T, N]
    u = u - u.mean(2, keepdims=True)
    cov = np.einsum("rpti,rptj->rpij", u, u) / u.shape[2]
    metric = _spd_metric(5).numpy()
    blocks = np.zeros((R, 2, N, N))
    for j in range(G):
        blocks[:, :, j * H * D : (j + 1) * H * D, j * H * D : (j + 1) * H * D] = metric[j::G]
    rms = {"plain": np.sqrt(np.trace(cov, axis1=2, axis2=3) / N)}
    rms["metric"] = np.sqrt(np.trace(blocks @ cov, axis1=2, axis2=3) / N)
    for which, m in (("plain", model), ("metric", metric_model)):
        for lv in m.levels.values():
            np.testing.assert_allclose(lv.step, lv.c * rms[which], rtol=1e-9)
    assert not np.allclose(rms["plain"], rms["metric"], rtol=0.1)


def test_escapes_round_trip(quiet_model):
    """A token 8x louder than usual (not exact: no outlier threshold) has coefficients beyond the
    symbol range: they are escaped, announced in the metadata and decoded within the bound."""
    kv = _kv(40, 100, 10)
    kv[:, :, 17] *= 8
    record = pca.encode(kv, start=100, model=quiet_model, level="pca_high")
    _, secs, (_, n_exact, n_esc) = _parts(record)
    q, exact = _coded(record, quiet_model, "pca_high")
    assert n_exact == 0 and not exact.any()
    assert n_esc == (np.abs(q) > 127).sum() == len(secs[2 * R]) // 2 > 0
    assert (np.abs(q[:, :, 17]) > 127).any()
    dec = pca.decode(record, model=quiet_model)
    assert _error_bound(quiet_model, "pca_high", kv, dec, 100).min() >= 0


def test_without_outliers_only_the_first_positions_are_exact(quiet_model):
    """``outlier_share=0``: no energy threshold (int64 max), so on ordinary data only the positions
    below ``exact_first`` (2) are exact, wherever the chunk starts."""
    assert all((lv.energy_threshold == np.iinfo(np.int64).max).all() for lv in quiet_model.levels.values())
    for start, want in ((0, [0, 1]), (1, [0]), (2, []), (500, [])):
        record = pca.encode(_kv(50, start, 11), start=start, model=quiet_model, level="pca_default")
        _, exact = _coded(record, quiet_model, "pca_default")
        assert np.flatnonzero(exact).tolist() == want
        assert _parts(record)[2][1] == len(want)


def _hand_model() -> pca.PCAModel:
    """L=1, H=1, D=4, G=1 (N=4), no RoPE, identity transforms, mean 0, no exact positions; fixed
    point 1/2 (K) and 1 (V). pca_default: ``k`` K ``[1, 8191.75, 1, 1]``, V ``[0.5, 1, 1e-3, 1]``, no
    energy threshold; pca_high: ``k`` K 1, V 1/8, energy threshold V 64 (K none). ``f = 1 / (k * inv_x_scale)``."""
    inv_x = np.array([[0.5, 1.0]])
    eye = np.eye(4, dtype=np.int16).reshape(1, 1, 4, 4).repeat(2, 1)
    never = np.iinfo(np.int64).max
    ks = {
        "pca_default": np.array([[[1, 8191.75, 1, 1], [0.5, 1, 1e-3, 1]]]),
        "pca_high": np.array([[[1.0] * 4, [0.125] * 4]]),
    }
    thr = {"pca_default": np.array([[never, never]]), "pca_high": np.array([[never, 64]])}
    levels = {
        name: pca_model.PCALevelData(
            0.1,
            np.ones((1, 2)),
            k,
            1 / (k * inv_x[:, :, None]),
            thr[name],
            np.full((8, 256), 16, np.uint16),
        )
        for name, k in ks.items()
    }
    zeros = np.zeros((1, 2, 4))
    return pca.PCAModel(
        "hand", 1, 1, 4, 1, None, 0, inv_x, zeros.astype(np.int32), eye, zeros.astype(np.int64), eye, zeros, levels
    )


def _hand_chunk(k_rows, v_rows) -> torch.Tensor:
    """fp16 ``[1, 2, T, 1, 4]`` of token rows ``{component: value}`` for K and V."""
    x = torch.zeros(1, 2, len(k_rows), 1, 4, dtype=torch.float64)
    for p, rows in enumerate((k_rows, v_rows)):
        for t, row in enumerate(rows):
            for j, v in row.items():
                x[0, p, t, 0, j] = v
    return x.to(torch.float16)


def test_arithmetic_corner_cases_on_a_hand_built_model():
    """Round half to even (fixed point and coefficients), the symbol range (+-127 coded, +-128
    escaped, escapes in stream order), a coefficient of 32767 coded and one beyond exact, a fixed
    point of +-32768 exact and 32752 not, an energy equal to the threshold coded and above it exact."""
    m = _hand_model()
    ties = [1, 3, 5, -1, -3, -5]
    k_rows = [{0: v} for v in ties] + [{}] * 4 + [{1: 8}, {1: 10}] + [{}] * 3
    v_rows = [{0: v} for v in ties] + [{1: 127}, {1: 128}, {1: -127}, {1: -128}, {}, {}]
    v_rows += [{2: 32752}, {2: 32768}, {2: -32768}]
    kv = _hand_chunk(k_rows, v_rows)
    record = pca.encode(kv, start=0, model=m, level="pca_default")
    q, exact = _coded(record, m, "pca_default")
    _, secs, (_, n_exact, n_esc) = _parts(record)
    assert np.flatnonzero(exact).tolist() == [11, 13, 14] and n_exact == 3
    halves = [0, 2, 2, 0, -2, -2]  # round_half_even(v / 2): K through the fixed point, V through k
    assert q[0, 0, :6, 0].tolist() == halves and q[0, 1, :6, 0].tolist() == halves
    assert q[0, 1, 6:10, 1].tolist() == [127, 128, -127, -128]
    assert q[0, 0, 10, 1] == 32767 and q[0, 1, 12, 2] == 33
    assert n_esc == 3 and np.frombuffer(secs[2], "<i2").tolist() == [32767, 128, -128]  # K before V
    dec = pca.decode(record, model=m)
    assert dec[0, 0, :6, 0, 0].tolist() == [0, 4, 4, 0, -4, -4] and dec[0, 1, :6, 0, 0].tolist() == [0, 4, 4, 0, -4, -4]
    assert torch.equal(_bits(dec[:, :, exact]), _bits(kv[:, :, exact]))

    energy = _hand_chunk([{}, {}, {}, {0: 1000}], [{3: 8}, {3: 8, 2: 1}, {3: -8}, {}])
    record = pca.encode(energy, start=0, model=m, level="pca_high")
    _, exact = _coded(record, m, "pca_high")
    assert np.flatnonzero(exact).tolist() == [1]  # V energies sum (8 * y)**2 = 64, 65, 64; K: no threshold


def test_fitted_model_invariants(model):
    """``e_mu = mu_int @ e_int`` exactly; ``mu_int`` is the mean rounded to the fixed point; the int16
    matrices use their whole range per column; the fixed point covers twice (``x_headroom``) the
    calibration's largest magnitude per (layer group, K/V)."""
    np.testing.assert_array_equal(model.e_mu, (model.mu_int[:, :, None].astype(np.int64) @ model.e_int)[:, :, 0])
    assert np.abs(model.mu_int - model.mu_raw * model.inv_x_scale[:, :, None]).max() <= 0.5 + 1e-9
    for a in (model.e_int, model.d_int):
        assert (np.abs(a.astype(np.int64)).max(2) == tf.XMAX).all()
    kvs, starts = _calibration()
    peak = np.max([np.abs(_raw(kv, s)).max((2, 3)) for kv, s in zip(kvs, starts)], 0)
    np.testing.assert_allclose(model.inv_x_scale * peak * 2, tf.XMAX, rtol=1e-12)


def test_outlier_share_keeps_the_loudest_calibration_tokens_exact(model):
    """``outlier_share=0.01`` of the 414 calibration tokens past position 0 (4) are above the energy
    threshold; the three planted loud ones among them."""
    kvs, starts = _calibration()
    flagged = []
    for kv, start in zip(kvs, starts):
        _, exact = _ref_encode(model, "pca_default", kv, start)
        flagged.append(np.flatnonzero(exact & (np.arange(start, start + kv.shape[2]) >= 1)))
    assert {40, 200} <= set(flagged[0].tolist()) and 10 in flagged[1].tolist()
    assert 3 <= sum(map(len, flagged)) <= 6


# ---------------------------------------------------------------------------------------------------
# Determinism, model file, ids


def test_encoding_is_deterministic_and_the_model_file_round_trips(model, tmp_path):
    """Encoding twice gives the same bytes; a saved and loaded model has the same id (the first 4
    bytes, little endian, of the file's SHA-256) and encodes and decodes identically."""
    kv = _kv(50, 0, 12, loud=(3,))
    a = pca.encode(kv, start=0, model=model, level="pca_high")
    assert a == pca.encode(kv.clone(), start=0, model=model, level="pca_high")
    path = tmp_path / "m.lmtpca"
    assert pca.save(model, path) == model.model_id
    data = path.read_bytes()
    assert data[-32:] == hashlib.sha256(data[:-32]).digest()
    assert model.model_id == int.from_bytes(data[-32:-28], "little") != 0xFFFFFFFF
    loaded = pca.load(path)
    assert loaded.model_id == model.model_id and pca_model.to_bytes(loaded) == data
    assert pca.encode(kv, start=0, model=loaded, level="pca_high") == a
    assert torch.equal(_bits(pca.decode(a, model=loaded)), _bits(pca.decode(a, model=model)))
    assert (path.stat().st_mode & 0o777) == 0o600


def test_model_id_is_never_the_no_table_id():
    assert pca_model._id(b"\xff" * 4 + bytes(28)) == 0xFFFFFFFE != fmt.NO_TABLE
    assert pca_model._id(b"\x01\x02\x03\x04" + bytes(28)) == 0x04030201


def test_level_ids_are_not_the_codecs_other_levels():
    assert {lv.level_id for lv in pca.PCA_LEVELS.values()} == {8, 9}
    assert not set(PCA_LEVELS_BY_ID) & set(codec_levels.LEVELS_BY_ID)
    assert not set(pca.PCA_LEVELS) & {*codec_levels.LEVELS, *codec_levels.EXPERIMENTAL_LEVELS}
    assert pca.get_pca_level(8).name == "pca_high" and pca.get_pca_level("pca_default").level_id == 9


# ---------------------------------------------------------------------------------------------------
# Positions, token counts, dtypes


def test_positions_are_the_stored_starts(model):
    """A chunk at position 1000 round-trips within the bound; its record stores 1000 and the
    decoder uses it: the same record announcing 1001 decodes to other keys (RoPE of other positions,
    now beyond the bound) and the same values; coded at position 0 it is another record."""
    kv = _kv(40, 1000, 13)
    record = pca.encode(kv, start=1000, model=model, level="pca_high")
    _, _, meta = _parts(record)
    assert meta[0] == 1000 and meta[1] == 0
    dec = pca.decode(record, model=model)
    assert _error_bound(model, "pca_high", kv, dec, 1000).min() >= 0
    moved = pca.decode(_repack(record, meta=(1001, *meta[1:])), model=model)
    assert torch.equal(moved[:, 1], dec[:, 1]) and not torch.equal(moved[:, 0], dec[:, 0])
    assert _error_bound(model, "pca_high", kv, moved, 1000)[:, 0].min() < 0
    assert pca.encode(kv, start=0, model=model, level="pca_high") != record


@pytest.mark.parametrize("tokens", [0, 1, 31, 33, 50])
def test_token_counts_not_multiples_of_32(model, tokens):
    kv = _kv(tokens, 7, 14)
    record = pca.encode(kv, start=7, model=model, level="pca_default")
    info, secs, _ = _parts(record)
    assert info.num_tokens == tokens and len(secs[2 * R + 1]) == -(-tokens // 8)
    dec = pca.decode(record, model=model)
    assert dec.shape == kv.shape and dec.dtype == kv.dtype
    if tokens:
        q, _ = _coded(record, model, "pca_default")
        np.testing.assert_array_equal(q, _ref_encode(model, "pca_default", kv, 7)[0])
        assert _error_bound(model, "pca_default", kv, dec, 7).min() >= 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtypes(model, dtype):
    """bf16 and fp16 chunks: the record's dtype code, the decoded dtype and the reference bits."""
    kv = _kv(50, 0, 15, loud=(9,), dtype=dtype)
    record = pca.encode(kv, start=0, model=model, level="pca_high")
    info, _, _ = _parts(record)
    assert info.dtype == {torch.bfloat16: fmt.DType.BFLOAT16, torch.float16: fmt.DType.FLOAT16}[dtype]
    dec = pca.decode(record, model=model)
    assert dec.dtype == dtype and dec.shape == kv.shape
    q, exact = _coded(record, model, "pca_high")
    want = _ref_decode(model, "pca_high", q, 0, dtype)
    assert torch.equal(_bits(dec[:, :, ~exact]), _bits(want[:, :, ~exact]))
    assert torch.equal(_bits(dec[:, :, exact]), _bits(kv[:, :, exact])) and exact[9]
    assert _error_bound(model, "pca_high", kv, dec, 0).min() >= 0


def test_decode_queued_on_the_host_is_decode(model):
    """On the host :func:`pca.codec.decode_queued` decodes at once (no event to wait for): its result
    holds the exact tokens bit for bit, is the same tensor each time asked, and a corrupt record
    raises at the call."""
    x = _kv(40, 8, 5, loud=(3,))
    record = pca.encode(x, start=8, model=model, level="pca_high")
    p = pca.codec.decode_queued(record, model=model)
    got = p.result()
    assert p.result() is got and got.device.type == "cpu" and p.ready is None
    exact = torch.from_numpy(_coded(record, model, "pca_high")[1])
    assert exact.any() and torch.equal(got[:, :, exact].view(torch.int16), x[:, :, exact].view(torch.int16))
    _, secs, _ = _parts(record)
    with pytest.raises(pca.codec.CodecRecordError, match="rans decode failed .*stream 0: "):
        pca.codec.decode_queued(_repack(record, secs=[secs[0][:20], *secs[1:]]), model=model)


def test_queued_streams_verify_names_the_stream_and_the_count():
    """:meth:`streams.QueuedStreams.verify` refuses a coder status other than ok (naming the stream)
    and a stream decoded to another count than asked."""
    from lmtier.codec.pca import streams

    q = streams.QueuedStreams(torch.zeros(3, 64, dtype=torch.uint8), torch.zeros(3, dtype=torch.int32),
                              torch.full((3,), 64), 64)  # fmt: skip
    q.verify(np.zeros(3, np.int32), np.full(3, 64))
    assert q.result() is q.symbols
    with pytest.raises(ValueError, match="rans decode failed for 1 stream.*stream 2: "):
        q.verify(np.array([0, 0, 3], np.int32), np.full(3, 64))
    with pytest.raises(ValueError, match=r"rANS streams of \[32, 64\] symbols, 64 expected"):
        q.verify(np.zeros(3, np.int32), np.array([64, 32, 64]))
