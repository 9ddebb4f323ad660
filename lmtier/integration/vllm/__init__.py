"""vLLM integration: :class:`LMTierConnector`, a ``KVConnectorBase_V1`` for vLLM 0.32 (CPU) / 0.33.

Enable with::

    --kv-transfer-config '{"kv_connector":"LMTierConnector",
                           "kv_connector_module_path":"lmtier.integration.vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

and ``LMTIER_CONFIG_FILE=/path/to/lmtier.yaml`` (LMCache-style keys, see :mod:`lmtier.config`).
Installing the wheel also registers the short name through vLLM's ``vllm.general_plugins`` entry
point (:func:`register`), so ``kv_connector_module_path`` may be omitted.
"""

from __future__ import annotations


def __getattr__(name: str):
    # Lazy: importing this package (vLLM loads plugins in every process) must not import vLLM's
    # worker machinery before vLLM itself is ready.
    if name in ("LMTierConnector", "LMTierConnectorMetadata", "LMTierStats"):
        from lmtier.integration.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)


def register() -> None:
    """vLLM general-plugin entry point: register ``LMTierConnector`` by short name (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # vLLM not importable: nothing to register
        return
    if "LMTierConnector" not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector("LMTierConnector", "lmtier.integration.vllm.connector", "LMTierConnector")
