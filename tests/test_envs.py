"""lmtier.envs: one registry of every environment variable lmtier reads."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from lmtier import envs
from lmtier.config_schema import KEYS

REPO = Path(__file__).resolve().parent.parent

# A variable read from the environment: os.environ[...] / .get(...) / getenv(...), envs.get(...) /
# envs.X, "X" in os.environ, and shell ${X...} / $X.
_READS = re.compile(
    r"""(?:environ(?:\.get)?\(?\[?\s*|getenv\(\s*|envs\.get\(\s*)["'](LMTIER_[A-Z0-9_]+)["']"""
    r"""|envs\.(LMTIER_[A-Z0-9_]+)|["'](LMTIER_[A-Z0-9_]+)["']\s+in\s+os\.environ|\$\{?(LMTIER_[A-Z0-9_]+)"""
)


def _sources():
    for pattern in (
        "lmtier/**/*.py",
        "tests/**/*.py",
        "benchmarks/**/*.py",
        "scripts/**/*",
        "examples/**/*.py",
        "setup.py",
        ".ci/*",
    ):
        for p in REPO.glob(pattern):
            if (
                p.is_file()
                and p.suffix in ("", ".py", ".sh")
                and "results" not in p.parts
                and p.name not in ("envs.py", "test_envs.py")
            ):
                yield p


def test_every_variable_read_in_the_tree_is_declared():
    found: dict[str, str] = {}
    for p in _sources():
        for m in _READS.finditer(p.read_text(errors="replace")):
            name = next(g for g in m.groups() if g)
            found.setdefault(name, str(p.relative_to(REPO)))
    assert "LMTIER_REQUIRE_REDIS" in found and "LMTIER_BENCH_SMOKE" in found  # the scan sees reads
    assert {n: where for n, where in found.items() if n not in envs.ENV_VARS} == {}


def test_registry_declares_every_config_override_with_a_meaning():
    for key in KEYS:
        name = envs.config_override_name(key)
        assert envs.ENV_VARS[name].group == "config" and envs.config_key_of(name) == key
    assert envs.config_key_of("LMTIER_REDIS_URL") is None and envs.config_key_of("LMTIER_CONFIG_FILE") is None
    assert all(v.meaning and v.group in envs.GROUPS for v in envs.ENV_VARS.values())


def test_get_parses_and_defaults(monkeypatch):
    assert envs.get("LMTIER_REQUIRE_REDIS", {}) is False
    assert envs.get("LMTIER_REQUIRE_REDIS", {"LMTIER_REQUIRE_REDIS": "1"}) is True
    assert envs.get("LMTIER_FUZZ_EXAMPLES", {"LMTIER_FUZZ_EXAMPLES": "2.5"}) == 2.5
    assert envs.get("LMTIER_FAULT_INJECT", {"LMTIER_FAULT_INJECT": "load, store"}) == {"load", "store"}
    assert envs.get("LMTIER_REDIS_URL", {}) is None
    monkeypatch.setenv("LMTIER_REDIS_URL", "redis://h:1")
    assert envs.LMTIER_REDIS_URL == "redis://h:1"  # vLLM-style attribute, read at each access
    with pytest.raises(KeyError, match="LMTIER_NOPE"):
        envs.get("LMTIER_NOPE")
    with pytest.raises(AttributeError):
        envs.LMTIER_NOPE  # noqa: B018


def test_undeclared_warns_once_per_name(caplog):
    env = {"LMTIER_ENVS_TEST_ONCE": "1", "PATH": "/bin"}
    with caplog.at_level(logging.WARNING, logger="lmtier.envs"):
        assert envs.warn_undeclared(env) == ["LMTIER_ENVS_TEST_ONCE"]
        assert envs.warn_undeclared(env) == ["LMTIER_ENVS_TEST_ONCE"]
    assert caplog.text.count("LMTIER_ENVS_TEST_ONCE") == 1
