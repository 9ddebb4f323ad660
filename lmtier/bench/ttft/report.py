"""The judgement and the output of ``lmtier bench ttft``: the logits/KV checks, break-even, the
printed tables and the plot."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lmtier.bench.common import print_table
from lmtier.config_schema import PCA_CODEC_LEVELS

__all__ = [
    "RTOL",
    "MIN_COS",
    "TIERS",
    "REMOTE_KINDS",
    "REMOTE_CODEC_LEVELS",
    "codec_tag",
    "compare",
    "break_even",
    "plot",
    "report",
]

# Next-token logits of a cached path "match" recompute when max|diff| <= RTOL * max|ref logits| and
# cosine >= MIN_COS. The two sides run different kernels (a full prefill with a causal mask vs one
# query over loaded KV: other GEMM shapes, other reduction orders), so in bf16 (8-bit mantissa) the
# hidden state picks up ~2^-9 relative rounding per op and layer; through 32 layers the logits
# differ by a few % of their absolute max (measured on the H200: 0.273 = 5.1 % at N = 1024 with
# cosine 0.999 and the KV bit-exact), while the direction stays put (cosine >= 0.999). So: a loose
# max-abs bound with 2x margin over that, a tight cosine, and the bit-exact KV check as the hard
# guard (a load that moves or drops a byte fails it whatever the logits say).
RTOL = 0.10
MIN_COS = 0.995

REMOTE_KINDS = ("redis", "mooncake")
"""The remote tiers the bench measures (each also with the codec: :data:`REMOTE_CODEC_LEVELS`), in row order."""
REMOTE_CODEC_LEVELS = ("default", *PCA_CODEC_LEVELS)
"""The codec levels of the remote tiers' codec variants (``<kind>+codec``, ``<kind>+pca_default``, ...)."""


def codec_tag(level: str, kind: str = "disk") -> str:
    """Column prefix of the ``kind`` tier (``disk``, ``redis``, ``mooncake``) with the codec at
    ``level`` (``default`` is "<kind>+codec")."""
    return f"{kind}+codec" if level == "default" else f"{kind}+{level}"


TIERS = (
    "cpu",
    "disk",
    "disk+codec",
    "disk+lossless",
    *(codec_tag(lv) for lv in PCA_CODEC_LEVELS),
    *(t for k in REMOTE_KINDS for t in (k, *(codec_tag(lv, k) for lv in REMOTE_CODEC_LEVELS))),
)
"""Every tier's column prefix, in row order (the break-even keys)."""


def compare(ref: torch.Tensor, got: torch.Tensor, kv=None, ref_kv=None) -> dict:
    """Logits ``got`` vs ``ref`` within the bf16 tolerance, and (if given) the loaded prefix KV
    bit-identical to the prefill's."""
    ref, got = ref.float().reshape(-1), got.float().reshape(-1)
    diff = (ref - got).abs().max().item()
    scale = ref.abs().max().item()
    cos = F.cosine_similarity(ref, got, dim=0).item()
    ok = math.isfinite(diff) and diff <= RTOL * scale and cos >= MIN_COS
    out = {"max_abs_diff": diff, "ref_absmax": scale, "cosine": cos, "logits_ok": bool(ok)}
    if kv is not None:
        out["kv_exact"] = bool(torch.equal(kv, ref_kv))
        ok = ok and out["kv_exact"]
    out["ok"] = bool(ok)
    return out


