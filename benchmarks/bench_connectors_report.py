"""The report of benchmarks/bench_connectors.py: per (system, N) medians over the calm rounds, their
ratio to the cold prefill (:func:`summarize`), the table (:func:`print_table`) and the targets
(:func:`targets`: lmtier's warm and disk TTFT against the cold prefill and the best peer).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench_connectors import Bench


ORDER = [
    "cold",
    "lmtier cold (storing)",
    "0% reuse base",
    "0% reuse lmtier",
    "lmtier warm CPU",
    "lmcache CPU (L1)",
    "example same engine",
    "lmtier disk, page cache dropped",
    "lmcache disk, page cache dropped",
    "example new engine, page cache dropped",
    "example new engine",
    "example cold (storing)",
    "lmcache cold (storing)",
]


def summarize(b: Bench) -> list[dict[str, Any]]:
    a = b.args
    th = a.load_threshold
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in b.records:
        groups.setdefault((r["system"], r["n"]), []).append(r)
    rows = []
    cold_med: dict[int, float] = {}
    for (system, n), recs in groups.items():
        calm = [r for r in recs if b.round_load.get((r["phase"], r["round"]), 99) <= th]
        use = calm if len({(r["phase"], r["round"]) for r in calm}) >= a.rounds else recs
        hits = [r for r in use if not r.get("miss")]
        vals = [r["ttft_ms"] for r in (hits or use)]  # requests that missed their expected hit are not medianed
        row = {
            "system": system,
            "n": n,
            "median_ms": statistics.median(vals),
            "samples": len(vals),
            "rounds": len({(r["phase"], r["round"]) for r in use}),
            "only_calm": use is calm,
            "min_ms": min(vals),
            "max_ms": max(vals),
            "load_median": statistics.median(r["load1"] for r in use),
            "load_max": max(r["load1"] for r in use),
            "other_load_median": statistics.median(r.get("other_load", -1) for r in use),
            "misses": sum(1 for r in use if r.get("miss")),
            "cached_median": statistics.median([r["cached"] or 0 for r in use]),
        }
        rows.append(row)
        if system == "cold":
            cold_med[n] = row["median_ms"]
    for row in rows:
        c = cold_med.get(row["n"])
        row["ratio_to_cold"] = row["median_ms"] / c if c else None
        if row["system"] == "0% reuse lmtier":
            ref = next((r for r in rows if r["system"] == "0% reuse base" and r["n"] == row["n"]), None)
            row["overhead_vs_base"] = row["median_ms"] / ref["median_ms"] - 1 if ref else None
        if row["system"] == "lmtier cold (storing)":
            row["overhead_vs_base"] = row["median_ms"] / c - 1 if c else None
    rows.sort(key=lambda r: (ORDER.index(r["system"]) if r["system"] in ORDER else 99, r["n"]))
    return rows


def print_table(b: Bench, rows: list[dict[str, Any]]) -> None:
    sizes = b.args.size_list
    systems = list(dict.fromkeys(r["system"] for r in rows))
    cell = {(r["system"], r["n"]): r for r in rows}
    w = 40
    hdr = f"{'system':<{w}}" + "".join(f"{'N=' + str(n):>28}" for n in sizes)
    print("\n" + hdr)
    print(" " * w + "".join(f"{'ms  (x cold)  load/others':>28}" for _ in sizes))
    print("-" * len(hdr))
    for s in systems:
        line = f"{s:<{w}}"
        for n in sizes:
            r = cell.get((s, n))
            if r is None and s.startswith("0% reuse"):
                r = next((x for x in rows if x["system"] == s), None) if n == sizes[0] else None
            if r is None:
                line += f"{'-':>28}"
                continue
            ratio = f"{r['ratio_to_cold']:.3f}" if r.get("ratio_to_cold") and not s.startswith("0% reuse") else "  -  "
            flag = "" if r["only_calm"] else "*"
            miss = f"!{r['misses']}" if r["misses"] else ""
            loads = f"{r['load_median']:>4.1f}/{r['other_load_median']:<4.1f}"
            line += f"{r['median_ms']:>9.1f} ({ratio:>5}) {loads}{flag}{miss}".rjust(28)
        print(line)
    print(
        "\nmedians over rounds (phase A and B rounds for 'cold'); ratio = median / cold median at the same N; "
        "load = median 1-min load average at the requests; others = median 1-min average of runnable threads outside "
        f"this benchmark's process tree; * = fewer than {b.args.rounds} calm rounds "
        f"(load <= {b.args.load_threshold}), all rounds used; !k = k requests without the expected hit. "
        f"0% reuse rows: N = {b.args.reuse_n} (+64), {b.args.reuse_prompts} distinct prompts per round."
    )
    for r in rows:
        if "overhead_vs_base" in r and r["overhead_vs_base"] is not None:
            print(f"overhead: {r['system']} N={r['n']}: {100 * r['overhead_vs_base']:+.1f} % vs no connector")


def targets(b: Bench, rows: list[dict[str, Any]]) -> list[str]:
    cell = {(r["system"], r["n"]): r for r in rows}
    out = []
    peers_cpu = ["lmcache CPU (L1)", "example same engine", "example new engine"]
    peers_disk = ["lmcache disk, page cache dropped", "example new engine, page cache dropped"]
    for n in b.args.size_list:
        for mine, peers, bound in (
            ("lmtier warm CPU", peers_cpu + peers_disk, 0.025),
            ("lmtier disk, page cache dropped", peers_disk, 0.05),
        ):
            m = cell.get((mine, n))
            if not m:
                continue
            msg = f"{mine} N={n}: {m['median_ms']:.1f} ms = {m['ratio_to_cold']:.3f} x cold"
            if n == max(b.args.size_list):
                msg += f" ({'MET' if m['ratio_to_cold'] <= bound else 'MISSED'} <= {bound})"
            best = [(p, cell[(p, n)]["median_ms"]) for p in peers if (p, n) in cell]
            if best:
                p, v = min(best, key=lambda x: x[1])
                msg += f"; best peer {p} {v:.1f} ms -> {'lower (MET)' if m['median_ms'] < v else 'NOT lower (MISSED)'}"
            out.append(msg)
    return out
