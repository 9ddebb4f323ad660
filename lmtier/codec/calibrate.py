"""Static rANS tables calibrated offline: one table per (layer, K/V, head, channel) run, shipped per model.

The quantized levels emit per layer three record sections (:mod:`lmtier.codec.chunk`): K symbols
``[H, D, T]``, V symbols ``[H, D, T]`` and the scale codes ``[2, H, T]``. A calibrated
:class:`~lmtier.codec.chunk.StaticTables` codes them with *table switching* (rANS stream version 2):

* symbol sections: run length ``G * T``, table ``((l * 2 + p) * H + h) * D / G + d / G`` for the run
  of channels ``(h, d .. d + G - 1)``, G = 1 (one table per channel) unless the set would exceed
  the coder's 65,535 tables (e.g. Llama-3.1-8B: 65,536 channel runs -> G = 2) — every table
  covers the level's whole alphabet ``0 .. 2 * qmax`` (frequency >= 1), so valid chunks never
  need a fallback;
* scale sections: run length ``H * T``, table ``L * 2 * H * D + 2 * l + p`` for plane p's codes —
  these cover the codes seen in calibration plus a margin; a chunk with another code falls back
  to a per-stream table for that stream alone (the coder's rule).

A chunk whose T is not a multiple of 32 (run lengths must be) is coded with per-stream tables; a
model without shipped tables too (:func:`shipped_tables` returns None).

Tables are fitted on calibration text that is *not* the evaluation text of
benchmarks/codec_quality.py (there: Apache-2.0 + the pydoc of collections/itertools/functools).
The file format is a NumPy ``.npz`` read with ``allow_pickle=False`` (no pickle): per level
``<level>.sym`` uint16 ``[L * 2 * H * D, A]`` (frequencies of symbols ``0 .. A - 1``, the rest 0) and
``<level>.scale`` uint16 ``[L * 2, 256]``, plus ``geometry`` int64 ``[L, H, D]``.

Entry points: :func:`calibrate` (chunks -> tables), :func:`save` / :func:`load`,
:func:`shipped_tables` (the file in this package for a geometry and level), and
``python -m lmtier.codec.calibrate --out FILE`` (rebuild the shipped file from the cached KV of the
quality benchmark's calibration text).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from . import bound
from .chunk import StaticTables, _quantize
from .levels import Level, get_level, resolve

__all__ = [
    "SHIPPED_FILE",
    "MAX_TABLES",
    "channels_per_table",
    "table_set_id",
    "Calibrator",
    "calibrate",
    "save",
    "load",
    "shipped_tables",
]

SHIPPED_FILE = Path(__file__).with_name("tables") / "smollm2_135m.npz"
"""Tables for SmolLM2-135M geometry (L=30, H=3, D=64), levels high/default/low."""

SCALE_MARGIN = 8  # scale codes within this distance of the calibrated range stay codable


def table_set_id(
    level: str | int | Level,
    geometry: Sequence[int],
    sym: np.ndarray,
    scale: np.ndarray,
    plane_qmax: np.ndarray | None = None,
) -> int:
    """Record ``table_id`` of a table set: a CRC-32 of the level id, geometry and tables (and, for
    adaptive levels, the qmax each plane's tables were fitted for), so a decoder refuses records
    coded with other tables. Never :data:`lmtier.codec.format.NO_TABLE`."""
    lv = get_level(level)
    h = zlib.crc32(bytes([lv.level_id]) + np.asarray(geometry, np.int64).tobytes())
    h = zlib.crc32(np.ascontiguousarray(sym).tobytes(), h)
    h = zlib.crc32(np.ascontiguousarray(scale).tobytes(), h)
    if plane_qmax is not None:
        h = zlib.crc32(np.ascontiguousarray(plane_qmax, np.uint8).tobytes(), h)
    return h if h != 0xFFFFFFFF else 0


MAX_TABLES = 0xFFFF  # table ids are uint16 in the stream header; 0xFFFF means "own table"


def channels_per_table(geometry: Sequence[int]) -> int:
    """Channels sharing one symbol table (G): the smallest power of two keeping the set within
    :data:`MAX_TABLES` tables (raises ValueError when even G = D does not)."""
    nl, h, d = (int(v) for v in geometry)
    g = 1
    while nl * 2 * h * d // g + nl * 2 >= MAX_TABLES:
        g *= 2
        if g > d or d % g:
            raise ValueError(f"geometry {tuple(geometry)} needs too many tables")
    return g


def _tables(
    level: Level, geometry: Sequence[int], sym: np.ndarray, scale: np.ndarray, plane_qmax: np.ndarray | None = None
) -> StaticTables:
    nl, h, d = (int(v) for v in geometry)
    g = channels_per_table(geometry)
    n_sym = nl * 2 * h * d // g
    if sym.shape[0] != n_sym or scale.shape != (nl * 2, 256):
        raise ValueError(f"table arrays {sym.shape} / {scale.shape} do not fit geometry {tuple(geometry)}")
    full = np.zeros((n_sym + nl * 2, 256), np.uint16)
    full[:n_sym, : sym.shape[1]] = sym
    full[n_sym:] = scale
    if (full.astype(np.int64).sum(1) != 4096).any():
        raise ValueError("calibrated tables must each sum to 4096")
    sec = np.zeros(nl * 3, np.int64)
    runs = np.zeros(nl * 3, np.int64)
    for l in range(nl):
        sec[3 * l] = (l * 2) * h * d // g
        sec[3 * l + 1] = (l * 2 + 1) * h * d // g
        sec[3 * l + 2] = n_sym + 2 * l
        runs[3 * l : 3 * l + 2] = g
        runs[3 * l + 2] = h
    if level.adaptive != (plane_qmax is not None):
        raise ValueError("adaptive levels' tables need the qmax each plane was fitted for (and only they)")
    if plane_qmax is not None:
        plane_qmax = np.ascontiguousarray(plane_qmax, np.uint8)
        if plane_qmax.shape != (nl, 2) or not set(plane_qmax.reshape(-1).tolist()) <= set(level.qmax_menu):
            raise ValueError(f"plane_qmax must be uint8 [{nl}, 2] of the level's menu")
    tid = table_set_id(level, geometry, sym, scale, plane_qmax)
    return StaticTables(tid, full, sec, runs, plane_qmax)


def _add_counts(
    c: torch.Tensor,
    rl: Level,
    lv: Level,
    plane_qmax: np.ndarray | None,
    sym_counts: np.ndarray,
    scale_counts: np.ndarray,
) -> None:
    """Add chunk ``c``'s symbol and scale-code counts (quantized with ``rl``) to the count arrays
    ``[L * 2 * H * D, 256]`` / ``[L * 2, 256]`` (int64); adaptive ``lv``: only planes quantized with
    the tables' qmax ``plane_qmax`` count."""
    nl, _, t, h, d = c.shape
    s, side = _quantize(c, rl, 0)  # native kernels where supported (bit-identical)
    if lv.adaptive:  # only planes quantized with the tables' qmax count
        same = np.array([rl.k.qmax_table(nl), rl.v.qmax_table(nl)]).T == plane_qmax  # [L, 2]
        s = s.clone()
        s[torch.from_numpy(~same)] = 255  # outside every alphabet: dropped below
    st = s.reshape(-1, t).to(torch.int64)
    base = torch.arange(st.shape[0], dtype=torch.int64)[:, None] * 256
    sym_counts += torch.bincount((st + base).reshape(-1), minlength=st.shape[0] * 256).reshape(-1, 256).numpy()
    sc = side.reshape(nl * 2, h * t).to(torch.int64)
    base = torch.arange(nl * 2, dtype=torch.int64)[:, None] * 256
    sc_c = torch.bincount((sc + base).reshape(-1), minlength=nl * 2 * 256).reshape(-1, 256).numpy()
    scale_counts += sc_c * same.reshape(nl * 2, 1) if lv.adaptive else sc_c


def _fit(
    lv: Level,
    lq: Level,
    geometry: tuple[int, int, int],
    sym_counts: np.ndarray,
    scale_counts: np.ndarray,
    plane_qmax: np.ndarray | None,
) -> tuple[StaticTables, dict]:
    """Tables from accumulated counts (``lq``: the level with the tables' qmax per layer)."""
    from . import rans

    nl, h, d = geometry
    g = channels_per_table(geometry)
    sym_counts = sym_counts.reshape(-1, g, 256).sum(1)  # consecutive channels of one head
    qk, qv = lq.k.qmax_table(nl), lq.v.qmax_table(nl)
    alpha = 2 * max(max(qk), max(qv)) + 1
    sym = np.zeros((nl * 2 * h * d // g, alpha), np.uint16)
    for i in range(sym.shape[0]):
        l, p = divmod(i // (h * d // g), 2)
        a = 2 * (qk if p == 0 else qv)[l] + 1
        sym[i] = rans.build_table(sym_counts[i, :a], alphabet_size=a)[:alpha]
    scale = np.zeros((nl * 2, 256), np.uint16)
    for i in range(nl * 2):
        seen = np.flatnonzero(scale_counts[i])
        c = scale_counts[i].copy()
        if seen.size:
            lo, hi = max(0, int(seen[0]) - SCALE_MARGIN), min(255, int(seen[-1]) + SCALE_MARGIN)
            force = np.zeros(256, bool)
            force[lo : hi + 1] = True
            force[0] = True  # all-zero rows
            c = np.where(force & (c == 0), 1, c * 16)  # unseen codes near the range: 1/16 of a count
        scale[i] = rans.build_table(c, alphabet_size=0 if seen.size else 256)
    arrays = {"sym": sym, "scale": scale, "geometry": np.asarray(geometry, np.int64)}
    if plane_qmax is not None:
        arrays["qmax"] = plane_qmax
    return _tables(lv, geometry, sym, scale, plane_qmax), arrays


class Calibrator:
    """Incremental :func:`calibrate` for a fixed (not adaptive) quantized level: :meth:`add` counts
    one chunk's symbols and scale codes (the chunk is not kept), :meth:`finish` fits the tables —
    the same tables :func:`calibrate` fits on the same chunks.

    Raises:
        ValueError: lossless or adaptive level (construction); a chunk of another geometry (``add``);
            no chunk added (``finish``).
    """

    def __init__(self, level: str | int | Level) -> None:
        self.level = get_level(level)
        if self.level.lossless or self.level.adaptive:
            raise ValueError("Calibrator takes a fixed quantized level (calibrate() fits adaptive ones)")
        self.geometry: tuple[int, int, int] | None = None
        self.chunks = 0
        self._sym: np.ndarray | None = None
        self._scale: np.ndarray | None = None

    def add(self, chunk: torch.Tensor) -> None:
        """Count one canonical chunk ``[L, 2, T, H, D]`` (bf16/fp16, CPU)."""
        c = chunk.contiguous()
        nl, _, _, h, d = c.shape
        if self.geometry is None:
            self.geometry = (nl, h, d)
            self._sym = np.zeros((nl * 2 * h * d, 256), np.int64)
            self._scale = np.zeros((nl * 2, 256), np.int64)
        elif self.geometry != (nl, h, d):
            raise ValueError(f"chunks of different geometries: {self.geometry} vs {(nl, h, d)}")
        _add_counts(c, self.level, self.level, None, self._sym, self._scale)
        self.chunks += 1

    def finish(self) -> tuple[StaticTables, dict]:
        """``(tables, arrays)`` as :func:`calibrate` returns them."""
        if self.geometry is None:
            raise ValueError("no calibration chunks")
        return _fit(self.level, self.level, self.geometry, self._sym, self._scale, None)


def calibrate(chunks: Iterable[torch.Tensor], level: str | int | Level) -> tuple[StaticTables, dict]:
    """Fit static tables for a quantized level on calibration chunks.

    Args:
        chunks: canonical chunks ``[L, 2, T, H, D]`` (bf16/fp16, CPU), all of one geometry but T.
        level: a quantized level (not ``lossless``).

    Returns:
        ``(tables, arrays)``: the :class:`StaticTables` and the compact arrays ``{"sym", "scale",
        "geometry"}`` (plus ``"qmax"`` for adaptive levels) that :func:`save` stores.

    Raises:
        ValueError: lossless level, no chunks, or chunks of different geometries.
    """
    lv = get_level(level)
    if lv.lossless:
        raise ValueError("calibrated tables are for the quantized levels")
    if not lv.adaptive:
        cal = Calibrator(lv)
        for c in chunks:
            cal.add(c)
        return cal.finish()
    sym_counts = scale_counts = geometry = None
    plane_qmax = None
    chunks = [c.contiguous() for c in chunks]
    # tables per plane for the qmax the calibration chunks chose most often
    resolved = [resolve(lv, *bound.choose_qmax(c, lv)[:2]) for c in chunks]
    lv_tab = lv
    if resolved:
        nl0 = chunks[0].shape[0]
        picks = np.array([[r.k.qmax_table(nl0), r.v.qmax_table(nl0)] for r in resolved])  # [C, 2, L]
        plane_qmax = np.zeros((nl0, 2), np.uint8)
        for l in range(nl0):
            for p in range(2):
                vals, cnt = np.unique(picks[:, p, l], return_counts=True)
                plane_qmax[l, p] = vals[np.argmax(cnt)]
        lv_tab = resolve(lv, tuple(int(v) for v in plane_qmax[:, 0]), tuple(int(v) for v in plane_qmax[:, 1]))
    for c, rl in zip(chunks, resolved):
        nl, _, t, h, d = c.shape
        if geometry is None:
            geometry = (nl, h, d)
            sym_counts = np.zeros((nl * 2 * h * d, 256), np.int64)
            scale_counts = np.zeros((nl * 2, 256), np.int64)
        elif geometry != (nl, h, d):
            raise ValueError(f"chunks of different geometries: {geometry} vs {(nl, h, d)}")
        _add_counts(c, rl, lv, plane_qmax, sym_counts, scale_counts)
    if geometry is None:
        raise ValueError("no calibration chunks")
    return _fit(lv, lv_tab, geometry, sym_counts, scale_counts, plane_qmax)


def save(path: str | Path, per_level: dict[str, dict]) -> None:
    """Write ``{level name: arrays from calibrate}`` to an ``.npz`` (compressed, no pickle)."""
    out = {}
    geometry = None
    for name, arr in per_level.items():
        get_level(name)
        if geometry is not None and not np.array_equal(geometry, arr["geometry"]):
            raise ValueError("all levels of one file must share the geometry")
        geometry = arr["geometry"]
        out[f"{name}.sym"] = arr["sym"]
        out[f"{name}.scale"] = arr["scale"]
        if "qmax" in arr:
            out[f"{name}.qmax"] = arr["qmax"]
    out["geometry"] = np.asarray(geometry, np.int64)
    np.savez_compressed(path, **out)


def load(path: str | Path, level: str | int | Level) -> StaticTables | None:
    """The tables of ``level`` in the file at ``path`` (None if the file has none for it).

    Raises ValueError on a malformed file (wrong shapes, tables not summing to 4096)."""
    lv = get_level(level)
    with np.load(path) as z:  # allow_pickle defaults to False: arrays only
        if f"{lv.name}.sym" not in z.files:
            return None
        geometry = tuple(int(v) for v in z["geometry"])
        sym = z[f"{lv.name}.sym"].astype(np.uint16)
        scale = z[f"{lv.name}.scale"].astype(np.uint16)
        qmax = z[f"{lv.name}.qmax"].astype(np.uint8) if f"{lv.name}.qmax" in z.files else None
    if len(geometry) != 3 or sym.ndim != 2 or sym.shape[1] > 256:
        raise ValueError(f"malformed table file {path}")
    if lv.adaptive != (qmax is not None):
        return None  # tables of another definition of this level name
    return _tables(lv, geometry, sym, scale, qmax)


_SHIPPED: dict = {}


def shipped_tables(level: str | int | Level, shape: Sequence[int]) -> StaticTables | None:
    """The calibrated tables shipped in this package for ``level`` and chunk ``shape``
    ``(L, 2, T, H, D)``, or None (no file for that geometry, lossless level, or a T that table
    switching cannot use: then the records carry per-stream tables)."""
    lv = get_level(level)
    if lv.lossless or not SHIPPED_FILE.exists():
        return None
    nl, _, t, h, d = (int(v) for v in shape)
    key = lv.name
    if key not in _SHIPPED:
        _SHIPPED[key] = load(SHIPPED_FILE, lv)
    tab = _SHIPPED[key]
    try:
        g = channels_per_table((nl, h, d))
    except ValueError:
        return None
    if tab is None or tab.section_tables.size != nl * 3 or tab.tables.shape[0] != nl * 2 * h * d // g + nl * 2:
        return None
    if int(tab.section_tables[1] - tab.section_tables[0]) != h * d // g or tab.run_lens(t) is None:
        return None
    return tab


def _main(argv=None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="rebuild the shipped calibrated tables")
    ap.add_argument("--out", type=Path, default=SHIPPED_FILE)
    ap.add_argument("--levels", default="high,default,low")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    import codec_quality as cq  # the calibration text's KV (not an evaluation text)
    import codec_rates as cr

    kv = cq.get_text("calib")["kv_fp32"].to(torch.bfloat16)
    chunks = cr.chunk_views(kv, a.chunk_tokens)
    per = {}
    for name in a.levels.split(","):
        _, arr = calibrate(chunks, name)
        per[name] = arr
        print(f"{name}: {arr['sym'].shape[0]} symbol tables, alphabet {arr['sym'].shape[1]}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    save(a.out, per)
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
