"""vLLM integration: :class:`LMTierConnector`, a ``KVConnectorBase_V1`` for vLLM 0.32 (CPU) / 0.33.

Enable with::

    --kv-transfer-config '{"kv_connector":"LMTierConnector",
                           "kv_connector_module_path":"lmtier.integration.vllm",
                           "kv_role":"kv_both"}'

and ``LMTIER_CONFIG_FILE=/path/to/lmtier.yaml`` (LMCache-style keys, see :mod:`lmtier.config`);
connector options go in ``kv_connector_extra_config`` (:mod:`lmtier.integration.vllm.options`).
A failed KV load is recomputed unless ``load_failure_policy`` is ``"fail"``
(:func:`lmtier.integration.vllm.connector.resolve_load_failure_policy`).
Installing the wheel also registers the short name through vLLM's ``vllm.general_plugins`` entry
point (:func:`register`), so ``kv_connector_module_path`` may be omitted.

Modules: ``connector`` (the facade vLLM loads), ``scheduler`` / ``worker_role`` (the two roles),
``worker`` / ``fetch`` (the data path; no vLLM import), ``metadata``, ``mirror``, ``options``,
``stats``, ``common``.
"""

from __future__ import annotations

_LAZY = {
    "LMTierConnector": "connector",
    "LMTierConnectorMetadata": "metadata",
    "LMTierWorkerMetadata": "metadata",
    "LMTierStats": "stats",
    "ConnectorOptions": "options",
}


def __getattr__(name: str):
    # Lazy: importing this package (vLLM loads plugins in every process) must not import vLLM's
    # worker machinery before vLLM itself is ready.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"lmtier.integration.vllm.{_LAZY[name]}"), name)
    raise AttributeError(name)


def register() -> None:
    """vLLM general-plugin entry point: register ``LMTierConnector`` by short name (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # vLLM not importable: nothing to register
        return
    if "LMTierConnector" not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector("LMTierConnector", "lmtier.integration.vllm.connector", "LMTierConnector")
