"""Static rANS tables for the lossy codec tiers of ``lmtier bench ttft`` (``--codec-tables``).

The tables are an argument of :class:`lmtier.tiers.codec.CodecTier`; this module decides which set
each lossy level gets, before any tier is built and before any timed run:

* ``calibrate`` (default): calibrated the way a deployment would do it offline — on the prefill KV
  of ``--codec-calib-tokens`` random token ids drawn with :data:`CALIB_SEED` (not the measured
  prompts), cut into ``--chunk-tokens`` chunks, by :func:`lmtier.codec.calibrate.calibrate`; once
  per level, untimed, kept in memory.
* a PATH (a :func:`lmtier.codec.calibrate.save` ``.npz``): the levels found there are loaded, the
  missing ones calibrated and written back.
* ``shipped``: what the product gives by default (the manager built from the config, whose
  ``codec_tables: auto`` means the tables shipped for this geometry, else tables calibrated on the
  first 16 chunks the tier stores: :mod:`lmtier.codec.autotables`; records stored before those are
  fitted carry per-stream tables).
* ``none``: per-stream tables (every rANS stream carries its own).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["CALIB_SEED", "codec_tables"]

CALIB_SEED = 4321
"""Seed of the random token ids the codec tables are calibrated on (the measured prompts use 1234)."""


def _table_file_geometry(path: str):
    with np.load(path) as z:  # allow_pickle defaults to False: arrays only
        return tuple(int(v) for v in z["geometry"]) if "geometry" in z.files else None


def _table_file_arrays(path: str) -> dict[str, dict]:
    """``{level name: {"sym", "scale", "geometry"}}`` of a :func:`lmtier.codec.calibrate.save` file."""
    out: dict[str, dict] = {}
    with np.load(path) as z:  # allow_pickle defaults to False: arrays only
        geo = z["geometry"]
        for k in z.files:
            if k.endswith(".sym"):
                name = k[: -len(".sym")]
                out[name] = {"sym": z[k], "scale": z[f"{name}.scale"], "geometry": geo}
    return out


def codec_tables(
    levels: list[str],
    *,
    mode: str,
    geometry: tuple[int, int, int],
    chunk_tokens: int,
    calib_tokens: int,
    max_tokens: int | None,
    vocab_size: int,
    prefix_kv: Callable[[torch.Tensor, int], torch.Tensor],
    device: torch.device,
    say: Callable[[str], None],
):
    """``(tables, info)``: the ``tables`` argument of :class:`~lmtier.tiers.codec.CodecTier` for each
    level in ``levels`` (a :class:`lmtier.codec.chunk.StaticTables`, ``"shipped"`` or None), and the
    facts for the JSON (None with ``none``/``shipped`` or no lossy level).

    Args:
        levels: codec level names (lossless levels always get None: per-stream tables).
        mode: ``calibrate``, ``shipped``, ``none`` or a ``.npz`` path (see the module doc).
        geometry: ``(L, H, D)`` of the model's KV.
        chunk_tokens: ``T`` of the calibration chunks.
        calib_tokens, max_tokens: calibration input length, capped at ``max_tokens`` (the model's
            ``max_position_embeddings``; None: no cap).
        vocab_size: of the random calibration token ids.
        prefix_kv: ``prefix_kv(ids, n)`` -> canonical prefill KV ``[L, 2, n, H, D]``.

    Raises:
        SystemExit: a table file of another geometry.
    """
    from lmtier.codec import calibrate as ccal
    from lmtier.codec.levels import get_level

    mode = (mode or "none").strip()
    lossy = [nm for nm in levels if not get_level(nm).lossless]
    tables: dict[str, object] = {nm: None for nm in levels}
    if mode.lower() in ("none", "shipped") or not lossy:
        if mode.lower() == "shipped":
            tables.update({nm: "shipped" for nm in lossy})
        if levels:
            say(
                {
                    "none": "codec tables: per-stream (every rANS stream carries its own table) (--codec-tables none)",
                    "shipped": "codec tables: the product's default (the config's codec_tables: auto — the tables "
                    "shipped for this geometry, else tables auto-calibrated on the first 16 stored chunks)",
                }.get(mode.lower(), "codec tables: per-stream (lossless levels)")
            )
        return tables, None
    geo = tuple(geometry)
    path = None if mode.lower() == "calibrate" else mode
    loaded: dict[str, object] = {}
    if path is not None and os.path.exists(path):
        fg = _table_file_geometry(path)
        if fg != geo:
            raise SystemExit(
                f"lmtier bench ttft: --codec-tables {path}: geometry {fg}, the model has (L, H, D) = {geo}"
            )
        for nm in lossy:
            tab = ccal.load(path, get_level(nm))
            if tab is not None:
                loaded[nm] = tab
    need = [nm for nm in lossy if nm not in loaded]
    info: dict = {
        "mode": "file" if path else "calibrate",
        "path": path,
        "channels_per_table": ccal.channels_per_table(geo),
        "levels": {},
    }
    if need:
        nt = max(1, min(calib_tokens, max_tokens or calib_tokens))
        gen = torch.Generator().manual_seed(CALIB_SEED)
        cids = torch.randint(0, vocab_size, (1, nt), generator=gen).to(device)
        t0 = time.perf_counter()
        kv = prefix_kv(cids, nt).cpu()
        chunks = [kv[:, :, s : s + chunk_tokens] for s in range(0, nt, chunk_tokens)]
        info["calib_tokens"], info["calib_seed"], info["calib_prefill_s"] = nt, CALIB_SEED, time.perf_counter() - t0
        arrays = {}
        for nm in need:
            t0 = time.perf_counter()
            tab, arr = ccal.calibrate(chunks, nm)
            loaded[nm], arrays[nm] = tab, arr
            info["levels"][nm] = {"calibrated_s": time.perf_counter() - t0}
        del kv, chunks
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if path is not None:
            per = _table_file_arrays(path) if os.path.exists(path) else {}
            per.update(arrays)
            ccal.save(path, per)
    for nm in lossy:
        tab = loaded[nm]
        tables[nm] = tab
        d = info["levels"].setdefault(nm, {})
        d.update(
            table_id=int(tab.table_id),
            num_tables=int(tab.tables.shape[0]),
            table_bytes=int(tab.tables.shape[0]) * 512,
            source="file" if nm not in need else "calibrated",
        )
    src = (
        f"calibrated on the prefill KV of {info['calib_tokens']} other random token ids (seed {CALIB_SEED}, "
        f"not the measured prompts) in {info['calib_prefill_s']:.1f} s + "
        + ", ".join(f"{nm} {info['levels'][nm]['calibrated_s']:.1f} s" for nm in need)
        if "calib_tokens" in info
        else ""
    )
    say(
        "codec tables: static, table switching per run of "
        + f"{info['channels_per_table']} channel(s); "
        + "; ".join(
            f"{nm}: {info['levels'][nm]['num_tables']:,} tables ({info['levels'][nm]['table_bytes'] / 1e6:.1f} MB), "
            f"{info['levels'][nm]['source']}"
            for nm in lossy
        )
        + (f"; {src}" if src else "")
        + (f"; file {path}" if path else "")
        + "; given to CodecTier(tables=...); lossless: per-stream"
    )
    return tables, info
