"""Smoke checks of LMTierConnector against the installed vLLM (0.32 or 0.33; no GPU needed): import,
factory resolution (``kv_connector_module_path`` and the plugin's short name), classmethods, and that
every hook the connector overrides accepts the arguments vLLM's base class declares.

Usage: VENV/bin/python scripts/vllm_connector_smoke.py   (exit status 1 on any failed check)
"""

import inspect
import sys

import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from lmtier.integration.vllm import register
from lmtier.integration.vllm.connector import LMTierConnector

print("vllm", vllm.__version__)
ok = True


def check(name, cond):
    global ok
    ok &= bool(cond)
    print(("ok   " if cond else "FAIL ") + name)


kt = KVTransferConfig(
    kv_connector="LMTierConnector",
    kv_connector_module_path="lmtier.integration.vllm",
    kv_role="kv_both",
    kv_load_failure_policy="recompute",
)
check(
    "factory: kv_connector_module_path resolves LMTierConnector",
    KVConnectorFactory.get_connector_class(kt) is LMTierConnector,
)
check(
    "factory: no HMA support declared (vLLM turns the hybrid KV cache manager off)",
    KVConnectorFactory.supports_hma_config(kt) is False,
)
register()
kt2 = KVTransferConfig(kv_connector="LMTierConnector", kv_role="kv_both")
check(
    "factory: short name after the plugin's register()", KVConnectorFactory.get_connector_class(kt2) is LMTierConnector
)
if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):  # vLLM >= 0.33
    check("supports_sleep_mode", LMTierConnector.supports_sleep_mode(kt) is True)
check(
    "requires_piecewise_for_cudagraph({'layerwise_loads': True})",
    LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": True}) is True,
)
check("requires_piecewise_for_cudagraph({})", LMTierConnector.requires_piecewise_for_cudagraph({}) is False)
check(
    "requires_piecewise_for_cudagraph({'layerwise_loads': 'auto'})",
    LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": "auto"}) is False,
)

# Signatures: every base-class hook the connector overrides must accept the base's parameters.
for name, base_fn in inspect.getmembers(KVConnectorBase_V1, predicate=callable):
    if name.startswith("__") or name not in LMTierConnector.__dict__:
        continue
    try:
        bs, cs = inspect.signature(base_fn), inspect.signature(getattr(LMTierConnector, name))
    except (TypeError, ValueError):
        continue
    cparams = cs.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in cparams.values())
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in cparams.values())
    missing = [
        p
        for p in bs.parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and p.name not in cparams
        and not (var_kw and p.kind is p.KEYWORD_ONLY)
    ]
    npos_base = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in bs.parameters.values())
    npos_conn = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in cparams.values())
    extra_required = [
        p.name
        for p in cparams.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in bs.parameters
    ]
    good = not missing and (var_pos or npos_conn >= npos_base) and not extra_required
    check(f"signature {name}{cs} vs base {bs}", good)
new_in_base = [
    n
    for n in ("unregister_kv_caches", "restore_kv_caches", "finish_forward", "supports_sleep_mode")
    if hasattr(KVConnectorBase_V1, n)
]
print("base hooks present:", new_in_base, "overridden:", [n for n in new_in_base if n in LMTierConnector.__dict__])
sys.exit(0 if ok else 1)
