"""``python -m lmtier.codec.pca``: calibrate a PCA model file for a local Hugging Face checkpoint.

``python -m lmtier.codec.pca --model DIR --text-file F [--text-file F2 ...] --out FILE
[--layer-group G] [--max-tokens 4096] [--outlier-share 0.002] [--no-metric] [--tensor-parallel-size TP]``

Each text file (UTF-8) is one calibration text, cut to its first ``--max-tokens`` tokens;
:func:`.hf.collect` runs the model on them (CPU), :func:`.fit.fit` fits every PCA level (positions
from 0, the model metric unless ``--no-metric``) and :func:`.model.save` writes the model file.
Printed: one line per level (its relative step ``c``, :mod:`.levels`, and the ideal ratio at which
the calibration KV codes under it), then the model id and the file's size. The covariance of
``N = G * H * D`` values per vector needs several times ``N`` tokens in all: a few thousand tokens
of varied text; fewer than ``2 * N`` (:data:`MIN_TOKENS_PER_VALUE`) is an error before the fit. ``N`` is at most
:data:`.model.MAX_VECTOR_SIZE` (8192): ``--layer-group`` must divide the model's layers and keep
``G * H * D`` within it, and defaults to the divisor whose ``G * H * D`` is nearest 1,152, ties to
the smaller (:func:`default_layer_group`). The layers ``L``, KV heads ``H`` and head size ``D`` are read
from the checkpoint's ``config.json`` before the model is loaded (:func:`.hf.checkpoint_geometry`)
and checked again on the KV the model produced.

``--tensor-parallel-size TP`` (for ``vllm serve --tensor-parallel-size TP``): each rank holds a slice of
the KV heads (:func:`.ranks.rank_heads`), so each slice gets its own model, fitted on that slice of the
same calibration KV (its ``H`` the slice's, the layer group chosen for it); the file holds them all
(:mod:`.ranks`) and each rank's tier reads its own. Printed per slice.

Exit status: 0 written; 2 a usage error (checked before the model is loaded where the arguments and
``config.json`` tell: a missing ``--model`` or ``config.json``, a ``--layer-group`` that does not
divide ``L`` or exceeds the limit, a ``--tensor-parallel-size`` the KV heads do not split over); 1 the
calibration or the fit failed, fewer than ``2 * N``
calibration tokens, or the model's ``H * D`` is too large for the PCA levels even at ``G = 1`` (one
line ``lmtier.codec.pca: error: ...``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import hf
from .fit import fit
from .model import MAX_VECTOR_SIZE, PCAModel, save
from .ranks import RankModels, rank_heads, save_ranks

__all__ = ["DEFAULT_VECTOR_SIZE", "MIN_TOKENS_PER_VALUE", "default_layer_group", "main"]

PROG = "python -m lmtier.codec.pca"
DEFAULT_VECTOR_SIZE = 1152
"""The vector size ``N = G * H * D`` the default layer group aims at. ``N`` sets both what a basis can
capture (on SmolLM2, ``H * D = 192``, larger groups kept helping up to about 6 layers: ``N = 1,152``;
``benchmarks/codec_pca.py``, RESULTS §4.1g) and the transform's cost (its integer GEMMs do ``N``
multiply-adds per value, 4 byte products each on the encoder). The levels' quality was measured at
``N`` = 1,152 and 1,344 (RESULTS §4.1l); an 8B-class model (``H * D = 1,024``) gets ``G = 1``."""
MIN_TOKENS_PER_VALUE = 2
"""Calibration tokens needed per value of a vector: fewer than ``2 * N`` tokens is an error before the
fit (below it the basis fits the calibration tokens themselves rather than the KV to come)."""


def _divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


def _layer_groups(num_layers: int, layer_values: int) -> list[int]:
    """The divisors ``G`` of ``num_layers`` whose vectors of ``N = G * layer_values`` values fit
    :data:`.model.MAX_VECTOR_SIZE` (``layer_values = H * D``)."""
    return [g for g in _divisors(num_layers) if g * layer_values <= MAX_VECTOR_SIZE]


def default_layer_group(num_layers: int, *, num_kv_heads: int, head_size: int) -> int:
    """Among the divisors ``G`` of ``num_layers`` with ``N = G * num_kv_heads * head_size <=``
    :data:`.model.MAX_VECTOR_SIZE`, the one whose ``N`` is nearest :data:`DEFAULT_VECTOR_SIZE` (ties:
    the smaller ``G``): at ``H * D = 192`` 30 layers -> 6, 32 -> 4, 28 -> 7, 22 -> 2; at ``H * D >=
    1,024`` (8B-class models) 1.

    Raises:
        CalibrationError: ``num_kv_heads * head_size`` exceeds the limit (no ``G`` fits).
    """
    hd = num_kv_heads * head_size
    groups = _layer_groups(num_layers, hd)
    if not groups:
        raise hf.CalibrationError(
            f"the model's H*D = {num_kv_heads}*{head_size} = {hd} values per layer are too large for the PCA "
            f"levels: a vector holds N = G*H*D <= {MAX_VECTOR_SIZE} values, exceeded even at G = 1"
        )
    return min(groups, key=lambda g: (abs(g * hd - DEFAULT_VECTOR_SIZE), g))


def _layer_group(ap: argparse.ArgumentParser, requested: int | None, num_layers: int, h: int, d: int) -> int:
    """``--layer-group`` (``requested``, ``None`` = the default) checked for ``num_layers`` layers of
    ``h`` KV heads of size ``d``: a usage error (exit 2) if it does not divide the layers or
    ``G*H*D`` exceeds the limit; :class:`.hf.CalibrationError` if no ``G`` fits."""
    default = default_layer_group(num_layers, num_kv_heads=h, head_size=d)
    if requested is None:
        return default
    groups = _layer_groups(num_layers, h * d)
    if num_layers % requested:
        ap.error(f"--layer-group {requested} does not divide the model's {num_layers} layers; use one of {groups}")
    if requested * h * d > MAX_VECTOR_SIZE:
        ap.error(
            f"--layer-group {requested}: N = G*H*D = {requested}*{h}*{d} = {requested * h * d} values per vector "
            f"exceed the limit of {MAX_VECTOR_SIZE}; the largest allowed layer group is {max(groups)}"
        )
    return requested


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    path = dict(required=True, type=Path)
    ap.add_argument("--model", **path, metavar="DIR", help="checkpoint directory (transformers, local files)")
    ap.add_argument("--text-file", **path, action="append", metavar="F", help="a UTF-8 calibration text (repeatable)")
    ap.add_argument("--out", **path, metavar="FILE", help="the model file to write (replaced if it exists)")
    g_help = (
        f"adjacent layers per basis, a divisor of the layers with G*H*D <= {MAX_VECTOR_SIZE} "
        f"(default: the one with G*H*D nearest {DEFAULT_VECTOR_SIZE})"
    )
    ap.add_argument("--layer-group", type=int, metavar="G", help=g_help)
    ap.add_argument("--max-tokens", type=int, default=4096, metavar="T", help="tokens of each text (%(default)s)")
    s_help = "share of tokens kept exact, in [0, 1) (%(default)s)"
    ap.add_argument("--outlier-share", type=float, default=0.002, metavar="S", help=s_help)
    ap.add_argument("--no-metric", action="store_true", help="plain squared error instead of the model metric")
    tp_help = "the vLLM tensor_parallel_size to serve with: one model per rank's KV heads (%(default)s)"
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="TP", help=tp_help)
    return ap


def _slices(ap: argparse.ArgumentParser, num_kv_heads: int, tp: int) -> list[tuple[int, int]]:
    """The distinct slices of KV heads the ``tp`` ranks hold, in head order, each of the same number
    of heads (a usage error if vLLM cannot split ``num_kv_heads`` over ``tp``)."""
    try:
        return sorted({rank_heads(num_kv_heads, tp, r) for r in range(tp)})
    except ValueError as e:
        ap.error(f"--tensor-parallel-size {tp}: {e}")


def _read_texts(ap: argparse.ArgumentParser, files: list[Path]) -> list[str]:
    texts = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            ap.error(f"--text-file {f}: not UTF-8 ({e.reason} at byte {e.start})")
        except OSError as e:
            ap.error(f"--text-file {f}: cannot read it ({e.strerror or e})")
        if not text.strip():
            ap.error(f"--text-file {f} is empty")
        texts.append(text)
    return texts


def _fail(why: object) -> int:
    print(f"lmtier.codec.pca: error: {why}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default ``sys.argv[1:]``); returns the exit status (argparse
    exits with 2 itself on a usage error)."""
    ap = _parser()
    a = ap.parse_args(argv)
    out_dir = a.out.parent
    if a.out.is_dir():
        ap.error(f"--out {a.out} is a directory; name the model file to write")
    if not out_dir.is_dir():
        ap.error(f"--out {a.out}: directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        ap.error(f"--out {a.out}: directory {out_dir} is not writable")
    if a.max_tokens < 2:
        ap.error(f"--max-tokens must be >= 2, got {a.max_tokens}")
    if not 0 <= a.outlier_share < 1:
        ap.error(f"--outlier-share must be in [0, 1), got {a.outlier_share}")
    if a.layer_group is not None and a.layer_group < 1:
        ap.error(f"--layer-group must be >= 1, got {a.layer_group}")
    if a.tensor_parallel_size < 1:
        ap.error(f"--tensor-parallel-size must be >= 1, got {a.tensor_parallel_size}")
    if not a.model.is_dir():
        ap.error(f"--model {a.model}: " + ("not a directory" if a.model.exists() else "no such directory"))
    if not (a.model / "config.json").is_file():
        ap.error(f"--model {a.model} holds no config.json: not a transformers checkpoint")
    texts = _read_texts(ap, a.text_file)
    geometry = hf.checkpoint_geometry(a.model)
    tp = a.tensor_parallel_size
    try:
        if geometry is not None:  # config.json's word: the split's and layer group's errors before the model run
            nl, h, d = geometry
            h0, h1 = _slices(ap, h, tp)[0]
            _layer_group(ap, a.layer_group, nl, h1 - h0, d)
        cal = hf.collect(a.model, texts, max_tokens=a.max_tokens)
        nl, _, _, h, d = cal.kv[0].shape  # the KV's geometry is the one of record
        slices = _slices(ap, h, tp)
        hs = slices[0][1] - slices[0][0]  # the KV heads of each slice
        g = _layer_group(ap, a.layer_group, nl, hs, d)
    except hf.CalibrationError as e:
        return _fail(e)
    tokens, n = sum(kv.shape[2] for kv in cal.kv), g * hs * d
    if tokens < MIN_TOKENS_PER_VALUE * n:
        cut = any(kv.shape[2] == a.max_tokens for kv in cal.kv)
        remedies = ["more or longer texts"] + ["a larger --max-tokens"] * cut + ["a smaller --layer-group"] * (g > 1)
        return _fail(
            f"{tokens} calibration tokens collected ({len(texts)} texts, --max-tokens {a.max_tokens}) for "
            f"N = G*H*D = {g}*{hs}*{d} = {n} values per vector; at least {MIN_TOKENS_PER_VALUE}*N = "
            f"{MIN_TOKENS_PER_VALUE * n} are needed ({', '.join(remedies)})"
        )
    metric = "none" if a.no_metric else "model"
    models: list[PCAModel] = []
    try:
        for h0, h1 in slices:
            info = dict(texts=[f.name for f in a.text_file], max_tokens=a.max_tokens, metric=metric)
            if tp > 1:
                info.update(tensor_parallel_size=tp, kv_heads=[h0, h1], num_kv_heads=h)
            models.append(
                fit(
                    [kv[:, :, :, h0:h1].contiguous() for kv in cal.kv] if tp > 1 else cal.kv,
                    [0] * len(cal.kv),
                    inv_freq=cal.inv_freq,
                    layer_group=g,
                    metric=None if a.no_metric else cal.metric[:, :, h0 * d : h1 * d, h0 * d : h1 * d],
                    outlier_share=a.outlier_share,
                    name=a.model.resolve().name,
                    info=info,
                )
            )
        ids = save_ranks(RankModels(tp, h, tuple(models)), a.out) if tp > 1 else [save(models[0], a.out)]
    except RuntimeError as e:  # fit's
        return _fail(e)
    except ValueError as e:  # fit's (PCAModelError is a ValueError too)
        return _fail(e)
    except OSError as e:
        return _fail(f"cannot write {a.out}: {e.strerror or e}")
    for (h0, h1), m, model_id in zip(slices, models, ids, strict=True):
        who = f"KV heads {h0}-{h1 - 1}: " if tp > 1 else ""
        for name, lv in m.levels.items():
            print(f"{who}{name:<12s} c {lv.c:.6g}  calibration ratio {m.info['calibration_ratios'][name]:.3f}x")
        if tp > 1:
            print(f"{who}model id {model_id:#010x} (G={m.layer_group}, N={m.vector_size})")
    m, size = models[0], a.out.stat().st_size
    what = f"model id {ids[0]:#010x}: {a.out} ({size} bytes; {m.name}, G={m.layer_group}, N={m.vector_size}"
    if tp > 1:
        what = f"{a.out} ({size} bytes; {m.name}, tensor_parallel_size {tp}: {len(models)} models"
    print(f"{what}, {tokens} tokens of {len(texts)} texts, metric {metric})")
    return 0
