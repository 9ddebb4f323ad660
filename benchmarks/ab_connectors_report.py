"""The report of benchmarks/ab_connectors.py: per-system TTFT medians with distribution-free 95 %
confidence intervals of the median (:func:`binom_ci`), paired per-round ratios against the first
system and bootstrap intervals of the ratio of medians (:func:`bootstrap_ratio`), over all rounds and
over the clean rounds (little CPU used outside the measured server: :func:`interference`), per server
generation, and per turn with ``--pairs-in-turn`` (:func:`report_turns`; rounds numbered by
:data:`TURN_ROUNDS`).
"""

from __future__ import annotations

import argparse
import random
import statistics
from math import comb
from typing import Any


def binom_ci(xs: list[float], conf: float = 0.95) -> tuple[float, float]:
    """Distribution-free CI of the median: order statistics (k, n-k+1) with binomial coverage >= conf."""
    xs = sorted(xs)
    n = len(xs)
    if n < 6:
        return (xs[0], xs[-1])
    best = (xs[0], xs[-1])
    for k in range(1, n // 2 + 1):
        cover = 1 - 2 * sum(comb(n, i) for i in range(k)) / 2**n  # P(x_(k) <= median <= x_(n-k+1))
        if cover < conf:
            break
        best = (xs[k - 1], xs[n - k])
    return best


def bootstrap_ratio(a: list[float], b: list[float], reps: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of median(a)/median(b), rounds resampled in pairs."""
    rng = random.Random(seed)
    n = len(a)
    rs = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        rs.append(statistics.median(a[i] for i in idx) / statistics.median(b[i] for i in idx))
    rs.sort()
    return rs[int(0.025 * reps)], rs[int(0.975 * reps) - 1]


def interference(r: dict[str, Any]) -> float:
    """CPU seconds used outside the measured server while its request ran."""
    return r.get("cpu_other_servers_s", 0.0) + r.get("cpu_rest_s", 0.0)


def compare(a: argparse.Namespace, by: dict[str, dict[int, dict]], rounds: list[int], title: str) -> dict[str, Any]:
    systems = a.system_list
    ref = systems[0]
    out: dict[str, Any] = {"rounds": len(rounds), "systems": {}}
    print(
        f"\n{title}: {len(rounds)} paired rounds; TTFT ms (median, distribution-free 95 % CI of the median, "
        f"min..max), medians of the per-request figures"
    )
    if len(rounds) < 3:
        print("  (too few rounds)")
        return out
    for s in systems:
        v = [by[s][r]["ttft_ms"] for r in rounds]
        lo, hi = binom_ci(v)
        extra = {
            k: statistics.median(by[s][r].get(k, 0.0) for r in rounds)
            for k in ("prefill_ms", "server_ttft_ms", "store_ms", "load_ms", "cpu_self_s")
        }
        extra["interference_s"] = statistics.median(interference(by[s][r]) for r in rounds)
        la = [by[s][r]["loadavg"][0] for r in rounds]
        row = {
            "median_ms": statistics.median(v),
            "ci": [lo, hi],
            "min": min(v),
            "max": max(v),
            "misses": sum(1 for r in rounds if by[s][r].get("miss")),
            "load1_median": statistics.median(la),
            "load1_max": max(la),
            **{f"{k}_median": x for k, x in extra.items()},
        }
        if s != ref:
            rr = [by[s][r]["ttft_ms"] / by[ref][r]["ttft_ms"] for r in rounds]
            row["paired_ratio_median"] = statistics.median(rr)
            row["paired_ratio_ci"] = list(binom_ci(rr))
            row["ratio_of_medians"] = row["median_ms"] / statistics.median(by[ref][r]["ttft_ms"] for r in rounds)
            row["ratio_of_medians_boot_ci"] = list(bootstrap_ratio(v, [by[ref][r]["ttft_ms"] for r in rounds]))
            row["rounds_faster"] = sum(1 for x in rr if x < 1)
        out["systems"][s] = row
        line = (
            f"  {s:<30} {row['median_ms']:8.1f}  [{lo:7.1f}, {hi:7.1f}]  {row['min']:7.1f}..{row['max']:7.1f}"
            f"  prefill {extra['prefill_ms']:7.1f}  server-TTFT {extra['server_ttft_ms']:7.1f}"
            f"  store {extra['store_ms']:5.1f}  load {extra['load_ms']:5.1f}  cpu {extra['cpu_self_s']:.2f} s"
            f"  outside {extra['interference_s']:.2f} s  load1 {row['load1_median']:.2f}/{row['load1_max']:.2f}"
        )
        if row["misses"]:
            line += f"  MISSES {row['misses']}"
        print(line)
    for i, s in enumerate(systems[1:], 1):  # the other pairs, e.g. lmtier / example
        for t in systems[1:i]:
            rr = [by[s][r]["ttft_ms"] / by[t][r]["ttft_ms"] for r in rounds]
            lo, hi = binom_ci(rr)
            pm = statistics.median(rr)
            out["systems"][s][f"paired_ratio_vs_{t}"] = [pm, lo, hi]
            print(
                f"  {s} / {t}: paired ratio median {pm:.4f} (95 % CI {lo:.4f}..{hi:.4f}, {100 * (pm - 1):+.1f} %); "
                f"faster in {sum(1 for x in rr if x < 1)}/{len(rounds)} rounds"
            )
    for s in systems[1:]:
        row = out["systems"][s]
        pr, (plo, phi) = row["paired_ratio_median"], row["paired_ratio_ci"]
        blo, bhi = row["ratio_of_medians_boot_ci"]
        print(
            f"  {s} / {ref}: paired ratio median {pr:.4f} (95 % CI {plo:.4f}..{phi:.4f}, {100 * (pr - 1):+.1f} %); "
            f"ratio of medians {row['ratio_of_medians']:.4f} (bootstrap 95 % {blo:.4f}..{bhi:.4f}); "
            f"faster in {row['rounds_faster']}/{len(rounds)} rounds"
        )
    return out


def report(a: argparse.Namespace, records: list[dict[str, Any]]) -> dict[str, Any]:
    kind = "cold" if a.mode == "cold" else "warm"
    systems = a.system_list
    reps: dict[str, dict[int, list[dict]]] = {s: {} for s in systems}
    for r in records:
        if r["kind"] == kind:
            reps[r["system"]].setdefault(r["round"], []).append(r)
    # a round's figure per system: its only request, or with --warm-reps the median of its requests
    # (every per-request figure medianed on its own)
    by: dict[str, dict[int, dict]] = {s: {} for s in systems}
    for s, per in reps.items():
        for rnd, rs in per.items():
            if len(rs) == 1:
                by[s][rnd] = rs[0]
            else:
                m = {
                    k: statistics.median(x[k] for x in rs)
                    for k in rs[0]
                    if isinstance(rs[0][k], (int, float)) and not isinstance(rs[0][k], bool)
                }
                m["loadavg"] = [max(x["loadavg"][0] for x in rs)]
                m["miss"] = any(x.get("miss") for x in rs)
                by[s][rnd] = m
    rounds = sorted(set.intersection(*(set(v) for v in by.values())))
    out: dict[str, Any] = {"n": a.n, "mode": a.mode, "gap_s": a.gap}
    out["all"] = compare(a, by, rounds, f"N = {a.n}, mode {a.mode}, all rounds")
    # Rounds in which no request of any system shared the cores with more than --clean-cpu CPU seconds
    # of other work (other servers' idle loops, other jobs): the calm subset.
    # (CPU times come in 10 ms ticks: a short request is allowed 3 ticks whatever its length)
    clean = [
        r
        for r in rounds
        if all(interference(by[s][r]) <= max(0.03, a.clean_frac * by[s][r]["ttft_ms"] / 1e3) for s in systems)
    ]
    out["clean"] = compare(
        a,
        by,
        clean,
        f"N = {a.n}, mode {a.mode}, clean rounds (CPU used outside the measured "
        f"server <= {a.clean_frac} cores, at least 30 ms allowed, during every request)",
    )
    gens = sorted({by[systems[0]][r].get("generation", 0) for r in rounds})
    if len(gens) > 1:
        ref = systems[0]
        for s in systems[1:]:
            per = []
            for g in gens:
                rr = [
                    by[s][r]["ttft_ms"] / by[ref][r]["ttft_ms"] for r in rounds if by[ref][r].get("generation", 0) == g
                ]
                if rr:
                    per.append(statistics.median(rr))
            out.setdefault("per_generation", {})[s] = per
            print(
                f"  {s} / {ref} per server generation (paired ratio medians): "
                + ", ".join(f"{100 * (x - 1):+.1f} %" for x in per)
            )
    if a.mode == "warm":  # the storing requests of warm mode are cold prefills too
        st = {s: [r["ttft_ms"] for r in records if r["system"] == s and r["kind"] == "store"] for s in systems}
        print(
            "  storing (cold) requests of the same rounds: "
            + ", ".join(f"{s} {statistics.median(v):.1f}" for s, v in st.items() if v)
        )
    return out


TURN_ROUNDS = 1000
"""--pairs-in-turn: turn t's rounds are numbered from t x TURN_ROUNDS (new prompts every turn)."""


def report_turns(a: argparse.Namespace, turns: list[list[str]], records: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`report` per turn (its systems, its rounds), then with several turns each two-node
    system's warm TTFT against the first system (B cold) of its own rounds, side by side."""
    if len(turns) == 1:
        a.system_list = turns[0]
        return report(a, records)
    out: dict[str, Any] = {"turns": {}}
    for t, systems in enumerate(turns):
        a.system_list = systems
        mine = [r for r in records if r["system"] in systems and t * TURN_ROUNDS <= r["round"] < (t + 1) * TURN_ROUNDS]
        if mine:
            out["turns"][systems[-1]] = report(a, mine)
    print(f"\nN = {a.n}: each two-node system's node B warm vs {turns[0][0]} in the same rounds (all rounds):")
    for pair, rep in out["turns"].items():
        row = rep.get("all", {}).get("systems", {}).get(pair)
        ref = rep.get("all", {}).get("systems", {}).get(turns[0][0])
        if row and ref and "paired_ratio_median" in row:
            lo, hi = row["paired_ratio_ci"]
            print(
                f"  {pair:<10} B warm {row['median_ms']:8.1f} ms, {turns[0][0]} {ref['median_ms']:8.1f} ms: "
                f"paired ratio {row['paired_ratio_median']:.3f} (95 % CI {lo:.3f}..{hi:.3f}), "
                f"{rep['all']['rounds']} rounds, load1 median {row['load1_median']:.1f}"
            )
    return out