def break_even(rows: list[dict], tier: str) -> int | None:
    """Shortest N at which the tier's TTFT beats recompute."""
    for r in sorted(rows, key=lambda r: r["N"]):
        if r.get(f"{tier}_ms") is not None and r[f"{tier}_ms"] < r["recompute_ms"]:
            return r["N"]
    return None


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """TTFT vs N per tier (log-log) to PNG ``path``; returns None, or why nothing was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["N"] for r in rows]
    for key, label, style in (
        ("recompute_ms", "recompute (prefill)", "o-"),
        ("cpu_ms", "CPU tier (pinned)", "s-"),
        ("cpu_limit_ms", "CPU tier physical limit (H2D)", ":"),
        ("disk_ms", "disk tier (O_DIRECT)", "^-"),
        ("disk+codec_ms", "disk + codec", "v-"),
        ("disk+lossless_ms", "disk + lossless codec", "<-"),
        ("disk+pca_default_ms", "disk + PCA codec (pca_default)", ">-"),
        ("disk+pca_high_ms", "disk + PCA codec (pca_high)", "h-"),
        ("redis_ms", "Redis (loopback)", "d-"),
        ("redis+codec_ms", "Redis + codec", "D-"),
        ("redis+pca_default_ms", "Redis + PCA codec (pca_default)", "x-"),
        ("mooncake_ms", "Mooncake Store (loopback)", "p-"),
        ("mooncake+codec_ms", "Mooncake Store + codec", "P-"),
        ("mooncake+pca_default_ms", "Mooncake Store + PCA codec (pca_default)", "+-"),
    ):
        pts = [(r["N"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs], rotation=45)
    ax.set_xlabel("context length N (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


def report(res: dict) -> None:
    """Print the TTFT table, the checks table and the break-even lines of a :func:`run` result."""
    rows = res["rows"]
    cols = [
        "N",
        "recompute_ms",
        "cpu_ms",
        "cpu_pct",
        "cpu_limit_pct",
        "cpu_eager_ms",
        "h2d_GBs",
        "load_ms",
        "fwd_ms",
        "fwd_eager_ms",
        "disk_ms",
        "disk_pct",
        "disk_limit_pct",
        "disk_dd_GBs",
        "disk_par_GBs",
        "disk_GBs",
    ]
    for t in TIERS:
        if t.startswith("disk+"):
            cols += [f"{t}_ms", f"{t}_pct", f"{t}_limit_pct", f"{t}_ratio", f"{t}_mem_ms"]
    cols += ["redis_ms", "redis_pct", "redis_limit_pct", "redis_raw_GBs"]
    cols += [f"{t}{c}" for t in TIERS if t.startswith("redis+") for c in ("_ms", "_pct")]
    cols += [f"{t}{c}" for t in TIERS if t.startswith("mooncake") for c in ("_ms", "_pct")]
    if any("fwd_contig_ms" in r for r in rows):
        cols += ["transpose_ms", "fwd_contig_ms"]
    cols = [c for c in cols if any(r.get(c) is not None for r in rows) or c in ("N", "recompute_ms", "cpu_ms")]
    print()
    print(
        f"TTFT, median of {res['iters']} after {res['warmup']} warm-up ({res['model']}, {res['dtype']}, "
        f"{res['device']}); *_pct = % of recompute; *_limit_pct = bytes / same-run ceiling"
    )
    print_table(rows, cols)
    print()
    chk = []
    for r in rows:
        d = {"N": r["N"]}
        for k in (
            "cpu",
            "disk",
            *(t for t in TIERS if t.startswith("disk+")),
            *(t for t in TIERS if t.startswith(REMOTE_KINDS)),
            "control_wrong_kv",
        ):
            c = r.get(f"check_{k}")
            if c:
                d[f"{k}_maxdiff"] = c["max_abs_diff"]
                d[f"{k}_cos"] = round(c["cosine"], 5)
                if "kv_exact" in c:
                    d[f"{k}_kv_exact"] = c["kv_exact"]
                if c.get("lossy"):
                    d[f"{k}_kv_relerr"] = c["kv_rel_err"]
                d[f"{k}_ok"] = "ok" if c["ok"] else ("(expected)" if k == "control_wrong_kv" else "MISMATCH")
        d["logit_absmax"] = r["check_cpu"]["ref_absmax"]
        chk.append(d)
    print(
        f"next-token logits vs recompute (match: max|diff| <= {RTOL} x max|logit| and cosine >= {MIN_COS}, and the "
        "loaded KV bit-exact; lossy codec levels: KV bit-exact vs the reference decoder, logits reported only; "
        "control = chunk 0's KV loaded in chunk 1's place: its logits should NOT match)"
    )
    modes = sorted({r.get("fwd_mode", "eager") for r in rows})
    print(
        "lean forward mode: "
        + "; ".join(
            f"{m} (N = {', '.join(str(r['N']) for r in rows if r.get('fwd_mode', 'eager') == m)})" for m in modes
        )
    )
    print_table(chk, list(dict.fromkeys(k for d in chk for k in d)))
    for r in rows:
        for k, c in r.items():
            if k.startswith("check_records_"):
                sizes = ", ".join(f"{t} {mb:.6f}" for t, mb in c["MB"].items())
                verdict = "the same" if c["ok"] else "DIFFERENT (a tier stored records of other bytes)"
                print(f"N = {r['N']}: {k[len('check_records_') :]} records stored by every tier: {verdict}: {sizes} MB")
    print()
    for t in TIERS:
        if not any(r.get(f"{t}_ms") is not None for r in rows):
            continue
        be = res["break_even"][t]
        print(
            f"break-even {t}: "
            + (f"loads beat recompute from N = {be}" if be is not None else "never within the measured lengths")
        )
    for s in res["skipped"]:
        print(f"skipped N={s['N']}: {s['why']}")
    ctl = [r["check_control_wrong_kv"]["logits_ok"] for r in rows if "check_control_wrong_kv" in r]
    if any(ctl):
        print(
            "warning: the wrong-KV control passed the logits check at some N: on this model the logits check "
            "alone is not discriminating; the bit-exact KV check (kv_exact) still guards every load"
        )
    print(
        f"logit checks: {'all match' if res['checks_ok'] else 'MISMATCH — a cached path is wrong'}; "
        f"elapsed {res['elapsed_s']:.1f} s"
    )
