"""The user's serving benchmark on vLLM 0.33's own engine on a GPU, per KV-offloading case.

The user's guide runs ``vllm bench serve --dataset-name random --random-input-len 7500
--random-output-len 200 --request-rate 3.6`` twice (cold, then warm) and reads mean / P99 TTFT,
output token throughput and preemptions. This runs the same shape through vLLM's engine in-process
(``LLM(...).llm_engine``: ``add_request`` at Poisson arrival times, ``step()`` in a loop — what the
server's engine-core loop does, without HTTP and IPC), one engine process per case:

* ``none``        — vLLM's prefix cache alone (no connector);
* ``lmtier_cpu``  — ``LMTierConnector``, CPU tier (``--cpu-gib``);
* ``native_cpu``  — vLLM's own ``OffloadingConnector`` (``kv_offloading_size=--cpu-gib``, backend
  ``native``), the same-run peer;
* ``lmtier_disk`` — lmtier CPU tier of ``--small-cpu-gib`` + disk tier (``--disk-dir``);
* ``lmtier_codec``— the same with the disk records through the codec (``local_disk_serde: cachegen``);
* ``lmtier_cpu_nolw`` — ``lmtier_cpu`` with ``layerwise_loads: false`` (CPU hits copied whole before
  the forward instead of layer by layer);
* ``native_fs``   — vLLM's ``OffloadingConnector`` with its tiering spec: a CPU tier of
  ``--small-cpu-gib`` and the ``fs`` secondary tier in ``--disk-dir`` (vLLM's Python I/O path: its
  compiled ``fs_io_C`` is not carried);
* ``lmtier_redis_codec`` — lmtier CPU tier of ``--small-cpu-gib`` + a Redis remote tier through the
  codec (``remote_serde: cachegen``) on a ``redis-server`` this process starts on loopback.

Instrumentation (every case alike, per pass): each connector hook's wall and thread-CPU time
(``hook_timers.HookTimers`` on the connector class), the host time of vLLM's ``Scheduler.schedule`` /
``update_from_output``, Python's garbage-collection pauses (``gc.callbacks``), and step wall times
split into decode-only steps (every scheduled request one token) and the others.

Workload (seeded; the same token ids and arrival times in every case and in both passes): ``--n``
prompts of ``--input-len`` random token ids; prompt ``i`` starts with shared prefix ``i %
--prefixes`` of ``--prefix-len`` tokens (so in the cold pass each prefix is reused by ``n/prefixes``
prompts), the rest is unique; ``--output-len`` tokens, greedy, ``ignore_eos``. Arrivals: Poisson at
``--rate`` req/s. The warm pass sends the same prompts again. The GPU KV budget is
``--gpu-blocks`` blocks of 16 tokens (``num_gpu_blocks_override``), small enough that vLLM evicts
prefix-cache blocks and preempts.

Per pass: TTFT (from the scheduled arrival to the step that returned the first token) mean / P50 /
P90 / P99, output tokens per second over the pass, preemptions and prefix-cache hits (vLLM's
Prometheus counters, this process), lmtier's counters (hits per tier), the engine's busy time (sum
of ``step()`` wall time), and the first output tokens of every request (agreement with ``none``).

Model: a Llama-3.1-8B config (``--model-dir``, written if missing), random weights
(``load_format="dummy"``), bf16, ``TRITON_ATTN``, ``custom_ops: none``, eager (``--cudagraph``:
vLLM's FULL_DECODE_ONLY graphs, no torch.compile). vLLM's compiled kernels are absent here: see
:mod:`lmtier.testing.vllm_gpu_shim` and ``scripts/gpu_vllm_bench.sh``.

Usage (on the GPU machine, from ``scripts/gpu_vllm_bench.sh``):
  python benchmarks/bench_vllm_gpu.py --cases none,lmtier_cpu,native_cpu --n 50 --json out.json
  python benchmarks/bench_vllm_gpu.py --probe     (tiny model, 8 tokens: does the engine start?)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = (
    "none",
    "lmtier_cpu",
    "lmtier_cpu_nolw",
    "native_cpu",
    "lmtier_disk",
    "lmtier_codec",
    "native_fs",
    "lmtier_redis_codec",
)
sys.path.insert(0, str(REPO / "benchmarks"))

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
"""Llama-3.1-8B's config.json (the shapes; weights are random)."""

