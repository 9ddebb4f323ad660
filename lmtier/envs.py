"""Every environment variable lmtier reads, declared in one registry (as vLLM's ``vllm/envs.py``).

Each variable is an :class:`EnvVar` with its group, meaning, default and reader. Groups:

* ``config`` — ``LMTIER_CONFIG_FILE`` and one ``LMTIER_<KEY>`` override per configuration key of
  :data:`lmtier.config_schema.KEYS` (``<KEY>`` upper-cased, e.g. ``LMTIER_CHUNK_SIZE``), read by
  :func:`lmtier.config.load_config`, which parses the text by the key's type.
* ``fault`` — fault injection into the vLLM connector (tests only).
* ``test`` — the test suite and its harness (:mod:`lmtier.testing`).
* ``bench`` — benchmarks, ``lmtier bench`` and their harness.
* ``build`` — ``setup.py`` (which reads them with ``os.environ``: it runs before lmtier is built).
* ``ci`` — shell scripts (``.ci/run``, ``scripts/gpu_run.sh``).

Strictness: an ``LMTIER_*`` variable that is not declared here is logged as a warning naming it
(with the closest declared name), once per process, by :func:`warn_undeclared` — never an error:
variables of other tools and of newer or older lmtier versions must not stop a server. A component
that reads a new ``LMTIER_*`` variable declares it here (a test scans the tree for undeclared ones).

Reading: ``lmtier.envs.get("LMTIER_REDIS_URL")`` or, as in vLLM, ``lmtier.envs.LMTIER_REDIS_URL``
(the parsed value, or the default when unset). Reading an undeclared name is a ``KeyError``.
Values are read at each call, never cached, so tests may set them at any time.

Logging: ``logging.getLogger("lmtier.envs")``. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmtier.config_schema import KEYS

__all__ = [
    "EnvVar",
    "ENV_VARS",
    "PREFIX",
    "FOREIGN",
    "CONFIG_FILE",
    "GROUPS",
    "get",
    "config_key_of",
    "config_override_name",
    "undeclared",
    "warn_undeclared",
]

logger = logging.getLogger("lmtier.envs")

PREFIX = "LMTIER_"
CONFIG_FILE = "LMTIER_CONFIG_FILE"
GROUPS = ("config", "fault", "test", "bench", "build", "ci")


def _flag(text: str) -> bool:
    return text == "1"


def _faults(text: str) -> frozenset[str]:
    return frozenset(s.strip() for s in text.split(",") if s.strip())


@dataclass(frozen=True)
class EnvVar:
    """One declared environment variable.

    Attributes:
        name: the variable, ``LMTIER_...``.
        group: one of :data:`GROUPS`.
        meaning: what it does, in one or two sentences.
        default: the text used when it is unset (``None``: no default, :func:`get` returns None).
        parse: text -> value (``str`` unless said otherwise; flags: true iff the text is ``"1"``).
        read_by: where it is read (module, script), for readers of the registry.
    """

    name: str
    group: str
    meaning: str
    default: str | None = None
    parse: Callable[[str], Any] = str
    read_by: str = ""


FOREIGN = frozenset({"MOONCAKE_CONFIG_PATH", "UCX_MODULES"})
"""Variables of other projects' conventions that lmtier reads too (declared here, no ``LMTIER_`` prefix)."""


def _declare(*items: EnvVar) -> dict[str, EnvVar]:
    out: dict[str, EnvVar] = {}
    for v in items:
        assert (v.name.startswith(PREFIX) or v.name in FOREIGN) and v.group in GROUPS and v.name not in out, v
        out[v.name] = v
    return out


