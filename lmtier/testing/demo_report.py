"""The demo's results and report (``scripts/demo.py``): what one pass of the workload over one
server measured (:class:`PassResult`), the rows scenario x phase with the failed checks
(:func:`summarize`: outputs equal to the baseline, warm lmtier phases with hits, each shared-store
node B loading from its store), the table (:func:`print_table`) and the metric deltas
(:func:`print_metrics`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmtier.testing.demo_workload import Req
from lmtier.testing.server import hits_by_source
from lmtier.testing.stores import SHARED_SOURCE, SHARED_STORES

__all__ = ["WARM_PHASE_PREFIXES", "DemoRun", "PassResult", "print_metrics", "print_table", "summarize"]

WARM_PHASE_PREFIXES = ("lmtier warm", "restart warm") + tuple(f"{k}: B" for k in SHARED_STORES)
"""Passes that must report cached tokens (lmtier hits)."""


@dataclass
class PassResult:
    phase: str
    server: str
    records: list[dict[str, Any]] = field(default_factory=list)
    loadavg: tuple[float, float] = (0.0, 0.0)  # 1-min load average before / after the pass
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # scenario -> metric deltas


class DemoRun(Protocol):
    """What the report reads of a demo run (``scripts/demo.py``'s ``Demo``): its passes, in the
    order they ran (the first is the baseline), and its requests."""

    passes: list[PassResult]
    reqs: list[Req]


def p99(values: list[float]) -> float:
    v = sorted(values)
    if not v:
        return math.nan
    k = (len(v) - 1) * 0.99
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(demo: DemoRun) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows scenario x phase, and a list of failed checks."""
    ref = {(r["scenario"], r["name"]): r for r in demo.passes[0].records} if demo.passes else {}
    base_mean: dict[str, float] = {}
    rows, failures = [], []
    scenarios = list(dict.fromkeys(r.scenario for r in demo.reqs))
    for sc in scenarios:
        for p in demo.passes:
            recs = [r for r in p.records if r["scenario"] == sc]
            if not recs:
                continue
            ttft = [r["ttft_ms"] for r in recs]
            mean = sum(ttft) / len(ttft)
            base_mean.setdefault(sc, mean)
            same = sum(1 for r in recs if ref.get((sc, r["name"]), {}).get("token_ids") == r["token_ids"])
            for r in recs:
                r["equal_to_baseline"] = ref.get((sc, r["name"]), {}).get("token_ids") == r["token_ids"]
            cached = [r["cached_tokens"] for r in recs]
            delta = p.metrics.get(sc, {})
            ext = sum(v for k, v in delta.items() if k.startswith("vllm:external_prefix_cache_hits"))
            row = {
                "scenario": sc,
                "phase": p.phase,
                "server": p.server,
                "n": len(recs),
                "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
                "ttft_mean_ms": mean,
                "ttft_p99_ms": p99(ttft),
                "speedup_vs_baseline": base_mean[sc] / mean if mean else math.nan,
                "cached_tokens": None if any(c is None for c in cached) else sum(cached),
                "external_hits_metric": int(ext),
                "hits_by_source": hits_by_source(delta),
                "load_failures": int(delta.get("vllm:lmtier_load_failures_total", 0)),
                "lmtier_metrics": {k: v for k, v in delta.items() if "lmtier" in k.lower()},
                "equal": same,
                "loadavg": p.loadavg,
            }
            rows.append(row)
            if same != len(recs):
                failures.append(f"{sc} / {p.phase}: {len(recs) - same} of {len(recs)} outputs differ from the baseline")
            warm = p.phase.startswith(WARM_PHASE_PREFIXES)
            if warm and not (row["cached_tokens"] or row["external_hits_metric"]):
                failures.append(f"{sc} / {p.phase}: no cached tokens reported (expected lmtier hits)")
            kind = p.phase.split(":", 1)[0]
            if kind in SHARED_SOURCE and p.phase.startswith(f"{kind}: B"):
                row["hits_by_tier"] = lmtier_hits_by_tier(delta)
                if not row["hits_by_tier"].get(SHARED_SOURCE[kind]):
                    failures.append(
                        f"{sc} / {p.phase}: no tokens claimed from the {SHARED_SOURCE[kind]} tier "
                        f"(lmtier hits by tier: {row['hits_by_tier'] or 'none'}): node A's chunks were not used"
                    )
    return rows, failures


def lmtier_hits_by_tier(delta: dict[str, float]) -> dict[str, int]:
    """Claimed prompt tokens per lmtier tier (``vllm:lmtier_hit_tokens_total{tier}`` deltas)."""
    out: dict[str, int] = {}
    for k, v in delta.items():
        m = re.match(r'vllm:lmtier_hit_tokens_total\{.*tier="([^"]*)"', k)
        if m and v:
            out[m.group(1)] = out.get(m.group(1), 0) + int(v)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    hdr = (
        f"{'scenario':<10} {'phase':<20} {'n':>2} {'prompt':>6} {'TTFT mean':>10} {'TTFT P99':>9} {'speedup':>7} "
        f"{'cached':>7} {'by source (metrics)':<36} {'= baseline':>10}"
    )
    print()
    print(hdr)
    print("-" * len(hdr))
    last = None
    for r in rows:
        if last is not None and r["scenario"] != last:
            print()
        last = r["scenario"]
        src = ", ".join(f"{k}:{v}" for k, v in sorted(r["hits_by_source"].items())) or (
            f"external:{r['external_hits_metric']}" if r["external_hits_metric"] else "-"
        )
        cached = "?" if r["cached_tokens"] is None else str(r["cached_tokens"])
        print(
            f"{r['scenario']:<10} {r['phase']:<20} {r['n']:>2} {r['prompt_tokens']:>6} "
            f"{r['ttft_mean_ms']:>8.0f}ms {r['ttft_p99_ms']:>7.0f}ms {r['speedup_vs_baseline']:>6.1f}x "
            f"{cached:>7} {src:<36} {str(r['equal']) + '/' + str(r['n']):>10}"
        )
    print()
    print(
        "TTFT = time to the first streamed token (ms). speedup = baseline-cold mean / this mean. "
        "prompt / cached = prompt tokens and cached prompt tokens (usage.prompt_tokens_details) summed over "
        "the scenario's requests. by source = vllm:prompt_tokens_cached_by_source deltas. "
        "= baseline: greedy token ids identical to the no-lmtier run."
    )


def print_metrics(demo: DemoRun) -> None:
    print(
        "\nMetric deltas per phase (lines of /metrics with lmtier or the prefix-cache counters; labels "
        "engine/model_name dropped):"
    )
    for p in demo.passes:
        agg: dict[str, float] = {}
        for d in p.metrics.values():
            for k, v in d.items():
                base = k.split("{", 1)[0]
                agg[k] = agg.get(k, 0) + v if base.endswith(("_total", "_sum", "_count")) else v
        print(f"  {p.phase} ({p.server}):")
        if not agg:
            print("    (none)")
        for k in sorted(agg):
            print(f"    {k} = {agg[k]:g}")
