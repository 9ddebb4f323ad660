"""``lmtier bench codec --matrix``: the codec quality matrix (issue 19) as a table and a ratio-vs-quality plot.

The matrix is measured by ``benchmarks/codec_quality.py --matrix`` (a source checkout: the corpus,
the models and the teacher-forced scoring live in ``benchmarks/``): one *cell* per (model, text,
scheme) with ``ratio`` (bf16 bytes / real record bytes for lmtier levels), ``dppl_pct`` (perplexity
change, %), ``top1`` (top-1 agreement with the bf16-cache run, %), ``kl`` (mean KL(P_ref || P), nats
per token) and ``split`` (``tune`` / ``held-out``). This module holds the one definition of what is
made of those cells — :func:`summarize` (min / median / max per (model, scheme) over texts),
:func:`format_summary` (the markdown table RESULTS §4.1b prints) and :func:`plot_matrix` (median
ratio against median Δppl and KL, min-max bars) — used by the benchmark script and by the CLI:

    lmtier bench codec --matrix [benchmarks/codec_matrix.json] [--plot matrix.png]
    lmtier bench codec --matrix-run --matrix-models smollm2 --matrix-texts prose_mpl,code_c \\
        --matrix-schemes high,default [--json out.json] [--plot matrix.png]

``--matrix-run`` measures a (small) matrix first through ``benchmarks/codec_quality.py``'s machinery
(found under ``--benchmarks-dir``, default ``benchmarks/`` in the working directory; a clear error
without it) and then prints and plots it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

__all__ = ["summarize", "format_summary", "plot_matrix", "load_cells", "run_small_matrix", "main_matrix"]

METRICS = ("ratio", "dppl_pct", "top1", "kl")


def summarize(cells: list[dict]) -> list[dict]:
    """min / median / max per (model, scheme) of ratio, Δppl, top-1, KL over texts, and the same over
    the held-out split only (``held_*`` keys and their count ``held_n``, where the group has held-out texts).

    Args:
        cells: matrix cells (dicts with ``model``, ``scheme``, ``split`` and :data:`METRICS`).

    Returns:
        One dict per (model, scheme) in first-seen order: ``model``, ``scheme``, ``n_texts`` and per
        metric a ``(min, median, max)`` tuple.
    """
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cells:
        groups.setdefault((c["model"], c["scheme"]), []).append(c)
    rows = []
    for (model, scheme), cs in groups.items():
        row = dict(model=model, scheme=scheme, n_texts=len(cs))
        for key in METRICS:
            v = [c[key] for c in cs]
            row[key] = (min(v), statistics.median(v), max(v))
            hv = [c[key] for c in cs if c.get("split") == "held-out"]
            if hv:
                row["held_" + key] = (min(hv), statistics.median(hv), max(hv))
                row["held_n"] = len(hv)
        rows.append(row)
    return rows


def format_summary(rows: list[dict]) -> str:
    """Markdown table of :func:`summarize` rows (ratio in x, Δppl in %, top-1 in %, KL in nats)."""
    out = [
        "| model | scheme | n | ratio min / med / max | Δppl % min / med / max | top-1 % min / med / max "
        "| KL min / med / max |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ra, dp, t1, kl = r["ratio"], r["dppl_pct"], r["top1"], r["kl"]
        out.append(
            f"| {r['model']} | {r['scheme']} | {r['n_texts']} | {ra[0]:.2f} / {ra[1]:.2f} / {ra[2]:.2f}× "
            f"| {dp[0]:+.2f} / {dp[1]:+.2f} / {dp[2]:+.2f} | {t1[0]:.2f} / {t1[1]:.2f} / {t1[2]:.2f} "
            f"| {kl[0]:.4f} / {kl[1]:.4f} / {kl[2]:.4f} |"
        )
    return "\n".join(out)


def plot_matrix(rows: list[dict], out: str | Path, *, title: str = "") -> str | None:
    """Ratio-vs-quality plot of :func:`summarize` rows to PNG ``out``: three panels (Δppl %, top-1 %,
    KL), one point per (model, scheme) but ``lossless`` at its median ratio and median metric, bars
    from the min to the max over texts (both axes), one marker per model, the scheme written beside
    its point, issue 19's targets dotted (Δppl 0.5 / 1 %, top-1 96 / 97.5 %).

    Returns None on success, else why nothing was written (matplotlib missing, no rows)."""
    rows = [r for r in rows if r["scheme"] != "lossless"]
    if not rows:
        return "no lossy matrix cells"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    marker_cycle = "os^Dv<>"
    markers = {m: marker_cycle[i % len(marker_cycle)] for i, m in enumerate(dict.fromkeys(r["model"] for r in rows))}
    for row in rows:
        ra = row["ratio"]
        for ax, key in zip(axes, ("dppl_pct", "top1", "kl")):
            lo, med, hi = row[key]
            ax.errorbar(
                ra[1],
                med,
                yerr=[[med - lo], [hi - med]],
                xerr=[[ra[1] - ra[0]], [ra[2] - ra[1]]],
                fmt=markers[row["model"]],
                capsize=2,
                label=f"{row['model']} {row['scheme']}" if key == "dppl_pct" else None,
            )
            ax.annotate(row["scheme"], (ra[1], med), fontsize=6, xytext=(3, 3), textcoords="offset points")
    axes[0].set_ylabel("Δ perplexity vs bf16 cache (%)")
    axes[1].set_ylabel("top-1 agreement (%)")
    axes[2].set_ylabel("KL(P_bf16 || P_codec), nats/token")
    for ax in axes:
        ax.set_xlabel("ratio vs bf16 (real record bytes; CacheGen: entropy bound)")
        ax.grid(alpha=0.3)
    for y in (0.5, 1.0):
        axes[0].axhline(y, color="green", lw=0.8, ls=":")
    for y in (96.0, 97.5):
        axes[1].axhline(y, color="green", lw=0.8, ls=":")
    fig.legend(loc="lower center", ncol=5, fontsize=6, frameon=False)
    fig.suptitle(
        (title or "KV codec quality matrix (issue 19): texts x levels x models")
        + " — median over texts, bars min to max",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.18, 1, 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return None


def load_cells(path: str | Path) -> list[dict]:
    """The cells of a matrix JSON (``{"cells": [...]}``, as ``codec_quality.py --matrix`` writes).

    Raises:
        SystemExit: the file is missing or is not a matrix JSON (the message says which).
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"lmtier bench codec --matrix: cannot read {p}: {e}") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list) or not all(
        isinstance(c, dict) and {"model", "scheme", *METRICS} <= set(c) for c in cells
    ):
        raise SystemExit(f"lmtier bench codec --matrix: {p} is not a codec matrix JSON (no 'cells' with {METRICS})")
    return cells