ENV_VARS: dict[str, EnvVar] = _declare(
    EnvVar(
        CONFIG_FILE,
        "config",
        "YAML configuration file read by load_config() when no path is given",
        read_by="lmtier.config.load_config",
    ),
    *(
        EnvVar(
            PREFIX + key.upper(),
            "config",
            f"overrides config key {key!r}: {spec.meaning}",
            read_by="lmtier.config.load_config",
        )
        for key, spec in KEYS.items()
    ),
    EnvVar(
        "MOONCAKE_CONFIG_PATH",
        "config",
        "JSON file of Mooncake Store client settings (LMCache's and vLLM's convention) for a "
        "mooncakestore:// remote_url; lmtier's mooncake_* keys override its fields",
        read_by="lmtier.tiers.mooncake.settings (through lmtier.config.load_config)",
    ),
    EnvVar(
        "UCX_MODULES",
        "config",
        "UCX's module filter (used by NIXL for P2P sharing); when unset on a host without RDMA devices "
        "lmtier sets it to ^ib before its NIXL agent starts (the nixl-cu12 1.5.1 wheel crashes at exit "
        "otherwise: docs/p2p.md)",
        read_by="lmtier.tiers.p2p.transport",
    ),
    EnvVar(
        "LMTIER_FAULT_INJECT",
        "fault",
        "comma-separated faults the vLLM connector injects (tests only): e.g. 'load' makes every load fail",
        default="",
        parse=_faults,
        read_by="lmtier.integration.vllm.common",
    ),
    EnvVar(
        "LMTIER_REQUIRE_REDIS",
        "test",
        "1: tests that need redis-server fail instead of skipping when it is missing (CI)",
        default="0",
        parse=_flag,
        read_by="lmtier.testing.redis",
    ),
    EnvVar(
        "LMTIER_REQUIRE_MOONCAKE",
        "test",
        "1: tests that need Mooncake Store (the mooncake package, mooncake_master) fail instead of skipping (CI)",
        default="0",
        parse=_flag,
        read_by="lmtier.testing.mooncake",
    ),
    EnvVar(
        "LMTIER_REQUIRE_NIXL",
        "test",
        "1: tests that need NIXL (nixl-cu12, P2P sharing: scripts/setup_nixl.sh) fail instead of skipping (CI)",
        default="0",
        parse=_flag,
        read_by="lmtier.testing.p2p",
    ),
    EnvVar(
        "LMTIER_REQUIRE_VLLM",
        "test",
        "1: tests that need vLLM (and the SmolLM2 model) fail instead of skipping when it is missing (CI)",
        default="0",
        parse=_flag,
        read_by="lmtier.testing.vllm",
    ),
    EnvVar(
        "LMTIER_TEST_PW",
        "test",
        "a Redis password the tests pass through remote_password_env",
        read_by="tests/test_remote_tier.py",
    ),
    EnvVar(
        "LMTIER_FUZZ_EXAMPLES",
        "test",
        "multiplier of the number of fuzzing examples (float)",
        default="1",
        parse=float,
        read_by="tests/test_fuzz_records.py",
    ),
    EnvVar(
        "LMTIER_EB_KV",
        "test",
        "file of SmolLM2's real KV chunks (lossless records) for the eb levels' GPU tests on machines "
        "without the model (default .whl/eb_kv/smollm2_gpl3.lmkc; written by python -m tests.eb_kv --write)",
        read_by="tests/eb_kv.py",
    ),
    EnvVar(
        "LMTIER_AB_ROUNDS",
        "bench",
        "pairs of new/old runs of scripts/gpu_ab_ttft.sh",
        default="2",
        parse=int,
        read_by="scripts/gpu_ab_ttft.sh",
    ),
    EnvVar(
        "LMTIER_BENCH_SMOKE",
        "bench",
        "1: benchmarks run tiny sizes only (the test suite's smoke run)",
        default="0",
        parse=_flag,
        read_by="benchmarks/*.py",
    ),
    EnvVar(
        "LMTIER_BENCH_PRESET",
        "bench",
        "model geometry preset of benchmarks/test_bench_cpu_paths.py",
        default="llama-3.1-8b",
        read_by="benchmarks/test_bench_cpu_paths.py",
    ),
    EnvVar(
        "LMTIER_REDIS_URL",
        "bench",
        "a running Redis the TTFT benchmark uses instead of starting its own redis-server",
        read_by="lmtier.bench.ttft, lmtier.cli",
    ),
    EnvVar(
        "LMTIER_REDIS_SERVER",
        "bench",
        "path of the redis-server binary the harness starts (default: PATH)",
        read_by="lmtier.testing.redis, lmtier.bench.ttft",
    ),
    EnvVar(
        "LMTIER_TCMALLOC",
        "bench",
        "path of libtcmalloc for the servers' allocator (default: searched)",
        read_by="lmtier.testing.procmem",
    ),
    EnvVar(
        "LMTIER_CODEC_KV_CACHE",
        "bench",
        "directory caching the KV that benchmarks/codec_quality.py computes",
        default="/tmp/lmtier_codec_kv",
        read_by="benchmarks/codec_quality.py",
    ),
    EnvVar(
        "LMTIER_CUDA", "build", "ON, OFF or AUTO (default): build the CUDA kernels", default="AUTO", read_by="setup.py"
    ),
    EnvVar(
        "LMTIER_CUDA_ARCHS",
        "build",
        "CMake CUDA architectures to build, e.g. '90' or '80;90'",
        default="90",
        read_by="setup.py",
    ),
    EnvVar("LMTIER_BUILD_JOBS", "build", "parallel compile jobs (default: the number of CPUs)", read_by="setup.py"),
    EnvVar(
        "LMTIER_REBUILD",
        "build",
        "1: scripts/bootstrap.sh rebuilds the extension even when it is up to date with its sources",
        default="0",
        read_by="scripts/bootstrap.sh",
    ),
    EnvVar(
        "LMTIER_APT_LOCK_TIMEOUT",
        "build",
        "seconds scripts/bootstrap.sh's apt-get waits for the dpkg lock another process holds",
        default="600",
        read_by="scripts/lib/apt.sh",
    ),
    EnvVar(
        "LMTIER_APT_RETRY_SLEEP",
        "build",
        "seconds between scripts/bootstrap.sh's two apt-get attempts",
        default="15",
        read_by="scripts/lib/apt.sh",
    ),
    EnvVar(
        "LMTIER_ALLOW_MISSING_PACKAGES",
        "build",
        "1: scripts/bootstrap.sh warns instead of stopping when a required system package (redis-server) is missing",
        default="0",
        read_by="scripts/lib/apt.sh",
    ),
    EnvVar("LMTIER_CI_VLLM033", "ci", "0 skips the vLLM 0.33 step of .ci/run", default="1", read_by=".ci/run"),
    EnvVar(
        "LMTIER_GPU_STEPS",
        "ci",
        "steps of scripts/gpu_run.sh (tests transfer layerwise ttft rans codec ...)",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_GPU_TESTS",
        "ci",
        "1: scripts/gpu_vllm_bench.sh runs the gpu tests after the engine benchmark, on the same build",
        default="0",
        read_by="scripts/gpu_vllm_bench.sh",
    ),
    EnvVar(
        "LMTIER_GPU_BENCH",
        "ci",
        "quick: scripts/gpu_run.sh runs the short benchmark sizes",
        default="full",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_TTFTPCA_SPECTRA",
        "ci",
        "which of scripts/gpu_run.sh's ttftpca runs: 'model' (the random model's KV as built), 'trained' "
        "(--kv-spectrum trained) or both",
        default="model trained",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_PCACODEC_BENCH",
        "ci",
        "0: scripts/gpu_run.sh's pcacodec step runs the PCA GPU tests alone, not lmtier.bench.codec_pca",
        default="1",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_PCACODEC_G4",
        "ci",
        "0: scripts/gpu_run.sh's pcacodec step skips its G = 4 codec benchmark",
        default="1",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_HOSTAB_OPS",
        "ci",
        "scripts/gpu_run.sh's hostab step: what it times, old package against new, as op:threads pairs "
        "(op: encode, decode, put or get)",
        default="encode:1 encode:2",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_HOSTAB_ARGS",
        "ci",
        "more arguments of every run of scripts/gpu_run.sh's hostab step (benchmarks/pca_decode_threads.py), "
        "e.g. '--get-batch 1 --get-stream'",
        default="",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_GETBREAK_THREADS",
        "ci",
        "thread counts scripts/gpu_run.sh's getbreak step breaks the PCA tier's batched read down at",
        default="1 4",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_PUTBREAK_THREADS",
        "ci",
        "thread counts scripts/gpu_run.sh's putbreak step breaks the PCA tier's write path down at",
        default="1 2",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_TTFTPCA_TIMEOUT",
        "ci",
        "seconds scripts/gpu_run.sh's ttftpca step may run (fits it into a device call with other steps)",
        default="560",
        read_by="scripts/gpu_run.sh",
    ),
    EnvVar(
        "LMTIER_GPU_PACK",
        "ci",
        "1: scripts/gpu_run.sh leaves $OUT as one out.tgz (the device tool returns only so many files)",
        default="0",
        read_by="scripts/gpu_run.sh",
    ),
)
"""Every ``LMTIER_*`` variable lmtier, its tests, benchmarks, build and scripts read."""

