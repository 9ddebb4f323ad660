"""Print the short TTFT table of a ``lmtier bench ttft --json`` file (scripts/gpu_run.sh ends with it).

python scripts/ttft_table.py out/ttft.json
"""

import json
import sys


def main(path: str) -> None:
    r = json.load(open(path))
    c = r["ceilings"]
    dd = c.get("disk_dd_GBs") or {}
    print(
        f"--- {path.rsplit('/', 1)[-1]}: {r['model']}; H2D {c.get('h2d_GBs') or 0:.1f} GB/s; dd read "
        f"{dd.get('read', 0):.2f} GB/s, O_DIRECT x{dd.get('read_par_inflight', '?')} {dd.get('read_par', 0):.2f} GB/s; "
        f"Redis raw socket {c.get('redis_raw_GBs') or 0:.2f} GB/s; load path: "
        f"{r.get('load_path', {}).get('copy', '?')}, "
        f"codec decode on the {r.get('load_path', {}).get('codec_decode', '?')}; "
        f"checks_ok={r['checks_ok']}; ms (% of recompute)"
    )
    pca = r.get("codec_pca_model")
    if pca:  # where the PCA levels' model file came from (given, or fitted by the bench)
        print(f"    PCA model: {pca.get('what')}" + (f" — {pca['error']}" if pca.get("error") else ""))
    # the tiers in the bench's row order (lmtier.bench.ttft.report.TIERS: the break-even keys)
    tiers = [t for t in r["break_even"] if any(row.get(t + "_ms") for row in r["rows"])]
    width = {t: max(16, len(t)) for t in tiers}
    print("N".rjust(6), "recompute".rjust(9), *(t.rjust(width[t]) for t in tiers))
    for row in r["rows"]:

        def cell(t):
            return (f"{row[t + '_ms']:.1f} ({row[t + '_pct']:.1f}%)" if row.get(t + "_ms") else "-").rjust(width[t])

        print(str(row["N"]).rjust(6), f"{row['recompute_ms']:.1f}".rjust(9), *(cell(t) for t in tiers))
    print(
        "break-even (shortest N where loading wins): "
        + (", ".join(f"{t} {v}" for t, v in r["break_even"].items() if v) or "none")
    )


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
