"""The PCA model file of ``lmtier bench ttft``'s PCA codec tiers (``--codec-levels pca_high,pca_default``).

The PCA levels code with per-model data, the file a user names with ``codec_pca_model``
(docs/codec.md "PCA levels"). This module decides which file the bench's PCA tiers get, before any
tier is built and before any timed run:

* ``--codec-pca-model FILE``: that file, handed to the configuration as a user writes it. A file that
  does not load, lacks the level or was calibrated for another ``(L, H, D)`` is refused by the product
  when the tier is built (``ConfigError`` naming ``codec_pca_model``): that tier is skipped, the
  reason printed.
* none given: a file **fitted here, untimed**, as ``python -m lmtier.codec.pca --no-metric`` fits one,
  on KV the bench never stores: the prefill KV (same model) of other random token ids (seed
  :data:`lmtier.bench.ttft.tables.CALIB_SEED`, the CacheGen tables' calibration prompt, not the
  measured prompt), :func:`fit_tokens` of them — ``--codec-pca-fit-tokens``, default
  :data:`FIT_TOKENS_PER_VALUE` ``* N`` rounded up to whole chunks (``N = G * H * D``, ``G`` the
  command's default layer group :func:`lmtier.codec.pca.calibrate.default_layer_group`), at positions
  from 0 — by :func:`lmtier.codec.pca.fit`, keys with RoPE undone at the model's rotary frequencies
  (:func:`lmtier.codec.pca.hf.rotary_inv_freq`; RoPE kept when the model's rotary embedding is not
  one the codec takes), no metric. It is written to a temporary directory the caller removes. The
  stored chunks are unseen by the fit, as a user's are by their calibration file (ratio and quality
  are the codec benchmarks' job; here the ratio scales the bytes each load reads).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

__all__ = ["FIT_TOKENS_PER_VALUE", "fit_tokens", "pca_model_file"]


FIT_TOKENS_PER_VALUE = 16
"""Calibration tokens per value of a vector in the bench's fit (``--codec-pca-fit-tokens`` default).
The calibrate command refuses fewer than ``MIN_TOKENS_PER_VALUE`` (2); the shipped SmolLM2 files are
fitted on ~40 per value (45,000-49,000 tokens at ``N`` = 1,152, RESULTS §4.1k). Near the floor the
basis fits its own tokens and codes unseen ones at a lower ratio (a small random model, held-out
chunks: 3.0x at 2 per value, 3.9x at 8, 4.4x at 24; RESULTS §4.1u)."""


def fit_tokens(geometry: tuple[int, int, int], chunk_tokens: int, per_value: int = FIT_TOKENS_PER_VALUE) -> int:
    """Tokens the bench fits a PCA model on by default: ``per_value * N`` (``N = G * H * D`` with the
    calibrate command's default ``G``) rounded up to whole chunks of ``chunk_tokens``.

    Raises:
        lmtier.codec.pca.hf.CalibrationError: no layer group fits ``H * D`` (a vector would exceed
            :data:`lmtier.codec.pca.model.MAX_VECTOR_SIZE` even at ``G = 1``).
    """
    from lmtier.codec.pca.calibrate import default_layer_group

    nl, h, d = geometry
    g = default_layer_group(nl, num_kv_heads=h, head_size=d)
    return -(-per_value * g * h * d // chunk_tokens) * chunk_tokens


def _describe(model, path: str | None) -> dict:
    """The JSON facts of a loaded :class:`lmtier.codec.pca.PCAModel`."""
    return {
        "path": path,
        "name": model.name,
        "model_id": f"{model.model_id:#010x}",
        "geometry": [model.num_layers, model.num_heads, model.head_size],
        "layer_group": model.layer_group,
        "vector_size": model.vector_size,
        "levels": {nm: float(lv.c) for nm, lv in model.levels.items()},
        "calibration_ratios": model.info.get("calibration_ratios"),
        "rope": "undone" if model.inv_freq is not None else "kept",
    }


def pca_model_file(
    levels: list[str],
    *,
    given: str | None,
    geometry: tuple[int, int, int],
    kv_dtype: str,
    chunk_tokens: int,
    tokens: int | None,
    max_tokens: int | None,
    vocab_size: int,
    device: torch.device,
    prefix_kv: Callable[[torch.Tensor, int], torch.Tensor],
    hf_model,
    model_name: str,
    out_dir: str,
    say: Callable[[str], None],
) -> tuple[str | None, dict | None]:
    """``(codec_pca_model path, info)`` for the PCA levels among ``levels`` (see the module doc);
    ``(None, None)`` when there is none. A path of None with an info: no file could be had (the
    reason is ``info["error"]``, printed): the PCA tiers are skipped.

    Args:
        given: ``--codec-pca-model`` (None: fit one).
        geometry: ``(L, H, D)`` of the model's KV; ``kv_dtype``: its namespace dtype name.
        chunk_tokens: ``T``; tokens: the calibration prompt's tokens (``--codec-pca-fit-tokens``;
            None: :func:`fit_tokens`), cut to whole chunks within ``max_tokens`` (the model's
            positions; None: no limit); vocab_size: the model's (the prompt's random token ids);
            device: the model's.
        prefix_kv: ``prefix_kv(ids, n)`` -> the canonical prefill KV ``[L, 2, n, H, D]`` (the
            bench's :func:`lmtier.bench.ttft.model.prefix_kv`, what it stores).
        hf_model: the bench's transformers model (its rotary frequencies).
        model_name: named in the fitted file and the output.
        out_dir: where a fitted file is written (the caller removes it; unused with ``given``).
    """
    from lmtier.codec import pca
    from lmtier.codec.pca import hf
    from lmtier.tiers.record_tier import CODEC_KV_DTYPES

    wanted = [lv for lv in levels if lv in pca.PCA_LEVELS]
    if not wanted:
        return None, None
    if given is not None:
        info: dict = {"source": "given", "what": f"given: {given}"}
        try:
            info.update(_describe(pca.load(given), given))
        except (OSError, ValueError) as e:  # the tiers are refused with the product's message
            info.update(path=given, error=f"{type(e).__name__}: {e}")
        say(
            f"PCA model (codec_pca_model): {given}"
            + (
                f" ({info['name']!r}, id {info['model_id']}, G={info['layer_group']}, levels "
                f"{', '.join(info['levels'])})"
                if "error" not in info
                else f" — does not load ({info['error']})"
            )
        )
        return given, info

    info = {"source": "fitted"}

    def skip(why: str) -> tuple[None, dict]:
        info["error"] = why
        say(f"PCA model: none — {why}; the {', '.join(wanted)} tiers are skipped")
        return None, info

    if kv_dtype not in CODEC_KV_DTYPES:
        return skip(f"the PCA levels code {'/'.join(CODEC_KV_DTYPES)} KV, this run's is {kv_dtype}")
    nl, h, d = geometry
    try:
        default = fit_tokens(geometry, chunk_tokens)  # a geometry no layer group fits is refused here
    except hf.CalibrationError as e:
        return skip(str(e))
    from lmtier.bench.ttft.tables import CALIB_SEED
    from lmtier.codec.pca.calibrate import MIN_TOKENS_PER_VALUE, default_layer_group

    g = default_layer_group(nl, num_kv_heads=h, head_size=d)
    tokens = tokens or default
    n = min(tokens, max_tokens or tokens) // chunk_tokens * chunk_tokens
    if n < MIN_TOKENS_PER_VALUE * g * h * d:
        return skip(
            f"a fit needs at least {MIN_TOKENS_PER_VALUE} x N = {MIN_TOKENS_PER_VALUE * g * h * d} tokens (N = G*H*D "
            f"= {g}*{h}*{d} values per vector), this one would have {n} (--codec-pca-fit-tokens {tokens} in whole "
            f"chunks of {chunk_tokens}{f', the model has {max_tokens} positions' if max_tokens else ''}); "
            "pass more or --codec-pca-model"
        )
    try:
        inv_freq, rope = hf.rotary_inv_freq(hf_model), "undone (the model's rotary frequencies)"
    except hf.CalibrationError as e:
        inv_freq, rope = None, f"kept ({e})"
    chunks = n // chunk_tokens
    what = (
        f"the prefill KV of other random token ids ({model_name}, seed {CALIB_SEED}, not the measured prompt: "
        f"{chunks} chunks of {chunk_tokens} tokens, {n // (g * h * d)} per value of N)"
    )
    cids = torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(CALIB_SEED)).to(device)
    t0 = time.perf_counter()
    kv = prefix_kv(cids, n).cpu()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        model = pca.fit(
            [kv[:, :, s : s + chunk_tokens] for s in range(0, n, chunk_tokens)],
            list(range(0, n, chunk_tokens)),
            inv_freq=inv_freq,
            layer_group=g,
            name=f"lmtier bench ttft: {model_name}",
            info={"fitted_on": what, "metric": "none"},
        )
    except (ValueError, RuntimeError) as e:  # fit's refusals (a KV that does not vary, ...)
        return skip(f"the fit failed ({type(e).__name__}: {e})")
    finally:
        del kv
    fit_s = time.perf_counter() - t0
    path = os.path.join(out_dir, "ttft-bench.lmtpca")
    pca.save(model, path)
    info.update(_describe(model, None))  # the file goes with the run
    info.update(
        what=f"fitted by the bench on {n} tokens of {what}",
        tokens=n,
        chunks=chunks,
        rope=rope,
        metric="none",
        prefill_s=prefill_s,
        fit_s=fit_s,
    )
    say(
        f"PCA model (codec_pca_model): {info['what']}, untimed (prefill {prefill_s:.1f} s, fit {fit_s:.1f} s): "
        f"G={g}, N={model.vector_size}, RoPE {rope}, no metric; id {info['model_id']}, calibration ratios "
        + ", ".join(f"{k} {v:.2f}x" for k, v in (info["calibration_ratios"] or {}).items())
    )
    return path, info
