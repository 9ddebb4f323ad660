"""Plot the codec's ratio/quality curve from benchmarks/codec_quality.json (lmtier levels vs CacheGen).

Two panels, one point per (level or scheme, text): perplexity change and KL divergence against the
compression ratio vs bf16. lmtier levels are drawn at their *shipped* ratio (real record bytes)
with a hollow marker at the ideal-coder bound; the CacheGen reference at its most favourable
reading (per-chunk entropy bound, no table cost). The noise floor (KV of a bf16 run) is a
dashed line.

Usage::

    python benchmarks/plot_codec_quality.py [--json benchmarks/codec_quality.json] [--out docs/codec_quality.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# text -> (label, line style, level marker, reference marker)
TEXT_STYLE = {"gpl3": ("GPL-3", "-", "o", "x"), "pydoc": ("pydoc", "--", "s", "+")}


def plot(data: dict, out: Path) -> None:
    """Draw the two panels from the JSON written by codec_quality.py into ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    texts = [t for t in TEXT_STYLE if any(t in r["quality"] for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    for ax, metric, label in (
        (axes[0], "dppl_pct", "perplexity change vs bf16 cache, %"),
        (axes[1], "kl", "KL(P_bf16 || P_codec), nats/token"),
    ):
        for t in texts:
            name, ls, mk, rmk = TEXT_STYLE[t]
            lv = [r for r in rows if r["kind"] == "level" and t in r["quality"] and r["name"] != "lossless"]
            lv.sort(key=lambda r: r["ratio"])
            xs = [r["per_text"][t]["rate"].get("ratio_shipped", r["per_text"][t]["rate"]["ratio"]) for r in lv]
            ys = [r["quality"][t][metric] for r in lv]
            ax.plot(xs, ys, ls, marker=mk, color="C0", label=f"lmtier, shipped ratio ({name})")
            ax.scatter(
                [r["per_text"][t]["rate"]["ratio"] for r in lv],
                ys,
                facecolors="none",
                edgecolors="C0",
                marker=mk,
                s=30,
                label=f"lmtier, ideal-coder bound ({name})",
            )
            for r, x, y in zip(lv, xs, ys):
                ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            for r in rows:
                if r["kind"] != "reference" or t not in r["quality"]:
                    continue
                c = "C3" if r["name"].startswith("cachegen (") else "C1"
                x = r["per_text"][t]["rate"]["ratio"]
                ax.scatter([x], [r["quality"][t][metric]], marker=rmk, s=45, color=c, label=f"{r['name']} ({name})")
            noise = [r for r in rows if r["name"].startswith("noise: bf16")]
            if noise and t in noise[0]["quality"]:
                ax.axhline(
                    noise[0]["quality"][t][metric],
                    color="grey",
                    ls=ls,
                    lw=0.8,
                    label=f"noise: KV of a bf16 run ({name})",
                )
        ax.set_xlabel("compression ratio vs bf16 (all side data)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="green", lw=0.8, ls=":")
    axes[0].annotate(
        "goal for default: <= 1 % at >= 6x",
        (6.0, 1.0),
        fontsize=7,
        color="green",
        xytext=(0, 3),
        textcoords="offset points",
    )
    axes[0].axvline(6.0, color="green", lw=0.8, ls=":")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(
        "KV codec on SmolLM2-135M (dequantized 4-bit weights): ratio vs quality, lmtier vs CacheGen", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def plot_matrix(data: dict, out: Path) -> None:
    """Ratio vs quality of the matrix (``codec_quality.py --matrix`` JSON):
    :func:`lmtier.bench.codec_matrix.plot_matrix` of its cells (also ``lmtier bench codec --matrix``)."""
    sys.path.insert(0, str(ROOT))
    from lmtier.bench.codec_matrix import plot_matrix as plot_rows
    from lmtier.bench.codec_matrix import summarize

    why = plot_rows(summarize(data["cells"]), out)
    if why:
        raise SystemExit(f"plot_codec_quality.py --matrix: {why}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "codec_quality.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "codec_quality.png")
    ap.add_argument("--matrix", action="store_true", help="--json is a codec_quality.py --matrix JSON")
    a = ap.parse_args(argv)
    (plot_matrix if a.matrix else plot)(json.loads(a.json.read_text()), a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