def run_small_matrix(
    benchmarks_dir: str | Path, models: list[str], texts: list[str], schemes: list[str], out_json: Path | None
) -> list[dict]:
    """Measure a matrix with ``benchmarks/codec_matrix.run_matrix`` (every text for every model, no
    ideal-coder bound) and return its cells.

    Raises:
        SystemExit: ``benchmarks_dir`` has no ``codec_matrix.py`` (not a source checkout)."""
    d = Path(benchmarks_dir).resolve()
    if not (d / "codec_matrix.py").is_file():
        raise SystemExit(
            f"lmtier bench codec --matrix-run: {d}/codec_matrix.py not found — the matrix needs a source "
            "checkout's benchmarks/ (--benchmarks-dir)"
        )
    for p in (str(d), str(d.parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import codec_matrix as CM  # benchmarks/codec_matrix.py

    res = CM.run_matrix(models, texts, schemes, out_json, False, texts_2nd=None, few_texts={}, rate_bound=False)
    return res["cells"]


def main_matrix(args) -> int:
    """The ``--matrix`` / ``--matrix-run`` mode of ``lmtier bench codec`` (arguments: :mod:`lmtier.bench.codec`)."""
    from lmtier.bench.common import report_plot

    if args.matrix_run:
        split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
        cells = run_small_matrix(
            args.benchmarks_dir,
            split(args.matrix_models),
            split(args.matrix_texts),
            split(args.matrix_schemes),
            Path(args.json) if args.json else None,
        )
        source = "measured now"
    else:
        cells = load_cells(args.matrix)
        source = str(args.matrix)
    rows = summarize(cells)
    print(f"lmtier bench codec --matrix: {len(cells)} cells ({source}); per (model, scheme) over texts:")
    print(format_summary(rows))
    held = [r for r in rows if "held_ratio" in r]
    if held:
        print("held-out texts only:")
        print(format_summary([{**r, "n_texts": r["held_n"], **{k: r["held_" + k] for k in METRICS}} for r in held]))
    if args.plot:
        report_plot(args.plot, plot_matrix(rows, args.plot, title=f"codec quality matrix ({source})"))
    return 0
