"""The vLLM connector's option parsing and module boundaries, without a vLLM engine.

* :class:`lmtier.integration.vllm.options.ConnectorOptions` — strict ``kv_connector_extra_config``
  parsing (the defects: ``"async_loads": "false"`` turned async loads on, unknown keys were ignored;
  the connector-level tests of both are in tests/test_connector_scheduler.py).
* The data path (``lmtier.integration.vllm.worker`` and what it imports) imports nothing from vLLM:
  checked in a subprocess whose import system raises on any ``vllm`` module.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmtier.integration.vllm.options import DEFAULT_SYNC_DISK_LOAD_MIB, ConnectorOptions

REPO = Path(__file__).resolve().parents[1]


def test_defaults():
    o = ConnectorOptions.parse(None)
    assert o == ConnectorOptions.parse({}) == ConnectorOptions()
    assert o.async_loads is True and o.layerwise_loads is None
    assert o.sync_disk_load_mib == DEFAULT_SYNC_DISK_LOAD_MIB and o.sync_disk_load_busy_mib == 0
    assert o.sync_disk_load_bytes == int(DEFAULT_SYNC_DISK_LOAD_MIB * 2**20)


@pytest.mark.parametrize(
    "raw, want",
    [
        (False, False),
        (True, True),
        ("false", False),
        ("False", False),
        ("FALSE ", False),
        ("true", True),
        ("True", True),
    ],
)
def test_bools_are_parsed_not_truth_tested(raw, want):
    assert ConnectorOptions.parse({"async_loads": raw}).async_loads is want


@pytest.mark.parametrize("raw", ["no", "0", "", 0, 1, None, [], "off"])
def test_bad_bool_names_the_key(raw):
    with pytest.raises(ValueError, match="async_loads"):
        ConnectorOptions.parse({"async_loads": raw})


@pytest.mark.parametrize(
    "raw, want",
    [("auto", None), ("AUTO", None), (None, None), (True, True), ("true", True), (False, False), ("false", False)],
)
def test_layerwise_values(raw, want):
    assert ConnectorOptions.parse({"layerwise_loads": raw}).layerwise_loads is want


@pytest.mark.parametrize("raw", ["sometimes", 1, 0.5])
def test_bad_layerwise_names_the_key(raw):
    with pytest.raises(ValueError, match="layerwise_loads"):
        ConnectorOptions.parse({"layerwise_loads": raw})


@pytest.mark.parametrize("key", ["sync_disk_load_mib", "sync_disk_load_busy_mib"])
def test_sizes(key):
    assert getattr(ConnectorOptions.parse({key: 0}), key) == 0
    assert getattr(ConnectorOptions.parse({key: "1.5"}), key) == 1.5
    o = ConnectorOptions.parse({key: 2})
    assert getattr(o, key.replace("_mib", "_bytes")) == 2 * 2**20
    for bad in (-1, "lots", None, True, float("inf"), float("nan"), [1]):
        with pytest.raises(ValueError, match=f"{key}.*finite number >= 0"):
            ConnectorOptions.parse({key: bad})


def test_load_policy_options():
    o = ConnectorOptions()
    assert (o.load_policy, o.prefill_tokens_per_s, dict(o.load_prior_gbps)) == ("auto", None, {})
    assert (o.load_min_samples, o.load_hysteresis, o.load_probe_s) == (3, 0.1, 30.0)
    o = ConnectorOptions.parse(
        {
            "load_policy": " Always",
            "prefill_tokens_per_s": "2500",
            "load_prior_gbps": {"disk": 1.8, "remote": "0.5"},
            "load_min_samples": 5,
            "load_hysteresis": 0,
            "load_probe_s": 0,
        }
    )
    assert (o.load_policy, o.prefill_tokens_per_s, dict(o.load_prior_gbps)) == (
        "always",
        2500.0,
        {"disk": 1.8, "remote": 0.5},
    )
    assert (o.load_min_samples, o.load_hysteresis, o.load_probe_s) == (5, 0.0, 0.0)
    assert ConnectorOptions.parse({"prefill_tokens_per_s": None}).prefill_tokens_per_s is None


@pytest.mark.parametrize(
    "key, bad, msg",
    [
        ("load_policy", "never", 'must be "auto" or "always"'),
        ("load_policy", True, 'must be "auto" or "always"'),
        ("prefill_tokens_per_s", 0, "finite number > 0"),
        ("prefill_tokens_per_s", "fast", "finite number > 0"),
        ("prefill_tokens_per_s", True, "finite number > 0"),
        ("load_prior_gbps", 1.8, "must be an object"),
        ("load_prior_gbps", {"nvme": 1.8}, "unknown tier 'nvme'; known: cpu, disk, p2p, remote"),
        ("load_prior_gbps", {"disk": 0}, r"\.disk=0: must be a finite number > 0"),
        ("load_prior_gbps", {"disk": float("inf")}, r"\.disk=inf: must be a finite number > 0"),
        ("load_min_samples", 0, "finite number >= 1"),
        ("load_min_samples", 1.5, "integer >= 1"),
        ("load_min_samples", True, "finite number >= 1"),
        ("load_hysteresis", 1, ">= 0 and < 1"),
        ("load_hysteresis", -0.1, ">= 0 and < 1"),
        ("load_probe_s", -1, "finite number >= 0"),
        ("load_probe_s", float("nan"), "finite number >= 0"),
    ],
)
def test_bad_load_policy_options_name_the_key(key, bad, msg):
    with pytest.raises(ValueError, match=f"kv_connector_extra_config {key}.*{msg}"):
        ConnectorOptions.parse({key: bad})


def test_unknown_keys_are_errors_naming_them():
    with pytest.raises(ValueError, match="'asyncloads'.*known: async_loads"):
        ConnectorOptions.parse({"asyncloads": False})
    with pytest.raises(ValueError, match=r"did you mean load_policy for 'load_polcy'\?; known: "):
        ConnectorOptions.parse({"load_polcy": "auto"})
    with pytest.raises(ValueError, match="'a', 'b'"):
        ConnectorOptions.parse({"b": 1, "a": 2, "async_loads": True})


def test_unknown_keys_of_the_yaml_file_are_named_as_such():
    """A key of lmtier's YAML in kv_connector_extra_config is still refused, with where it belongs."""
    with pytest.raises(ValueError) as e:
        ConnectorOptions.parse({"codec_level": "pca_default", "codec_pca_model": "/m.lmtpca", "bogus": 1})
    msg = str(e.value)
    assert msg.startswith(
        "lmtier: kv_connector_extra_config: unknown key(s) 'bogus', 'codec_level', 'codec_pca_model';"
    )
    assert (
        "; 'codec_level', 'codec_pca_model' are keys of lmtier's YAML file (LMTIER_CONFIG_FILE), "
        "not of kv_connector_extra_config; known: async_loads" in msg
    )
    with pytest.raises(ValueError, match=r"'chunk_size' is a key of lmtier's YAML file \(LMTIER_CONFIG_FILE\)"):
        ConnectorOptions.parse({"chunk_size": 256})
    with pytest.raises(ValueError) as e:  # no YAML key: no such sentence
        ConnectorOptions.parse({"asyncloads": False})
    assert "YAML" not in str(e.value)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ConnectorOptions().async_loads = False  # type: ignore[misc]


