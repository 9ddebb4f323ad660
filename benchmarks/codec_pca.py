"""Experiment (issue 19): transform coding of the KV — a PCA basis instead of the Hadamard rotation.

The product's quantized levels rotate each (token, head) row by a Hadamard transform, scale it by its
absmax and quantize it uniformly (``lmtier.codec.quant``). The Hadamard transform spreads a row's
energy evenly over its channels, so the entropy coder gains nothing from channels of unequal
variance, and the per-row scale spends side bits and sets the step by the row's largest value. The
textbook alternative (transform coding: Karhunen-Loeve transform + one uniform step + entropy coder,
reverse water-filling; Goyal, "Theoretical foundations of transform coding", IEEE SPM 2001) is what
KVTC applies to KV caches (Staniszewski & Lancucki, "KV Cache Transform Coding for Compact Storage in
LLM Inference", ICLR 2026: one PCA over the keys and values of all layers and heads with positional
embeddings removed, a dynamic-programming bit allocation over the components, DEFLATE; the 4 oldest
and the 128 most recent tokens kept exact). This script measures a variant with a basis per one
or a few adjacent layers on the matrix's texts and models, beside ``default``:

1. **Basis** per (group of ``--layer-group`` adjacent layers, plane), fitted on the tune split
   (``codec_head_alloc.TUNE``, its first ``--cal-tokens`` tokens; never the evaluation texts): the mean
   ``mu`` and the eigenvectors ``U`` of the covariance of the vector of all heads of each token, keys
   with RoPE undone (``--rope keep`` leaves it on); with ``--metric model`` the vectors are first
   weighted so that squared errors count as the model sees them (:func:`model_metric`).
   ``--scope head`` fits one basis per KV head instead (the vector of one head in the group's
   layers: no decorrelation across heads, a GEMM of ``group * D`` square per head).
2. **Quantizer**: ``q = round((x - mu) U / step)`` (round half to even), decode ``q * step U^T + mu``
   (RoPE re-applied), cast to bf16. One ``step`` per (layer group, plane), no per-token side data.
   ``--rounding r < 0.5`` quantizes with a dead zone instead, ``sign(y) floor(|y| / step + r)``.
   Components whose spread is below the step quantize to 0 and cost almost nothing (the water-filling
   of the rate). Steps: ``step = c * rms`` (``rms`` of the group's centred vectors; ``c_v = c_k *
   --v-ratio``), or ``--weights sens``: ``step = c / sqrt(w)`` with ``w`` the (layer, plane)'s measured
   KL per unit of squared error at ``default`` (``codec_head_sens.json`` summed over heads, divided by
   ``default``'s squared error on the same texts) — the allocation minimizing the predicted KL
   ``sum w * step**2 / 12`` for a rate ``sum -log2 step``. ``c`` is found so that the tune split's
   ratio is ``--ratio`` (secant steps, :func:`fit_scheme`).
3. **Rate**: one uint8 stream per (layer group, plane, component) and 256-token chunk, symbol ``q + 127``;
   ``|q| > 127`` is coded as symbol 255 followed by 16 raw bits (exact). Ideal static-table coder fitted
   on the tune split with the per-chunk fallback (``codec_rates.StaticCoderModel``, as the matrix's
   ``ratio_bound``). The model-level data (``U``, ``mu``, steps) is a per-model table like the entropy
   tables, not counted per chunk.
   ``--token-classes K`` instead codes each coefficient with a static table per (layer group, plane,
   component, energy class of its token), the class sent as side information
   (:mod:`codec_pca_classes`; ideal coder only, no per-chunk fallback; ``K = 1`` is the plain static
   coder without the fallback).
   ``--exact-first N`` keeps the sequence's first N tokens exact (bf16, 16 bits per value, counted);
   ``--outliers p`` also every token whose outlier score (:class:`PCAScheme`) exceeds the tune split's
   ``1 - p`` quantile.
   The coefficients are float64 on the CPU: a product version would need a fixed-order GEMM for the
   CPU and CUDA encoders to agree byte for byte (RESULTS §4.1f).
4. **Quality** on ``--eval-texts``, as the matrix measures it (``codec_quality.compare``). Only the
   held-out texts are out of sample: for a tune text the basis, steps and tables were fitted on the
   very KV that is evaluated.

Run: ``python benchmarks/codec_pca.py [--ratio 6,7] [--weights rel,sens] [--v-ratio 1]
[--metric none|model] [--exact-first N] [--layer-group G] [--scope layer|head] [--rounding 0.5,0.3]
[--cal-tokens N] [--rope undo|keep] [--token-classes 1,8] [--outliers 0.005]
[--eval-texts ...] [--levels high,default] [--json PATH]`` (RESULTS §4.1f has the commands run;
minutes per fitted ratio and per text on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import codec_corpus as CC
import codec_head_alloc as HA
import codec_quality as CQ
import codec_rates as CR
import numpy as np
import torch

from lmtier.codec import levels as L
from lmtier.codec.pca import hf as PH
from lmtier.codec.pca import transform as PT

ESCAPE_BITS = 16
SENS_JSON = Path(__file__).resolve().parent / "codec_head_sens.json"


def rope_cos_sin(model: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, D]`` (float64) of the model's rotary embedding at positions ``0 .. T-1``, from
    its inverse frequencies (:func:`lmtier.codec.pca.hf.rotary_inv_freq`) in Hugging Face's
    arithmetic (float32 angles ``position * inv_freq``, float32 cos/sin, widened): the rotation its
    cached keys carry."""
    m, _ = CQ.load_model(torch.float32, model)
    inv_freq = torch.from_numpy(PH.rotary_inv_freq(m)).float()
    ang = torch.arange(tokens, dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().double(), emb.sin().double()


def calibration_kv(name: str, model: str, tokens: int) -> torch.Tensor:
    """bf16 canonical KV ``[L, 2, T, H, D]`` of the first ``tokens`` tokens of matrix text ``name``
    (``T`` = ``tokens``, or the text's length if shorter); :func:`codec_quality.get_text`'s KV when
    ``tokens`` is its context. Cached beside it (safetensors), keyed by (model, text, tokens) only:
    a changed source file or tokenizer needs the cache removed, as for ``get_text``."""
    from safetensors.torch import load_file, save_file

    if tokens <= CC.MATRIX_CONTEXT:
        return CQ.get_text(name, model)["kv_fp32"][:, :, :tokens].to(torch.bfloat16)
    path = CQ.CACHE_DIR / f"{model}.{name}.cal{tokens}.safetensors"
    if not path.exists():
        m, tok = CQ.load_model(torch.float32, model)
        ids = torch.tensor(tok(CC.source_text(CC.source_spec(name))).input_ids[:tokens], dtype=torch.int64)
        with torch.no_grad():
            out = m(ids[None], use_cache=True)
        CQ.CACHE_DIR.mkdir(parents=True, exist_ok=True)
        save_file({"kv": CQ._cache_to_canonical(out.past_key_values).to(torch.bfloat16).contiguous()}, str(path))
    return load_file(path)["kv"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` on keys ``[..., T, H, D]`` (or its inverse: the rotation by -angle)."""
    c, s = cos[:, None, :], sin[:, None, :]
    return k * c - _rotate_half(k) * s if inverse else k * c + _rotate_half(k) * s


class Basis:
    """Mean and PCA basis per (layer group, plane) of the ``N = group * H * D`` vectors of each token
    (``group`` adjacent layers' heads together; ``L`` must be a multiple of it), or with
    ``scope="head"`` per (layer group, KV head, plane) of the ``N = group * D`` vectors of one head in
    ``group`` adjacent layers (no decorrelation across heads: a basis of ``D x D`` per head and layer
    for ``group = 1``, the product-sized GEMM).

    Rows ``R = L / group`` (``scope="layer"``) or ``L / group * H`` (``"head"``, layer group major).
    ``mu`` float64 ``[R, 2, N]``, ``u`` ``[R, 2, N, N]`` (columns = components, by decreasing
    variance), ``var`` ``[R, 2, N]`` (the components' variances), ``rms`` ``[R, 2]`` (the root mean
    variance of the row's layer group: in ``"head"`` scope the same for all heads of a layer group, so
    that ``c * rms`` steps are those of the layer scope), ``clamped`` (KV values a fixed-point
    transform clamped, :class:`codec_pca_int.IntBasis`; None for this float one)."""

    clamped: int | None = None

    def __init__(
        self,
        cal: list[torch.Tensor],
        cos,
        sin,
        undo_rope: bool,
        metric: torch.Tensor | None = None,
        group: int = 1,
        scope: str = "layer",
    ):
        if scope not in ("layer", "head"):
            raise ValueError(f"scope must be 'layer' or 'head', got {scope!r}")
        self.cos, self.sin, self.undo_rope, self.group, self.scope = cos, sin, undo_rope, group, scope
        self.heads = cal[0].shape[3]
        self._coeffs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sqrt_m = self.inv_sqrt_m = None
        if metric is not None:  # x -> x M^(1/2): squared error in that space = e^T M e
            w, v = torch.linalg.eigh(metric)
            w = w.clamp_min(w.amax(-1, keepdim=True) * 1e-8)
            self.sqrt_m = v @ torch.diag_embed(w.sqrt()) @ v.transpose(-1, -2)
            self.inv_sqrt_m = v @ torch.diag_embed(w.rsqrt()) @ v.transpose(-1, -2)
        x = torch.cat([self.vectors(kv) for kv in cal], dim=2)  # [L, 2, T, N]
        self.mu = x.mean(2)
        xc = x - self.mu[:, :, None]
        cov = xc.transpose(2, 3) @ xc / x.shape[2]
        var, u = torch.linalg.eigh(cov)
        self.var, self.u = var.flip(-1).clamp_min(0), u.flip(-1)
        ms = self.var.mean(-1)
        if scope == "head":  # [L/g * H, 2] -> the layer group's mean over its heads, repeated
            ms = ms.reshape(-1, self.heads, 2).mean(1, keepdim=True).expand(-1, self.heads, 2).reshape(-1, 2)
        self.rms = ms.sqrt()

    def vectors(self, kv: torch.Tensor, weighted: bool = True) -> torch.Tensor:
        """bf16 canonical ``[L, 2, T, H, D]`` (positions 0 .. T-1) -> float64 ``[R, 2, T, N]``, in the
        metric's space (``weighted=False``: without the metric)."""
        x = kv.double()
        if self.undo_rope:
            t = x.shape[2]
            x = torch.stack([rope(x[:, 0], self.cos[:t], self.sin[:t], inverse=True), x[:, 1]], 1)
        x = x.flatten(3)
        x = x if self.sqrt_m is None or not weighted else x @ self.sqrt_m
        g = self.group  # [L, 2, T, N] -> [L / g, 2, T, g * N]: g adjacent layers in one vector
        nl, _, t, n = x.shape
        if self.scope == "head":  # [L/g * H, 2, T, g * D]: one head of g adjacent layers in one vector
            h = self.heads
            x = x.reshape(nl // g, g, 2, t, h, n // h).permute(0, 4, 2, 3, 1, 5)
            return x.reshape(nl // g * h, 2, t, g * (n // h))
        return x.reshape(nl // g, g, 2, t, n).permute(0, 2, 3, 1, 4).reshape(nl // g, 2, t, g * n)

    def kv(self, x: torch.Tensor, shape, weighted: bool = True) -> torch.Tensor:
        """Inverse of :meth:`vectors` (of the same ``weighted``), cast to bf16."""
        g, (ng, _, t, gn) = self.group, x.shape
        if self.scope == "head":
            h = self.heads
            x = (
                x.reshape(ng // h, h, 2, t, g, gn // g)
                .permute(0, 4, 2, 3, 1, 5)
                .reshape(ng // h * g, 2, t, h * gn // g)
            )
        else:
            x = x.reshape(ng, 2, t, g, gn // g).permute(0, 3, 1, 2, 4).reshape(ng * g, 2, t, gn // g)
        if self.inv_sqrt_m is not None and weighted:
            x = x @ self.inv_sqrt_m
        x = x.reshape(shape)
        if self.undo_rope:
            t = x.shape[2]
            x = torch.stack([rope(x[:, 0], self.cos[:t], self.sin[:t]), x[:, 1]], 1)
        return x.to(torch.bfloat16)

    def coeffs(self, kv: torch.Tensor) -> torch.Tensor:
        """float64 ``[L, 2, N, T]``: the coordinates of ``kv``'s centred vectors in the basis (kept for
        the tensors given to :meth:`remember`: the secant search of :func:`fit_scheme` quantizes the
        calibration KV many times)."""
        for t, y in self._coeffs:
            if t is kv:
                return y
        return self._transform(kv)

    def remember(self, kvs: list[torch.Tensor]) -> None:
        """Keep the coefficients of ``kvs`` (and the tensors themselves, so identity stays valid)."""
        self._coeffs += [(kv, self._transform(kv)) for kv in kvs if all(t is not kv for t, _ in self._coeffs)]

    def forget(self, kvs: list[torch.Tensor]) -> None:
        """Drop the coefficients :meth:`remember` kept for ``kvs``."""
        self._coeffs = [(t, y) for t, y in self._coeffs if all(t is not kv for kv in kvs)]

    def _transform(self, kv: torch.Tensor) -> torch.Tensor:
        return ((self.vectors(kv) - self.mu[:, :, None]) @ self.u).transpose(2, 3).contiguous()

    def quantize(self, kv: torch.Tensor, step: torch.Tensor, rounding: float = 0.5) -> torch.Tensor:
        """Integer coefficients int64 ``[R, 2, N, T]`` of ``kv`` at ``step`` ``[R, 2]``: half to even
        (``rounding=0.5``), or ``sign(y) * floor(|y| / step + rounding)`` for ``rounding < 0.5`` (a
        dead-zone quantizer: values within ``(1 - rounding) * step`` of 0 become 0, each nonzero one is
        pulled towards 0 by ``(0.5 - rounding) * step``; the rate falls where the coefficients are
        Laplacian-like, as in H.264's encoder rounding offset of 1/6 for inter blocks)."""
        y = self.coeffs(kv) / step[:, :, None, None]
        if rounding == 0.5:
            return torch.round(y).to(torch.int64)
        return (torch.sign(y) * torch.floor(y.abs() + rounding)).to(torch.int64)

    def decode(self, q: torch.Tensor, step: torch.Tensor, shape) -> torch.Tensor:
        """bf16 KV of ``shape`` from :meth:`quantize`'s coefficients."""
        x = (q.transpose(2, 3).double() * step[:, :, None, None]) @ self.u.transpose(2, 3) + self.mu[:, :, None]
        return self.kv(x, shape)


def model_metric(model: str, texts) -> torch.Tensor:
    """float64 ``[L, 2, H*D, H*D]``: the model metric (:func:`lmtier.codec.pca.hf.metric_from`) of
    ``model`` on the contexts of ``texts`` (:func:`codec_quality.get_text`'s ids, the first ``ctx``)."""
    m, _ = CQ.load_model(torch.float32, model)
    ids = []
    for t in texts:
        data = CQ.get_text(t, model)
        ids.append(data["ids"][: data["ctx"]])
    return PH.metric_from(m, ids)


def symbols(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Coefficients ``[L, 2, N, T]`` -> (uint8 streams ``[L*2*N, T]``, escape count).

    Raises:
        ValueError: a coefficient needs more than the :data:`ESCAPE_BITS` raw bits of an escape."""
    if q.numel() and int(q.abs().max()) >= 1 << (ESCAPE_BITS - 1):
        raise ValueError(f"coefficient {int(q.abs().max())} does not fit an escape of {ESCAPE_BITS} bits")
    s, esc = PT.symbols(q)  # the product's symbol rule
    return s.reshape(-1, q.shape[-1]), int(esc.sum())


class PCAScheme:
    """:class:`Basis` at steps ``[R, 2]`` (and :meth:`Basis.quantize`'s ``rounding``) with static
    tables fitted on the tune chunks (all their tokens, the exact ones too).

    Exact tokens (bf16, 16 bits per value, their coefficients not coded): the sequence's first
    ``exact_first``, and with ``outliers = p > 0`` every token whose *outlier score* exceeds the tune
    split's ``1 - p`` quantile of it. The score of a token is the largest, over (layer group, plane),
    of its centred vector's squared norm in the basis's space over the tune split's median of that
    norm: a property of the token measured at encode time, so the number of exact tokens varies
    with the data (a chunk of loud tokens keeps more of them)."""

    def __init__(
        self,
        basis: Basis,
        step: torch.Tensor,
        cal: list[torch.Tensor],
        exact_first: int = 0,
        rounding: float = 0.5,
        classes: int = 0,
        outliers: float = 0.0,
    ):
        if not 0 <= outliers < 1:
            raise ValueError(f"outliers must be in [0, 1), got {outliers}")
        self.basis, self.step, self.exact_first, self.rounding = basis, step, exact_first, rounding
        self.threshold = None
        if outliers:
            e = torch.cat([self._energy(kv)[..., exact_first:] for kv in cal], -1)  # [R, 2, T]
            self.median = e.median(-1).values.clamp_min(1e-30)
            score = (e / self.median[..., None]).amax((0, 1))
            self.threshold = float(torch.quantile(score, 1 - outliers))
        qs = [self._quantize(kv) for kv in cal]
        streams = [symbols(q)[0] for q in qs for q in self._chunks(q)]
        self.model = CR.StaticCoderModel(streams, torch.ones(streams[0].shape[0], 256, dtype=torch.bool))
        self._counts = CR.stream_counts(streams)
        self._tables = None
        self.classes = None
        if classes:
            from codec_pca_classes import ClassCoder

            self.classes = ClassCoder([q[..., ~self.exact_tokens(kv)] for q, kv in zip(qs, cal)], classes)

    def _quantize(self, kv: torch.Tensor) -> torch.Tensor:
        return self.basis.quantize(kv, self.step, self.rounding)

    def _energy(self, kv: torch.Tensor) -> torch.Tensor:
        return self.basis.coeffs(kv).pow(2).sum(2)  # [R, 2, T]

    def exact_tokens(self, kv: torch.Tensor) -> torch.Tensor:
        """bool ``[T]``: the tokens of a bf16 context ``kv`` kept exact."""
        t = kv.shape[2]
        mask = torch.arange(t) < self.exact_first
        if self.threshold is not None:
            mask |= (self._energy(kv) / self.median[..., None]).amax((0, 1)) > self.threshold
        return mask

    def record_bytes(self, kv: torch.Tensor) -> int:
        """Bytes of real rANS streams (:func:`lmtier.codec.rans.encode`, the product's coder) for a bf16
        context ``kv``: per chunk one stream per (layer group, plane) of its components' symbols back to
        back, switching to the component's static table every 256 symbols (the product's table
        switching), tables normalized from the tune chunks' counts over all 256 symbols; plus 2 bytes per
        escape and the exact tokens raw. The exact tokens' symbols are coded as well (a small
        overcount); record headers are not counted."""
        from lmtier.codec import rans

        if self.classes is not None:
            raise ValueError("real bytes of the class coder are not counted: the product's rANS switches per run")
        if self._tables is None:
            self._tables = np.stack([rans.build_table(c.numpy(), alphabet_size=256) for c in self._counts])
        q = self._quantize(kv)
        groups = q.shape[0] * 2
        n = q.shape[2]
        total = 2 * kv[:, :, self.exact_tokens(kv)].numel()
        for c in self._chunks(q):
            sym, esc = symbols(c)
            t = sym.shape[-1]
            per = sym.reshape(groups, n * t).numpy()
            batch = rans.encode(list(per), table_ids=np.arange(groups) * n, tables=self._tables, run_lens=t)
            total += batch.nbytes + 2 * esc
        return total

    @staticmethod
    def _chunks(q: torch.Tensor) -> list[torch.Tensor]:
        return [q[..., i : i + CR.CHUNK_TOKENS] for i in range(0, q.shape[-1], CR.CHUNK_TOKENS)]

    def bits(self, kv: torch.Tensor) -> tuple[float, int]:
        """(bits, escapes) of a bf16 context ``kv`` (quantizing the context at once equals quantizing
        its chunks: no per-chunk state); the exact tokens at 16 bits per value."""
        return self._bits(self._quantize(kv), kv, self.exact_tokens(kv))

    def _bits(self, q: torch.Tensor, kv: torch.Tensor, exact: torch.Tensor) -> tuple[float, int]:
        bits, esc = 16.0 * kv[:, :, exact].numel(), 0
        if self.classes is not None:  # static tables per energy class (codec_pca_classes), no chunk state
            esc = symbols(q[..., ~exact])[1]
            return bits + self.classes.bits(q[..., ~exact]) + ESCAPE_BITS * esc, esc
        for c, keep in zip(self._chunks(q), self._chunks(~exact)):
            if bool(keep.any()):
                s, e = symbols(c[..., keep])
                bits += self.model.bits(s)[0] + ESCAPE_BITS * e
                esc += e
        return bits, esc

    def run(self, kv: torch.Tensor) -> tuple[float, torch.Tensor, int]:
        """(ratio bound, decoded bf16 KV, escapes) of a bf16 context ``kv``."""
        q, exact = self._quantize(kv), self.exact_tokens(kv)
        bits, esc = self._bits(q, kv, exact)
        dec = self.basis.decode(q, self.step, kv.shape)
        dec[:, :, exact] = kv[:, :, exact]
        return kv.numel() * 16 / bits, dec, esc


def sens_weights(level: L.Level, cal: list[torch.Tensor], texts, basis: Basis) -> torch.Tensor:
    """KL per unit squared error of each (layer, plane) at ``level`` (float64 ``[L, 2]``): the measured
    per-group KL of ``codec_head_sens.json`` summed over heads and averaged over ``texts``, over the
    level's mean squared error per element on the same texts' KV (in ``basis``' space: RoPE undone,
    metric applied)."""
    sens = json.loads(SENS_JSON.read_text())
    kl = torch.tensor([sens[t]["kl"] for t in texts], dtype=torch.float64).clamp_min(0).mean(0).sum(-1)
    mse = torch.stack(
        [(basis.vectors(CQ.decode_level(level, kv)) - basis.vectors(kv)).pow(2).mean((2, 3)) for kv in cal]
    ).mean(0)
    return kl / mse


def fit_scheme(
    basis: Basis,
    shape: torch.Tensor,
    cal: list[torch.Tensor],
    ratio: float,
    exact_first: int = 0,
    rounding: float = 0.5,
    classes: int = 0,
    outliers: float = 0.0,
) -> tuple[PCAScheme, float]:
    """``(scheme, c)``: the scheme with steps ``c * shape`` whose tune-split ratio is ``ratio`` within
    0.5 %, by secant steps on (log2 c, bits per value), which is near linear (each active component's
    rate falls by one bit per doubling of the step).

    Raises:
        RuntimeError: no such ``c`` within 12 steps."""
    values = sum(kv.numel() for kv in cal)
    target = 16.0 / ratio

    def rate(c):
        try:
            s = PCAScheme(basis, c * shape, cal, exact_first, rounding, classes, outliers)
        except ValueError:  # steps so fine that a coefficient overflows an escape
            return None, float("inf")
        return s, sum(s.bits(kv)[0] for kv in cal) / values

    x0, (s, b0) = 0.0, rate(1.0)
    while b0 == float("inf"):
        x0 += 4.0
        s, b0 = rate(2.0**x0)
    x1 = x0 + (b0 - target) / 2.0  # first guess: a slope of -2 bits per doubling
    for _ in range(12):
        s, b1 = rate(2.0**x1)
        if b1 == float("inf"):
            x1 = (x0 + x1) / 2 if x1 < x0 else x1 + 4.0
            continue
        if abs(b1 / target - 1) < 0.005:
            return s, 2.0**x1
        slope = (b1 - b0) / (x1 - x0) if x1 != x0 and b1 != b0 else -0.5
        x0, b0, x1 = x1, b1, x1 + (target - b1) / min(slope, -0.05)
    raise RuntimeError(f"no step reaches {ratio}x on the tune split within 0.5 % (last: {16.0 / b0:.3f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ratio", default="6", help="target ratios on the tune split (comma list)")
    ap.add_argument("--weights", default="rel,sens", help="step shapes: rel (c * rms), sens (measured KL weights)")
    ap.add_argument("--v-ratio", type=float, default=1.0, help="rel: V's step / K's step (relative to rms)")
    ap.add_argument("--exact-first", type=int, default=0, help="first tokens of the sequence kept exact")
    ap.add_argument("--cal-tokens", type=int, default=1024, help="tokens of each tune text for the basis and tables")
    ap.add_argument("--layer-group", type=int, default=1, help="adjacent layers per PCA basis (divides L)")
    ap.add_argument("--metric", choices=("none", "model"), default="none", help="error metric of the basis")
    ap.add_argument("--scope", choices=("layer", "head"), default="layer", help="basis over all heads or per KV head")
    ap.add_argument(
        "--int-gemm", type=int, default=0, help="KV fixed-point bits of an integer transform (codec_pca_int; 0: float)"
    )
    ap.add_argument("--int-matrix-bits", default="8", help="--int-gemm: bits of the encode[,decode] matrices (2..16)")
    ap.add_argument("--rounding", default="0.5", help="quantizer rounding offsets (comma list, 0 < r <= 0.5)")
    ap.add_argument("--rope", choices=("undo", "keep"), default="undo")
    ap.add_argument(
        "--outliers", default="0", help="share of tune tokens above the outlier score kept exact (comma list)"
    )
    ap.add_argument(
        "--token-classes", default="0", help="energy classes per token of the rate model (comma list; 0: one table)"
    )
    ap.add_argument("--tune-texts", default=",".join(HA.TUNE))
    ap.add_argument("--eval-texts", default=",".join(HA.HELD))
    ap.add_argument("--levels", default="default", help="product levels evaluated beside (ratio bound)")
    ap.add_argument(
        "--records", action="store_true", help="also count real rANS bytes of the PCA schemes (ratio_records)"
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        ratios = [float(r) for r in a.ratio.split(",")]
        roundings = [float(r) for r in a.rounding.split(",")]
        mbits = [int(b) for b in a.int_matrix_bits.split(",")]
        classes = [int(k) for k in a.token_classes.split(",")]
        outliers = [float(p) for p in a.outliers.split(",")]
        levels = [L.get_level(n) for n in a.levels.split(",") if n]
    except ValueError as e:
        ap.error(str(e))
    weights = a.weights.split(",")
    if bad := [w for w in weights if w not in ("rel", "sens")]:
        ap.error(f"unknown --weights {bad}: use rel, sens")
    if "sens" in weights and not SENS_JSON.exists():
        ap.error(f"--weights sens needs {SENS_JSON}")
    unknown = [t for t in (*a.tune_texts.split(","), *a.eval_texts.split(",")) if t not in CC.MATRIX_TEXTS]
    if unknown:
        ap.error(f"unknown texts {unknown}: use {', '.join(CC.MATRIX_TEXTS)}")
    if any(not 0 < r <= 0.5 for r in roundings):
        ap.error(f"--rounding offsets must be in (0, 0.5], got {a.rounding}")
    if a.int_gemm and (not 2 <= a.int_gemm <= 24 or a.scope != "layer"):
        ap.error(f"--int-gemm {a.int_gemm} must be in 2..24 (0: off), with --scope layer")
    if not 1 <= len(mbits) <= 2 or not all(2 <= b <= 16 for b in mbits):
        ap.error(f"--int-matrix-bits must be one or two widths in 2..16, got {a.int_matrix_bits}")
    if any(k < 0 for k in classes) or (a.records and any(classes)):
        ap.error(f"--token-classes must be >= 0 (0: off), and 0 with --records, got {a.token_classes}")
    if any(not 0 <= p < 1 for p in outliers):
        ap.error(f"--outliers shares must be in [0, 1), got {a.outliers}")
    if a.cal_tokens < 1:
        ap.error(f"--cal-tokens must be >= 1, got {a.cal_tokens}")
    if a.layer_group < 1 or ("sens" in weights and a.layer_group != 1):
        ap.error(f"--layer-group {a.layer_group} must be >= 1 (and 1 with --weights sens)")
    tune = a.tune_texts.split(",")
    t0 = time.time()
    cal = [calibration_kv(t, a.model, a.cal_tokens) for t in tune]
    if cal[0].shape[0] % a.layer_group:  # before the metric's forward passes and the basis
        ap.error(f"--layer-group {a.layer_group} must divide {cal[0].shape[0]} layers")
    tokens = max(kv.shape[2] for kv in cal)
    cos, sin = rope_cos_sin(a.model, max(tokens, CC.MATRIX_CONTEXT))
    metric = model_metric(a.model, tune) if a.metric == "model" else None
    if a.int_gemm:
        from codec_pca_int import IntBasis

        basis = IntBasis(
            cal, cos, sin, a.rope == "undo", metric, a.layer_group, x_bits=a.int_gemm, m_bits=mbits[0], d_bits=mbits[-1]
        )
    else:
        basis = Basis(cal, cos, sin, a.rope == "undo", metric, a.layer_group, a.scope)
    basis.remember(cal)
    ev = basis.var / basis.var.sum(-1, keepdim=True)
    gain = basis.var.mean(-1) / basis.var.clamp_min(1e-30).log().mean(-1).exp()  # AM / GM
    top = ev[..., : ev.shape[-1] // 10].sum(-1).mean(0)  # [2]: K, V
    print(
        f"basis ({time.time() - t0:.0f} s): energy in the top 10 % of components K {float(top[0]):.3f} "
        f"V {float(top[1]):.3f}; coding gain AM/GM (median over layers) K {float(gain[:, 0].median()):.1f} "
        f"V {float(gain[:, 1].median()):.1f}",
        flush=True,
    )
    shapes = {}
    if "rel" in weights:
        shapes["pca-rel"] = basis.rms * torch.tensor([1.0, a.v_ratio], dtype=torch.float64)
    if "sens" in weights:
        sh = sens_weights(L.get_level("default"), cal, tune, basis).rsqrt()
        shapes["pca-sens"] = sh * (basis.rms.log().mean() - sh.log().mean()).exp()  # same geometric mean as rms
    schemes = {}
    for r in ratios:
        for name, sh in shapes.items():
            for rd in roundings:
                for k in classes:
                    for p in outliers:
                        label = f"{name} {r:g}x" + (f" r{rd:g}" if rd != 0.5 else "") + (f" k{k}" if k else "")
                        label += f" o{p:g}" if p else ""
                        s, c = fit_scheme(basis, sh, cal, r, a.exact_first, rd, k, p)
                        schemes[label] = s
                        print(f"fitted {label} on the tune split: c = {c:.4g} ({time.time() - t0:.0f} s)", flush=True)
    nl, h = cal[0].shape[0], cal[0].shape[3]
    level_schemes = {
        lv.name: HA.Scheme(HA.level_qmax(lv, nl, h), [c for kv in cal for c in CR.chunk_views(kv)]) for lv in levels
    }
    cells = []
    for t in a.eval_texts.split(","):
        data, kv, ref, ids = HA.reference(t, a.model)
        basis.remember([kv])  # transformed once for every scheme, its decode and its real bytes
        runs = [(n, *s.run(kv), None) for n, s in level_schemes.items()]  # (name, ratio, decode, escapes)
        records, exact = {}, {}
        for name, s in schemes.items():
            ratio, dec, esc = s.run(kv)
            runs.append((name, ratio, dec, esc))
            exact[name] = int(s.exact_tokens(kv).sum())
            if a.records:
                records[name] = kv.numel() * 2 / s.record_bytes(kv)
        basis.forget([kv])
        for name, ratio, dec, esc in runs:
            m = CQ.compare(ref, CQ.continuation_logprobs(data, dec.float()), ids)
            rel = float((dec.float() - kv.float()).norm() / kv.float().norm())
            cells.append(
                dict(
                    text=t,
                    scheme=name,
                    exact_tokens=exact.get(name),
                    ratio_bound=ratio,
                    ratio_records=records.get(name),
                    rel_err=rel,
                    escapes=esc,
                    **m,
                )
            )
            rec = f" records {records[name]:5.2f}x" if name in records else ""
            rec += f" exact {exact[name]}" if name in exact else ""
            print(
                f"{t:<12s} {name:<16s} ratio(bound) {ratio:5.2f}x{rec} dppl {m['dppl_pct']:+6.2f}% "
                f"top1 {m['top1']:6.2f}% KL {m['kl']:.5f} rel.err {rel:.4f}",
                flush=True,
            )
    if a.json:
        a.json.write_text(
            json.dumps(
                dict(
                    model=a.model,
                    metric=a.metric,
                    rope=a.rope,
                    v_ratio=a.v_ratio,
                    exact_first=a.exact_first,
                    layer_group=a.layer_group,
                    scope=a.scope,
                    int_gemm=a.int_gemm,
                    int_matrix_bits=mbits if a.int_gemm else None,
                    token_classes=classes,
                    outliers=outliers,
                    clamped=basis.clamped,
                    cal_tokens=[int(kv.shape[2]) for kv in cal],
                    tune=tune,
                    cells=cells,
                    seconds=time.time() - t0,
                ),
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