_CONFIG_KEY_OF = {PREFIX + key.upper(): key for key in KEYS}


def config_override_name(key: str) -> str:
    """``LMTIER_<KEY>``, the environment override of configuration key ``key``."""
    if key not in KEYS:
        raise KeyError(f"{key!r} is not a configuration key")
    return PREFIX + key.upper()


def config_key_of(name: str) -> str | None:
    """The configuration key ``name`` overrides (``LMTIER_CHUNK_SIZE`` -> ``chunk_size``), or None."""
    return _CONFIG_KEY_OF.get(name)


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of declared variable ``name`` in ``env`` (default ``os.environ``), its
    parsed default when unset, or None when unset without a default.

    Raises:
        KeyError: ``name`` is not declared in :data:`ENV_VARS` (declare it there).
        ValueError: the variable's parser rejects its text (e.g. a float variable set to ``"x"``).
    """
    try:
        var = ENV_VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in lmtier.envs.ENV_VARS") from None
    text = (os.environ if env is None else env).get(name)
    if text is None:
        text = var.default
    return None if text is None else var.parse(text)


def undeclared(env: Mapping[str, str] | None = None) -> list[str]:
    """Sorted names of the ``LMTIER_*`` variables in ``env`` (default ``os.environ``) that are not declared."""
    env = os.environ if env is None else env
    return sorted(n for n in env if n.startswith(PREFIX) and n not in ENV_VARS)


_WARNED: set[str] = set()


def warn_undeclared(env: Mapping[str, str] | None = None) -> list[str]:
    """Log one warning per undeclared ``LMTIER_*`` variable of ``env`` (once per name per process),
    naming it and the closest declared variable. Returns the undeclared names (warned now or before)."""
    names = undeclared(env)
    for name in names:
        if name in _WARNED:
            continue
        _WARNED.add(name)
        close = difflib.get_close_matches(name, ENV_VARS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        logger.warning(
            "lmtier: environment variable %s is not an lmtier variable and is ignored%s; "
            "declared variables are listed in lmtier.envs.ENV_VARS",
            name,
            hint,
        )
    return names


def __getattr__(name: str) -> Any:
    """``lmtier.envs.LMTIER_X``: the value of a declared variable (see :func:`get`)."""
    if name in ENV_VARS:
        return get(name)
    raise AttributeError(f"module 'lmtier.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(ENV_VARS))