_NO_VLLM = r"""
import importlib, sys

class NoVLLM:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise RuntimeError("imported " + name)  # not ImportError: a guarded import must fail too
        return None

sys.meta_path.insert(0, NoVLLM())
for m in sys.argv[1:]:
    importlib.import_module(m)
assert not any(k == "vllm" or k.startswith("vllm.") for k in sys.modules)
print("ok")
"""


@pytest.mark.parametrize(
    "module",
    [
        "lmtier.integration.vllm.worker",
        "lmtier.integration.vllm.fetch",
        "lmtier.integration.vllm.options",
        "lmtier.integration.vllm.mirror",
        "lmtier.integration.vllm.loadpolicy",
        "lmtier.integration.vllm",
    ],
)
def test_data_path_imports_no_vllm(module):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-c", _NO_VLLM, module], env=env, capture_output=True, text=True, timeout=120, cwd=str(REPO)
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_kv_roles_other_than_kv_both_are_refused(kv_role, monkeypatch):
    """``kv_role`` was ignored: a ``kv_consumer`` node (LMCache's read-only node) stored anyway, a
    ``kv_producer`` loaded anyway. Refused at start-up, before the config is read."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmtier.integration.vllm import connector as conn

    monkeypatch.setattr(conn, "load_config", lambda: pytest.fail("the config was read"))
    kt = SimpleNamespace(kv_role=kv_role, kv_connector_extra_config={})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=f"kv_role='{kv_role}': LMTierConnector supports only kv_both"):
            conn.LMTierConnector(SimpleNamespace(kv_transfer_config=kt), role, None)