TINY = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, num_hidden_layers=2, vocab_size=32000, bos_token_id=1, eos_token_id=2)  # fmt: skip
"""A 2-layer Llama for the probe."""


def write_model(d: Path, cfg: dict) -> Path:
    """Write ``config.json`` (and a generation config) for ``cfg`` into ``d``; returns ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    ids = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (d / "generation_config.json").write_text(json.dumps(ids))
    return d


def workload(a) -> tuple[list[list[int]], list[float]]:
    """The prompts (token ids) and arrival offsets (s) of one pass (seeded: same in every case)."""
    rng = random.Random(a.seed)
    lo, hi = 1000, 30000 if a.tiny else 120000
    prefixes = [[rng.randrange(lo, hi) for _ in range(a.prefix_len)] for _ in range(a.prefixes)]
    prompts = [prefixes[i % a.prefixes] + [rng.randrange(lo, hi) for _ in range(a.input_len - a.prefix_len)]
               for i in range(a.n)]  # fmt: skip
    t, arrivals = 0.0, []
    for _ in range(a.n):
        arrivals.append(t)
        t += rng.expovariate(a.rate)
    return prompts, arrivals


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (linear interpolation), NaN if empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    f = int(k)
    return s[f] + (s[min(f + 1, len(s) - 1)] - s[f]) * (k - f)


def prom_snapshot() -> dict[str, float]:
    """vLLM's and lmtier's Prometheus counters of this process that the report uses (name{labels})."""
    import prometheus_client

    keep = ("preempt", "prefix_cache", "cached", "lmtier", "offload", "kv_transfer", "connector")
    out: dict[str, float] = {}
    for fam in prometheus_client.REGISTRY.collect():
        if not fam.name.startswith("vllm") or not any(k in fam.name for k in keep):
            continue
        for s in fam.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name"))
            out[f"{s.name}{{{labels}}}"] = out.get(f"{s.name}{{{labels}}}", 0.0) + float(s.value)
    return out


def delta(after: dict, before: dict) -> dict:
    """Numeric differences ``after - before`` (keys of ``after``; zero differences dropped)."""
    d = {}
    for k, v in after.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            x = v - before.get(k, 0)
            if x:
                d[k] = x
    return d


# ------------------------------------------------------------------------------ child: one engine
def engine_kwargs(a, case: str) -> dict:
    """``LLM(**kw)`` for ``case``."""
    kw = dict(
        model=str(a.model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        attention_backend="TRITON_ATTN",
        compilation_config={"custom_ops": ["none"]},
        enforce_eager=not a.cudagraph,
        max_model_len=a.input_len + a.output_len + 64,
        max_num_batched_tokens=a.max_batched,
        max_num_seqs=a.max_seqs,
        enable_prefix_caching=True,
        num_gpu_blocks_override=a.gpu_blocks,
        gpu_memory_utilization=0.9,
        distributed_executor_backend="uni",
        disable_log_stats=False,
        seed=0,
    )
    if a.cudagraph:
        kw["compilation_config"] = {"custom_ops": ["none"], "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    if case.startswith("lmtier"):
        kw["kv_transfer_config"] = {
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.integration.vllm",
            "kv_role": "kv_both",
        }
        if case == "lmtier_cpu_nolw":
            kw["kv_transfer_config"]["kv_connector_extra_config"] = {"layerwise_loads": False}
    elif case == "native_cpu":
        kw["kv_offloading_size"] = a.cpu_gib
        kw["kv_offloading_backend"] = "native"
    elif case == "native_fs":  # vllm/v1/kv_offload/tiering/spec.py: a CPU primary tier + secondary tiers
        disk = Path(a.disk_dir) / case
        disk.mkdir(parents=True, exist_ok=True)
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": int(a.small_cpu_gib * (1 << 30)),
                "secondary_tiers": [{"type": "fs", "root_dir": str(disk)}],
            },
        }
    return kw


def lmtier_yaml(a, case: str, path: Path) -> Path:
    """The lmtier config of ``case`` (CPU tier; CPU + disk; CPU + disk with the codec; CPU + Redis with the
    codec on ``a.redis_port``)."""
    lines = ["chunk_size: 256", "local_cpu: true"]
    if case in ("lmtier_cpu", "lmtier_cpu_nolw"):
        lines.append(f"max_local_cpu_size: {a.cpu_gib}")
    elif case == "lmtier_redis_codec":
        lines += [f"max_local_cpu_size: {a.small_cpu_gib}", f'remote_url: "redis://127.0.0.1:{a.redis_port}"',
                  "remote_serde: cachegen"]  # fmt: skip
    else:
        disk = Path(a.disk_dir) / case
        disk.mkdir(parents=True, exist_ok=True)
        lines += [f"max_local_cpu_size: {a.small_cpu_gib}", f'local_disk: "file://{disk}"',
                  f"max_local_disk_size: {a.disk_gib}"]  # fmt: skip
        if case == "lmtier_codec":
            lines.append("local_disk_serde: cachegen")
    path.write_text("\n".join(lines) + "\n")
    return path


class Probe:
    """Per-pass instrumentation of one engine process (see the module docstring): connector hooks,
    vLLM's scheduler host time, garbage-collection pauses, and the kind of every step."""

    def __init__(self, case: str) -> None:
        import gc

        from hook_timers import HookTimers

        self.hooks = HookTimers()
        self.hooks.calibrate()
        cls = None
        if case.startswith("lmtier"):
            from lmtier.integration.vllm import LMTierConnector as cls
        elif case.startswith("native"):
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector as cls
        if cls is not None:

            def role_of(conn) -> str:
                return "S" if getattr(getattr(conn, "_role", None), "name", "") == "SCHEDULER" else "W"

            self.hooks.wrap_class(cls, role_of)
        self.sched: list[tuple[int, int]] = []  # (scheduled tokens, scheduled requests) per schedule()
        self.host_ns = {"schedule": 0, "update_from_output": 0}
        self.gc_ns = [0, 0, 0]
        self.gc_n = [0, 0, 0]
        self._gc_t0 = 0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        elif self._gc_t0:
            g = min(int(info.get("generation", 2)), 2)
            self.gc_ns[g] += time.perf_counter_ns() - self._gc_t0
            self.gc_n[g] += 1
            self._gc_t0 = 0

    def attach(self, engine) -> bool:
        """Time the in-process scheduler of ``engine`` (an ``LLMEngine``); False if it was not found."""
        sched = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
        if sched is None:
            return False
        host_ns, log = self.host_ns, self.sched
        f_sched, f_upd = sched.schedule, sched.update_from_output

        def schedule(*a, **k):
            t0 = time.perf_counter_ns()
            out = f_sched(*a, **k)
            host_ns["schedule"] += time.perf_counter_ns() - t0
            log.append((int(out.total_num_scheduled_tokens), len(out.num_scheduled_tokens)))
            return out

        def update_from_output(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return f_upd(*a, **k)
            finally:
                host_ns["update_from_output"] += time.perf_counter_ns() - t0

        sched.schedule, sched.update_from_output = schedule, update_from_output
        return True

    def take(self, steps: int, decode_walls: list[float], other_walls: list[float]) -> dict:
        """This pass's figures (ms totals, µs per step), counters reset."""
        ns, cpu, calls = self.hooks.take()
        per = max(1, steps)
        out = {
            "hooks_ms": {k: round(v / 1e6, 3) for k, v in sorted(ns.items())},
            "hooks_cpu_ms": {k: round(v / 1e6, 3) for k, v in sorted(cpu.items())},
            "hooks_calls": calls,
            "hooks_us_per_step": round(sum(ns.values()) / 1e3 / per, 1),
            "scheduler_ms": {k: round(v / 1e6, 1) for k, v in self.host_ns.items()},
            "gc_ms": [round(x / 1e6, 1) for x in self.gc_ns],
            "gc_count": list(self.gc_n),
            "decode_steps": len(decode_walls),
            "decode_step_ms_mean": round(statistics.fmean(decode_walls), 2) if decode_walls else None,
            "decode_step_ms_p50": round(pct(decode_walls, 50), 2) if decode_walls else None,
            "other_steps": len(other_walls),
            "other_step_ms_sum": round(sum(other_walls), 1),
        }
        for k in self.host_ns:  # in place: attach()'s wrappers hold this dict
            self.host_ns[k] = 0
        self.gc_ns, self.gc_n = [0, 0, 0], [0, 0, 0]
        return out


def run_pass(
    engine, sp, prompts, arrivals, tag: str, keep_tokens: int, deadline: float, probe: Probe | None = None
) -> dict:
    """Send ``prompts`` at ``arrivals`` (s from now), step the engine until all finish; the pass's
    figures (see the module docstring)."""
    if tag != "smoke" and os.environ.get("LMTIER_CONFIG_FILE"):
        from lmtier.integration.vllm.stats import process_totals
    else:  # no connector: lmtier is not loaded

        def process_totals() -> dict:
            return {}

    prom0, lm0 = prom_snapshot(), process_totals()
    n = len(prompts)
    t0 = time.monotonic()
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    toks: dict[int, list[int]] = {i: [] for i in range(n)}
    cached: dict[int, int] = {}
    nxt, busy, steps = 0, 0.0, 0
    decode_walls: list[float] = []
    other_walls: list[float] = []
    if probe is not None:
        probe.take(0, [], [])  # what ran before this pass is not this pass's
    while len(done) < n:
        now = time.monotonic()
        if now > deadline:
            break
        while nxt < n and now - t0 >= arrivals[nxt]:
            engine.add_request(f"{tag}-{nxt}", {"prompt_token_ids": prompts[nxt]}, sp)
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt < n:
                time.sleep(max(0.0, min(0.002, t0 + arrivals[nxt] - time.monotonic())))
            continue
        k0 = len(probe.sched) if probe is not None else 0
        s0 = time.monotonic()
        outs = engine.step()
        s1 = time.monotonic()
        busy += s1 - s0
        steps += 1
        if probe is not None:
            new = probe.sched[k0:]
            walls = decode_walls if new and all(t == r for t, r in new) else other_walls
            walls.append((s1 - s0) * 1e3)
        for o in outs:
            i = int(o.request_id.rsplit("-", 1)[1])
            new = list(o.outputs[0].token_ids) if o.outputs else []
            if new and i not in first:
                first[i] = s1 - t0 - arrivals[i]
            toks[i].extend(new)
            if o.finished:
                done[i] = s1 - t0
                cached[i] = int(o.num_cached_tokens or 0)
    wall = time.monotonic() - t0
    prom1, lm1 = prom_snapshot(), process_totals()
    ttft = [first[i] * 1000 for i in sorted(first)]
    out_tokens = sum(len(v) for v in toks.values())
    return {
        "n": n,
        "completed": len(done),
        "ttft_ms": {"mean": statistics.fmean(ttft) if ttft else float("nan"), "p50": pct(ttft, 50),
                    "p90": pct(ttft, 90), "p99": pct(ttft, 99), "max": max(ttft) if ttft else float("nan")},
        "e2e_s_mean": statistics.fmean(done[i] - arrivals[i] for i in done) if done else float("nan"),
        "wall_s": wall,
        "busy_s": busy,
        "steps": steps,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "prompt_tokens": sum(len(p) for p in prompts),
        "cached_tokens": sum(cached.values()),
        "prom": delta(prom1, prom0),
        "lmtier": delta(lm1, lm0),
        "probe": probe.take(steps, decode_walls, other_walls) if probe is not None else None,
        "tokens": {str(i): v[:keep_tokens] for i, v in toks.items()},
        "ttft_each_ms": ttft,
    }  # fmt: skip


def child(a) -> None:
    """One engine (``a.case``): start it, a smoke request, the cold pass, the warm pass; JSON to ``a.out``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM's samplers import FlashInfer to ask whether its sampling kernels apply; FlashInfer is one of
    # the compiled packages not carried (greedy sampling never uses it)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    res: dict = {"case": a.case, "args": {k: str(v) for k, v in vars(a).items()}}
    out = Path(a.out)

    def save():
        out.write_text(json.dumps(res))

    t_start = time.monotonic()
    deadline = t_start + a.case_budget_s
    redis = None
    if a.case == "lmtier_redis_codec":  # a loopback redis-server (scripts/bundle_redis.sh), no persistence
        from lmtier.testing.redis import RedisServer

        redis = RedisServer().start()
        a.redis_port = redis.port
    if a.case.startswith("lmtier"):
        os.environ["LMTIER_CONFIG_FILE"] = str(lmtier_yaml(a, a.case, out.with_suffix(".yaml")))
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    probe = Probe(a.case)
    kw = engine_kwargs(a, a.case)
    res["engine_kwargs"] = {k: str(v) for k, v in kw.items()}
    llm = LLM(**kw)
    engine = llm.llm_engine
    res["probe_attached"] = probe.attach(engine)
    res["startup_s"] = time.monotonic() - t_start
    cfg = engine.vllm_config
    res["engine"] = {
        "model_runner": "v2" if cfg.use_v2_model_runner else "v1",
        "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
        "platform": type(__import__("vllm.platforms", fromlist=["current_platform"]).current_platform).__name__,
        "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        "block_size": cfg.cache_config.block_size,
    }
    save()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)  # fmt: skip
    t = time.monotonic()
    smoke = run_pass(engine, sp, [[11, 22, 33, 44] * 16], [0.0], "smoke", 8, deadline)
    res["smoke"] = {"seconds": time.monotonic() - t, "tokens": smoke["tokens"]["0"]}
    print(f"[{a.case}] engine up in {res['startup_s']:.1f} s; smoke tokens {res['smoke']['tokens']}", flush=True)
    save()
    if a.probe:
        return
    # Warm-up (not measured): a few concurrent requests of other random tokens, so the Triton
    # kernels' variants for prefill and decode are compiled (or loaded from Triton's cache) before
    # the cold pass in every case alike.
    rng = random.Random(a.seed + 1000)
    wp = [[rng.randrange(1000, 30000) for _ in range(min(2000, a.input_len))] for _ in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)  # fmt: skip
    t = time.monotonic()
    run_pass(engine, sp, wp, [0.0, 0.0, 0.05, 0.1], "warmup", 0, deadline)
    res["warmup_s"] = time.monotonic() - t
    prompts, arrivals = workload(a)
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)  # fmt: skip
    res["passes"] = {}
    for tag in ("cold", "warm"):
        r = run_pass(engine, sp, prompts, arrivals, tag, a.keep_tokens, deadline, probe)
        res["passes"][tag] = r
        tt = r["ttft_ms"]
        print(
            f"[{a.case}] {tag}: {r['completed']}/{r['n']} done, TTFT mean {tt['mean']:.0f} p50 {tt['p50']:.0f} "
            f"p99 {tt['p99']:.0f} ms, {r['output_tok_s']:.0f} out tok/s, wall {r['wall_s']:.1f} s",
            flush=True,
        )
        save()
        if a.case.startswith("lmtier"):
            from lmtier.integration.vllm.common import flush_all

            flush_all(60)
    res["total_s"] = time.monotonic() - t_start
    save()
    if redis is not None:
        from lmtier.testing.stores import redis_info

        res["redis_info"] = redis_info(redis.port)
        save()
        redis.close()


# ------------------------------------------------------------------------------ parent
def summarize(results: list[dict]) -> str:
    """The short table (one row per case and pass) and output agreement with ``none``."""
    rows = [
        "case          pass  done   TTFT mean   p50    p90    p99 (ms)  out tok/s  preempt  gpu-hit%  ext-hit-tok"
        "  lmtier hits cpu/disk (tok)"
    ]
    base = next((r for r in results if r.get("case") == "none"), None)
    for r in results:
        if "startup_s" in r:
            e = r.get("engine", {})
            rows.append(f"{r['case']:<13} engine up in {r['startup_s']:.0f} s (runner {e.get('model_runner')}, "
                        f"{e.get('num_gpu_blocks')} GPU blocks, cudagraph {e.get('cudagraph_mode')}), "
                        f"smoke {r.get('smoke', {}).get('tokens')}, case wall {r.get('wall_s', 0):.0f} s")  # fmt: skip
        for tag, p in (r.get("passes") or {}).items():
            prom = p["prom"]
            pre = sum(v for k, v in prom.items() if k.startswith("vllm:num_preemptions_total"))
            q = sum(v for k, v in prom.items() if k.startswith("vllm:prefix_cache_queries"))
            h = sum(v for k, v in prom.items() if k.startswith("vllm:prefix_cache_hits"))
            ext = sum(v for k, v in prom.items() if k.startswith("vllm:external_prefix_cache_hits"))
            lm = p["lmtier"]
            t = p["ttft_ms"]
            rows.append(f"{r['case']:<13} {tag:<5} {p['completed']:>3}/{p['n']:<3} {t['mean']:>8.0f} {t['p50']:>6.0f} "
                        f"{t['p90']:>6.0f} {t['p99']:>6.0f}     {p['output_tok_s']:>8.0f}  {pre:>7.0f}  "
                        f"{(100 * h / q if q else 0):>7.1f}  {ext:>11.0f}  "
                        f"{lm.get('hit_tokens_cpu', 0):.0f}/{lm.get('hit_tokens_disk', 0):.0f}")  # fmt: skip
            pr = p.get("probe")
            if pr:
                top = sorted(pr["hooks_ms"].items(), key=lambda kv: -kv[1])[:4]
                rows.append(
                    f"{'':<13} {tag:<5} decode steps {pr['decode_steps']} x {pr['decode_step_ms_mean']} ms "
                    f"(p50 {pr['decode_step_ms_p50']}), other steps {pr['other_steps']} = "
                    f"{pr['other_step_ms_sum']} ms; "
                    f"hooks {pr['hooks_us_per_step']} us/step (top: "
                    + ", ".join(f"{k} {v:.0f} ms" for k, v in top)
                    + f"); scheduler {pr['scheduler_ms']}; gc ms {pr['gc_ms']} n {pr['gc_count']}"
                )
            distinct = len({t for v in p["tokens"].values() for t in v})
            checks = []
            if tag == "warm" and "cold" in r["passes"]:  # the same prompts recomputed in this engine
                ct = r["passes"]["cold"]["tokens"]
                checks.append(("this case's cold pass", sum(1 for i, v in p["tokens"].items() if v and ct.get(i) == v)))
            if base is not None and r is not base and base.get("passes", {}).get(tag, {}).get("completed") == p["n"]:
                bt = base["passes"][tag]["tokens"]
                checks.append(("none's", sum(1 for i, v in p["tokens"].items() if v and bt.get(i) == v)))
            for what, same in checks:
                rows.append(
                    f"{'':<13} {tag:<5} first {len(next(iter(p['tokens'].values())))} greedy tokens equal to {what}: "
                    f"{same}/{p['n']} requests ({distinct} distinct token ids in this pass"
                    f"{': degenerate outputs, the check is weak' if distinct < 4 else ''})"
                )
    return "\n".join(rows)


def parent(a) -> int:
    """Run each case in its own process while time is left; print the table; JSON to ``a.json``."""
    t_end = time.monotonic() + a.budget_s
    results = []
    cases = ["probe"] if a.probe else a.cases.split(",")
    for case in cases:
        if case != "probe" and case not in CASES:
            raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")
        left = t_end - time.monotonic()
        # this case may use what is left but the minimum of each case after it (a pass cut at the
        # deadline is reported incomplete: --n must fit the budget)
        share = left - a.min_case_s * (len(cases) - cases.index(case) - 1)
        if left < a.min_case_s:
            print(f"[bench] {case}: skipped, {left:.0f} s left", flush=True)
            results.append({"case": case, "skipped": f"{left:.0f} s left"})
            continue
        if case.startswith("lmtier") and a.wait_for:
            while not Path(a.wait_for).exists() and time.monotonic() < t_end - a.min_case_s:
                time.sleep(1.0)
            if not Path(a.wait_for).exists() or Path(a.wait_for).read_text().strip() != "ok":
                print(f"[bench] {case}: skipped, lmtier's build is not ready ({a.wait_for})", flush=True)
                results.append({"case": case, "skipped": "lmtier build not ready"})
                continue
        out = Path(a.work) / f"{case}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        argv = [sys.executable, __file__, "--child", "--case", "none" if case == "probe" else case, "--out", str(out),
                "--case-budget-s", str(max(30.0, max(share, a.min_case_s) - 10))] + a.passthrough  # fmt: skip
        if case == "probe":
            argv.append("--probe")
        t0 = time.monotonic()
        log = Path(a.work) / f"{case}.log"
        env = dict(os.environ)
        for attempt in (1, 2):
            with open(log, "w") as fh:
                try:
                    rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                        timeout=max(30.0, t_end - time.monotonic())).returncode  # fmt: skip
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            r = json.loads(out.read_text()) if out.exists() else {"case": case}
            # The engine failed to start inside Model Runner V2 (vLLM's default): once, the V1 runner,
            # kept for the cases after this one.
            v2_trace = "vllm/v1/worker/gpu/" in log.read_text(errors="replace")
            if rc == 0 or "startup_s" in r or "VLLM_USE_V2_MODEL_RUNNER" in os.environ or attempt == 2 or not v2_trace:
                break
            log.rename(log.with_suffix(".v2.log"))
            print(
                f"[bench] {case}: engine failed to start with Model Runner V2 (rc {rc}); retrying with V1", flush=True
            )
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            env = dict(os.environ)
        r["model_runner_env"] = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "default")
        r["rc"], r["wall_s"] = rc, time.monotonic() - t0
        if rc != 0:
            tail = log.read_text(errors="replace").splitlines()
            errs = [ln for ln in tail if "Error" in ln or "error" in ln or "Traceback" in ln][-6:]
            r["error_tail"] = tail[-40:]
            print(f"[bench] {case}: rc {rc} after {r['wall_s']:.0f} s; last errors:\n  " + "\n  ".join(errs)
                  + "\n  --- log tail ---\n  " + "\n  ".join(tail[-25:]), flush=True)  # fmt: skip
        else:
            print(f"[bench] {case}: ok in {r['wall_s']:.0f} s", flush=True)
        results.append(r)
        if a.json:
            Path(a.json).write_text(json.dumps({"results": results}, indent=1))
        if len(results) == 1 and "startup_s" not in r:
            print("[bench] the first engine did not start: the other cases would stop there too; stopping", flush=True)
            break
    print(summarize(results), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="none,lmtier_cpu,native_cpu")
    p.add_argument("--probe", action="store_true", help="tiny 2-layer Llama, 8 tokens, no passes")
    p.add_argument("--n", type=int, default=50, help="prompts per pass")
    p.add_argument("--input-len", type=int, default=7500)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--prefix-len", type=int, default=3750, help="shared prefix tokens per prompt")
    p.add_argument("--prefixes", type=int, default=10, help="distinct shared prefixes")
    p.add_argument("--rate", type=float, default=3.6, help="Poisson arrival rate (req/s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gpu-blocks", type=int, default=7500, help="num_gpu_blocks_override (16-token blocks)")
    p.add_argument("--max-batched", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--max-seqs", type=int, default=256)
    p.add_argument("--cpu-gib", type=float, default=31.0, help="CPU tier GiB (lmtier_cpu, native_cpu)")
    p.add_argument("--small-cpu-gib", type=float, default=4.0, help="CPU tier GiB with a disk tier")
    p.add_argument("--disk-gib", type=float, default=48.0)
    p.add_argument("--disk-dir", default="/tmp/lmtier_bench_disk")
    p.add_argument("--redis-port", type=int, default=0, help=argparse.SUPPRESS)  # set by the child
    p.add_argument("--cudagraph", action="store_true", help="FULL_DECODE_ONLY CUDA graphs (no torch.compile)")
    p.add_argument("--model-dir", default="/tmp/llama31_8b_config")
    p.add_argument("--keep-tokens", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=480.0, help="all cases together (parent)")
    p.add_argument("--min-case-s", type=float, default=110.0, help="time kept for each later case")
    p.add_argument("--work", default="/tmp/bench_vllm_gpu")
    p.add_argument("--json")
    p.add_argument("--wait-for", help="lmtier cases wait for this file to read 'ok' (the CUDA build)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--case-budget-s", type=float, default=600.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.tiny = a.probe
    if a.probe:
        a.model_dir = a.model_dir + "_tiny"
    a.model_dir = write_model(Path(a.model_dir), TINY if a.tiny else LLAMA_8B)
    if a.child:
        child(a)
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's interpreter-exit teardown
    # what the children get: every option but the parent-only ones
    skip = {"--cases", "--budget-s", "--min-case-s", "--json", "--work", "--wait-for"}
    raw = list(argv if argv is not None else sys.argv[1:])
    a.passthrough = []
    i = 0
    while i < len(raw):
        opt = raw[i].split("=")[0]
        takes = opt in {
            x
            for act in p._actions
            for x in act.option_strings
            if act.nargs != 0 and not isinstance(act, argparse._StoreTrueAction)
        }  # noqa: E501
        if opt in skip:
            i += 1 if "=" in raw[i] or not takes else 2
            continue
        if opt == "--probe":
            i += 1
            continue
        a.passthrough.append(raw[i])
        if takes and "=" not in raw[i]:
            a.passthrough.append(raw[i + 1])
            i += 1
        i += 1
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
