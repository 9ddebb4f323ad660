"""The soak's report (tests/soak/run_soak.py): the JSON result, the table on stdout and the verdict."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.soak.harness import Soak
    from tests.soak.workload import Prompt

__all__ = ["pct", "report", "region_summary", "print_report", "verdict"]


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return math.nan
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def report(s: Soak, prompts: list[Prompt]) -> dict[str, Any]:
    a = s.a
    recs = s.records
    done = [r for r in recs if r.get("ok")]
    errors = [r for r in recs if r.get("error")]
    wrong = [r for r in done if r.get("wrong")]
    wrong_ctl = [r for r in wrong if r["control"]]
    wrong_hit = [r for r in wrong if not r["control"] and (r.get("cached") or 0) > 0]
    lost = [r for r in recs if not r.get("ok") and r.get("status") is None]  # never answered
    hangs = [r for r in recs if r.get("hang")] + [None] * getattr(s, "hung_clients", 0)
    ttft = [r["ttft"] for r in done if r.get("ttft") is not None]
    no_fault_ttft = [r["ttft"] for r in done if r.get("ttft") is not None and not r["faults"]]
    hit_recs = [r for r in done if not r["control"]]
    prompt_tokens = {p.pid: len(p.ids) for p in prompts}
    hit_rate = sum(r.get("cached") or 0 for r in hit_recs) / max(1, sum(prompt_tokens[r["pid"]] for r in hit_recs))
    samples = [x for x in s.samples if "rss_mb" in x]
    rss = [x["rss_mb"] for x in samples]
    fds = [x["fds"] for x in samples]
    # growth check over the second half of the load (pools full by then), last server generation
    last_gen = [x for x in samples if x["gen"] == s.server_gen]
    half = [x for x in last_gen if x["t"] >= (s.load_t0 + s.load_t1) / 2]
    # per server generation (a server_kill fault restarts the server); the summary shown is the generation
    # with the most region samples (the longest-lived server), each generation's is in "by_generation"
    gens: dict[int, list[dict[str, Any]]] = {}
    for x in samples:
        if "worker" in x:
            gens.setdefault(x["gen"], []).append(x)
    by_gen = {g: region_summary(v, (v[0]["t"] + v[-1]["t"]) / 2) for g, v in gens.items()}
    regions = (
        dict(
            by_gen[max(gens, key=lambda g: len(gens[g]))],
            generation=max(gens, key=lambda g: len(gens[g])),
            by_generation=by_gen,
        )
        if gens
        else {}
    )
    by_fault: dict[str, dict[str, Any]] = {}
    for ep in s.episodes:
        d = by_fault.setdefault(
            ep.fault,
            {
                "episodes": 0,
                "recovered": 0,
                "outcomes": {},
                "requests": 0,
                "errors": 0,
                "wrong": 0,
                "interrupted": 0,
                "max_ttft_s": 0.0,
                "details": [],
            },
        )
        d["episodes"] += 1
        d["recovered"] += ep.recovered
        d["outcomes"][ep.outcome] = d["outcomes"].get(ep.outcome, 0) + 1
        t_end = ep.t_end if not math.isnan(ep.t_end) else math.inf
        during = [r for r in recs if ep.t0 <= r["t_send"] <= t_end]  # sent between inject and the verdict
        d["requests"] += len(during)
        d["errors"] += sum(1 for r in during if r.get("error"))
        d["wrong"] += sum(1 for r in during if r.get("wrong"))
        d["interrupted"] += sum(r["interrupted"] for r in during)
        t = [r["ttft"] for r in recs if ep.t0 <= r["t_send"] <= ep.t1 and r.get("ttft") is not None]
        d["max_ttft_s"] = max(d["max_ttft_s"], max(t) if t else 0.0)
        d["details"].append(
            {
                "rep": ep.rep,
                "t0": round(ep.t0, 1),
                "t1": round(ep.t1, 1),
                "t_end": round(ep.t_end, 1),
                "outcome": ep.outcome,
                "recovered": ep.recovered,
                "verdict": ep.verdict,
                "requests_during": ep.requests_during,
                "requests_after": ep.requests_after,
                "controls_after": ep.controls_after,
                **ep.detail,
            }
        )
    hits = s.hits()
    out = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "uname": " ".join(os.uname())},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "prompts": {
            "n": len(prompts),
            "shared": sum(p.kind == "shared" for p in prompts),
            "tokens_min": min(prompt_tokens.values()),
            "tokens_max": max(prompt_tokens.values()),
        },
        "load_s": s.load_t1 - s.load_t0,
        "run_s": time.monotonic() - s.t0,
        "requests": len(recs),
        "served": len(done),
        "errors": len(errors),
        "lost": len(lost),
        "hangs": len(hangs),
        "wrong": len(wrong),
        "wrong_controls": len(wrong_ctl),
        "wrong_with_hits": len(wrong_hit),
        "controls": sum(r["control"] for r in done),
        "interrupted_attempts": sum(r["interrupted"] for r in recs),
        "http_non200": sum(1 for r in recs if r.get("status") not in (None, 200)),
        "finish_error": sum(1 for r in recs if r.get("finish") == "error"),
        "ttft_s": {
            "p50": pct(ttft, 0.5),
            "p99": pct(ttft, 0.99),
            "max": max(ttft) if ttft else math.nan,
            "no_fault_p50": pct(no_fault_ttft, 0.5),
            "no_fault_p99": pct(no_fault_ttft, 0.99),
            "no_fault_max": max(no_fault_ttft) if no_fault_ttft else math.nan,
        },
        "remote_timeout_s": a.remote_timeout,
        "hit_rate_tokens": hit_rate,
        "hit_tokens_by_tier": hits,
        "load_failures": s.metric_sum("vllm:lmtier_load_failures_total"),
        "stored_chunks": s.metric_sum("vllm:lmtier_stored_chunks_total"),
        "rss_mb": {
            "min": min(rss, default=math.nan),
            "max": max(rss, default=math.nan),
            "second_half_first": half[0]["rss_mb"] if half else math.nan,
            "second_half_last": half[-1]["rss_mb"] if half else math.nan,
        },
        "worker_regions_mb": regions,
        "malloc": {"setting": a.malloc, "onednn_cache": a.onednn_cache, "server_env": s.server_env},
        "fds": {
            "min": min(fds, default=0),
            "max": max(fds, default=0),
            "second_half_first": half[0]["fds"] if half else None,
            "second_half_last": half[-1]["fds"] if half else None,
        },
        "pools": {
            "cpu_pool_gib": a.cpu_gib,
            "vllm_kv_gib": a.kv_space_gib,
            "disk_fs_mib": a.disk_fs_mib,
            "remote": a.remote,
            "redis_maxmemory_mib": a.redis_maxmemory_mib if a.remote == "redis" else None,
            "mooncake_segment_mib": a.mooncake_segment_mib if a.remote == "mooncake" else None,
        },
        "faults": by_fault,
        "skipped_faults": s.skipped_faults,
        "episodes_recovered": sum(e.recovered for e in s.episodes),
        "episodes_too_slow": sum(e.outcome == "too_slow" for e in s.episodes),
        "episodes": len(s.episodes),
        "min_served": s.min_served(),
        "warmup": s.warmup,
        "startup_s": s.startup_s,
        "notes": s.notes,
        "samples": s.samples,
        "wrong_records": wrong[:20],
        "error_records": errors[:20],
    }
    return out


def region_summary(samples: list[dict[str, Any]], t_half: float) -> dict[str, Any]:
    """Per region of the worker's anonymous memory (MiB; samples of one server generation): first sample,
    max, last, and first -> last over the second half (t >= ``t_half``)."""
    if not samples:
        return {}
    keys = [k for k in samples[0]["worker"] if k != "pid"]
    half = [x for x in samples if x["t"] >= t_half] or samples[-1:]
    out: dict[str, Any] = {"n_samples": len(samples), "t_first": samples[0]["t"], "t_last": samples[-1]["t"]}
    for k in keys:
        v = [x["worker"][k] for x in samples]
        out[k] = {
            "first": v[0],
            "max": max(v),
            "last": v[-1],
            "second_half_first": half[0]["worker"][k],
            "second_half_last": half[-1]["worker"][k],
        }
    return out


def print_report(r: dict[str, Any]) -> None:
    t = r["ttft_s"]
    print()
    print(
        f"load: {r['args']['clients']} clients for {r['load_s']:.0f}s, {r['prompts']['n']} prompts "
        f"({r['prompts']['shared']} with shared prefixes, "
        f"{r['prompts']['tokens_min']}-{r['prompts']['tokens_max']} tokens), "
        f"max_tokens {r['args']['max_tokens']}"
    )
    print(
        f"requests served {r['served']} / sent {r['requests']}  errors {r['errors']} (HTTP non-200 {r['http_non200']}, "
        f"finish_reason error {r['finish_error']})  lost {r['lost']}  hangs {r['hangs']}  "
        f"interrupted by SIGKILL and retried {r['interrupted_attempts']}"
    )
    print(
        f"wrong outputs {r['wrong']} (of them controls {r['wrong_controls']}, with lmtier hits {r['wrong_with_hits']}; "
        f"{r['controls']} control requests)"
    )
    print(
        f"TTFT p50 {t['p50']:.2f}s p99 {t['p99']:.2f}s max {t['max']:.2f}s (no fault active: p50 "
        f"{t['no_fault_p50']:.2f}s "
        f"p99 {t['no_fault_p99']:.2f}s max {t['no_fault_max']:.2f}s); remote {r['pools']['remote']}, "
        f"timeout {r['remote_timeout_s']}s"
    )
    hb = r["hit_tokens_by_tier"]
    print(
        f"hit rate {100 * r['hit_rate_tokens']:.1f}% of prompt tokens (non-control); hit tokens cpu "
        f"{hb.get('cpu', 0):.0f} "
        f"disk {hb.get('disk', 0):.0f} remote {hb.get('remote', 0):.0f}; load failures (recomputed) "
        f"{r['load_failures']:.0f}; stored chunks {r['stored_chunks']:.0f}"
    )
    rm, fd = r["rss_mb"], r["fds"]
    print(
        f"server RSS {rm['min']:.0f}-{rm['max']:.0f} MiB (second half {rm['second_half_first']:.0f} -> "
        f"{rm['second_half_last']:.0f}); open fds {fd['min']}-{fd['max']} (second half {fd['second_half_first']} -> "
        f"{fd['second_half_last']}); pools: CPU {r['pools']['cpu_pool_gib']} GiB, "
        f"vLLM KV {r['pools']['vllm_kv_gib']} GiB; "
        f"server env {r['malloc']['server_env'] or '(glibc, oneDNN defaults)'}"
    )
    reg = r.get("worker_regions_mb") or {}
    if reg:
        names = [k for k in reg if isinstance(reg[k], dict) and k != "by_generation"]
        print(
            f"worker anonymous memory by region, MiB (server generation {reg['generation']}, the longest-lived, "
            f"{reg['n_samples']} samples, t {reg['t_first']:.0f}-{reg['t_last']:.0f}s): first / max / last; "
            f"second half of that generation first -> last"
        )
        for k in names:
            d = reg[k]
            print(
                f"  {k:<9} {d['first']:7.0f} / {d['max']:7.0f} / {d['last']:7.0f};  {d['second_half_first']:7.0f} -> "
                f"{d['second_half_last']:7.0f} ({d['second_half_last'] - d['second_half_first']:+.0f})"
            )
        pool_cfg = r["pools"]["cpu_pool_gib"] * 1024
        p, tot = reg.get("pool"), reg["total"]
        if p and p["max"] >= 0.5 * pool_cfg:  # the pool's own mapping (glibc); under tcmalloc it is inside "heap"
            rest = (tot["second_half_first"] - p["second_half_first"], tot["second_half_last"] - p["second_half_last"])
            print(
                f"  lmtier CPU pool mapping max {p['max']:.0f} MiB (configured {pool_cfg:.0f} MiB: "
                f"{'within' if p['max'] <= pool_cfg + 1 else 'ABOVE'}); rest of the worker second half "
                f"{rest[0]:.0f} -> {rest[1]:.0f} MiB ({rest[1] - rest[0]:+.0f})"
            )
        else:
            print(
                f"  lmtier CPU pool: no mapping of its own (an allocator such as tcmalloc carved it from its heap); "
                f"whole worker second half {tot['second_half_first']:.0f} -> {tot['second_half_last']:.0f} MiB "
                f"({tot['second_half_last'] - tot['second_half_first']:+.0f}), configured pool {pool_cfg:.0f} MiB"
            )
        for g, d in sorted(reg.get("by_generation", {}).items()):
            if "total" in d:
                print(
                    f"  generation {g}: t {d['t_first']:.0f}-{d['t_last']:.0f}s, {d['n_samples']} samples, "
                    f"worker total first {d['total']['first']:.0f} / max {d['total']['max']:.0f} / "
                    f"last {d['total']['last']:.0f} MiB"
                )
    print()
    hdr = (
        f"{'fault':<14} {'episodes':>8} {'recovered':>9} {'too slow':>8} {'requests':>8} {'errors':>6} "
        f"{'wrong':>5} {'interrupted':>11} {'max TTFT':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, d in r["faults"].items():
        print(
            f"{name:<14} {d['episodes']:>8} {d['recovered']:>9} {d['outcomes'].get('too_slow', 0):>8} "
            f"{d['requests']:>8} {d['errors']:>6} {d['wrong']:>5} {d['interrupted']:>11} {d['max_ttft_s']:>8.2f}s"
        )
    for name, why in r["skipped_faults"].items():
        print(f"{name:<14} skipped: {why}")
    print()
    for name, d in r["faults"].items():
        for e in d["details"]:
            extra = {
                k: v for k, v in e.items() if k not in ("rep", "t0", "t1", "t_end", "recovered", "outcome", "verdict")
            }
            print(
                f"  {name} #{e['rep']} [fault {e['t0']:.0f}-{e['t1']:.0f}s, judged {e['t_end']:.0f}s] "
                f"{e['outcome']}: {e['verdict']} {extra}"
            )
    w = r["warmup"]
    print(
        f"  warm-up: {w['served']} requests in {w['s']:.0f}s"
        + (" (capped)" if w["capped"] else "")
        + f"; requests served {r['served']}, at least {r['min_served']} needed by the warm-up and episodes run"
    )
    for n in r["notes"]:
        print(f"note: {n}")


def verdict(r: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(failed checks, inconclusive episodes)``: wrong, lost, hangs and errors must be 0, every episode
    recovered and at least ``min_served`` requests served; an episode whose cap was hit before enough
    requests were observed ("machine too slow to observe recovery") is inconclusive, not a failure."""
    bad = []
    for k in ("wrong", "lost", "hangs", "errors"):
        if r[k]:
            bad.append(f"{k} = {r[k]}")
    slow = []
    for name, d in r["faults"].items():
        for e in d["details"]:
            if e["outcome"] == "too_slow":
                slow.append(f"{name} #{e['rep']}: {e['verdict']}")
            elif e["outcome"] != "recovered":
                bad.append(f"{name} #{e['rep']}: {e['outcome']}: {e['verdict']}")
    if r["served"] < r["min_served"]:
        bad.append(f"served {r['served']} requests < {r['min_served']} counted by the warm-up and episodes")
    return bad, slow
