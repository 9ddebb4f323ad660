"""RSS diagnosis run: bench_connectors' phase-C workload on ONE server, memory sampled per process.

Starts one vLLM server (LMTierConnector with benchmarks/peers/lmtier_rss.yaml, or none with
--baseline), sends --requests prompts of 300-600 tokens (half share one of 20 512-token prefixes,
half distinct; the same generator as bench_connectors.py phase C) from --clients clients, and
samples every second, per process of the server tree: Rss, Anonymous, Shmem (smaps_rollup); every
--smaps-every s each process's anonymous memory by region (lmtier.testing.procmem.anon_regions: glibc
main heap, glibc thread arenas, vLLM's KV cache mapping, lmtier's CPU pool mapping, other).
--env K=V adds environment variables to the server (MALLOC_ARENA_MAX=2, LD_PRELOAD=...,
ONEDNN_PRIMITIVE_CACHE_CAPACITY=..., RSS_PROBE_DIR=... with --probe-site for the in-process probe of
benchmarks/rss_probe_site); --tcmalloc preloads the system's libtcmalloc_minimal. Writes --json.

Usage: .venv/bin/python benchmarks/rss_probe.py --json out.json [--baseline] [--requests 600]
           [--pool-gib 0.5] [--env MALLOC_ARENA_MAX=2] [--tcmalloc] [--probe-site]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import connector_servers as B  # noqa: E402  (bench_connectors.py's servers and prompts)

from lmtier.testing import procmem  # noqa: E402  (shared /proc parsing: rollup, anon_regions)

rollup = procmem.rollup
comm = procmem.comm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", action="store_true", help="no connector")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--pool-gib", type=float, default=0.5)
    ap.add_argument("--disk-gib", type=float, default=1.0)
    ap.add_argument(
        "--fixed-len",
        type=int,
        default=0,
        help="instead of the mixed workload: all-distinct prompts of exactly N tokens (with --clients 1 "
        "every engine step has the same shape)",
    )
    ap.add_argument(
        "--fixed-reuse",
        action="store_true",
        help="with --fixed-len N (> 512): every other prompt is one of the 20 shared 512-token prefixes "
        "+ N - 512 new tokens (two step shapes: N on a miss, N - 512 on a hit)",
    )
    ap.add_argument("--env", action="append", default=[], help="K=V for the server (repeatable)")
    ap.add_argument(
        "--tcmalloc",
        action="store_true",
        help="LD_PRELOAD the system's libtcmalloc_minimal into the server (error when not installed)",
    )
    ap.add_argument("--probe-site", action="store_true", help="PYTHONPATH += benchmarks/rss_probe_site")
    ap.add_argument("--smaps-every", type=float, default=15.0)
    ap.add_argument("--tail-s", type=float, default=10.0, help="idle seconds sampled after the last request")
    ap.add_argument("--model", type=Path, default=B.REPO_ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--label", default="")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rssprobe_"))
    (work / "logs").mkdir()
    env = dict(kv.split("=", 1) for kv in a.env)
    if a.tcmalloc:
        if procmem.tcmalloc_path() is None:
            ap.error("--tcmalloc: no libtcmalloc_minimal.so.4 found (apt-get install libtcmalloc-minimal4)")
        env.update(procmem.server_mem_env("tcmalloc", base_preload=env.get("LD_PRELOAD", ""))[0])
    # Srv sets VLLM_CPU_KVCACHE_SPACE=1 (GiB)
    named = procmem.server_regions(1 << 30, 0 if a.baseline else int(a.pool_gib * 2**30))
    pp = [str(B.REPO_ROOT)]
    # NB: vLLM's engine and worker processes start from the repository root (cwd), so they import
    # the lmtier of the checkout this script lives in, whatever PYTHONPATH says.
    if a.probe_site:
        pp.insert(0, str(HERE / "rss_probe_site"))
    env["PYTHONPATH"] = ":".join(pp + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    ktc = None
    cfg_text = None
    if not a.baseline:
        disk = work / "disk"
        disk.mkdir()
        cfg = work / "lmtier_rss.yaml"
        cfg_text = (
            f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: {a.pool_gib}\n"
            f'local_disk: "file://{disk}"\nmax_local_disk_size: {a.disk_gib}\n'
        )
        cfg.write_text(cfg_text)
        env["LMTIER_CONFIG_FILE"] = str(cfg)
        ktc = B.LMTIER_KTC
    prompts = B.Prompts(a.model)
    name = a.label or ("base" if a.baseline else "lmtier")
    srv = B.Srv(name, sys.executable, work, a.model, ktc, env)
    try:
        startup = srv.wait_ready(600)
        for i in range(2):
            srv.complete(prompts.tagged(f"warmup-{name}-{i}", 200))
        rng = random.Random(1)
        shared = [prompts.tagged(f"shared{k}", 512) for k in range(20)]
        reqs = []
        for i in range(a.requests):
            if (
                a.fixed_len and a.fixed_reuse and i % 2 == 0
            ):  # 512 shared + (N - 512) new: hits leave N - 512 to compute
                reqs.append(shared[rng.randrange(20)] + prompts.tagged(f"t{i}", a.fixed_len - 512))
            elif a.fixed_len:
                reqs.append(prompts.tagged(f"f{i}", a.fixed_len))
            elif i % 2 == 0:
                reqs.append(shared[rng.randrange(20)] + prompts.tagged(f"t{i}", rng.randrange(16, 89)))
            else:
                reqs.append(prompts.tagged(f"x{i}", rng.randrange(300, 601)))
        samples: list[dict] = []
        smaps: list[dict] = []
        stop = threading.Event()
        t0 = time.monotonic()
        done = [0]

        def sampler() -> None:
            last_smaps = -1e9
            while not stop.is_set():
                t = round(time.monotonic() - t0, 1)
                row = {"t": t, "done": done[0], "load1": os.getloadavg()[0], "procs": {}}
                want_smaps = t - last_smaps >= a.smaps_every
                sm = {"t": t, "done": done[0], "procs": {}}
                for p in B.tree_pids(srv.pgid):
                    try:
                        row["procs"][p] = {"comm": comm(p), **rollup(p)}
                        if want_smaps and row["procs"][p]["Rss"] > 50 << 20:
                            sm["procs"][p] = {"comm": comm(p), **procmem.anon_regions(p, named)}
                    except OSError:
                        pass
                samples.append(row)
                if want_smaps:
                    smaps.append(sm)
                    last_smaps = t
                stop.wait(1.0)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        errors = 0
        lock = threading.Lock()
        local = threading.local()

        def one(ids: list[int]) -> None:
            nonlocal errors
            if not hasattr(local, "s"):
                local.s = requests.Session()
            try:
                srv.complete(ids, session=local.s)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors += 1
                B.log(f"request failed: {e}")
            with lock:
                done[0] += 1
                if done[0] % 100 == 0:
                    s = samples[-1] if samples else {"procs": {}}
                    B.log(
                        f"{done[0]}/{len(reqs)}: "
                        + ", ".join(
                            f"{v['comm']}:{v['Rss'] / 2**30:.2f}" for v in s["procs"].values() if v["Rss"] > 50 << 20
                        )
                    )

        with ThreadPoolExecutor(a.clients) as ex:
            list(ex.map(one, reqs))
        t_end = time.monotonic() - t0
        time.sleep(a.tail_s)
        stop.set()
        th.join()
        metrics = srv.metrics()
    finally:
        srv.stop()
    # summary per process (by comm) and tree
    tree = [sum(p["Rss"] for p in s["procs"].values()) for s in samples]
    third = len(tree) // 3 or 1
    by: dict[str, list[int]] = {}
    for s in samples:
        for p in s["procs"].values():
            by.setdefault(p["comm"], []).append(p["Rss"])
    summ = {
        "tree_rss_gib": {
            "min": min(tree) / 2**30,
            "median": statistics.median(tree) / 2**30,
            "max": max(tree) / 2**30,
            "max_first_third": max(tree[:third]) / 2**30,
            "max_last_third": max(tree[-third:]) / 2**30,
            "last": tree[-1] / 2**30,
        },
        "per_comm_rss_gib": {
            k: {
                "first": v[0] / 2**30,
                "max_first_third": max(v[: len(v) // 3 or 1]) / 2**30,
                "max_last_third": max(v[-(len(v) // 3 or 1) :]) / 2**30,
                "last": v[-1] / 2**30,
                "max": max(v) / 2**30,
            }
            for k, v in by.items()
            if max(v) > 50 << 20
        },
    }
    out = {
        "label": name,
        "args": {k: str(v) for k, v in vars(a).items()},
        "config": cfg_text,
        "env": env,
        "startup_s": startup,
        "wall_s": t_end,
        "errors": errors,
        "summary": summ,
        "metrics": {k: v for k, v in metrics.items() if "lmtier" in k or "prompt_tokens" in k},
        "samples": samples,
        "smaps": smaps,
        "work": str(work),
    }
    a.json.write_text(json.dumps(out))
    B.log(f"{name}: {json.dumps(summ)}")
    B.log(f"errors {errors}, wall {t_end:.0f}s, work {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
