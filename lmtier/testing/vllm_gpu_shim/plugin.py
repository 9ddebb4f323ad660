"""The ``vllm.platform_plugins`` entry point of the shim (test scaffolding, see the package docstring).

:func:`detect` is what vLLM calls while it resolves ``current_platform``: it returns the qualified
name of :class:`lmtier.testing.vllm_gpu_shim.platform.ShimCudaPlatform` when NVML sees a GPU, else
None (vLLM then picks as it would without the plugin). This module imports no vLLM platform code, so
vLLM can load it before it has a platform; the class is imported only when vLLM resolves the name.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

log = logging.getLogger("vllm.lmtier.gpu_shim")

QUALNAME = "lmtier.testing.vllm_gpu_shim.platform.ShimCudaPlatform"
STUB_MODULES = ("vllm._C_stable_libtorch",)
"""Compiled extensions that vLLM imports unconditionally on CUDA and that are absent here: each becomes
an empty module (the ops vLLM then calls come from :mod:`lmtier.testing.vllm_gpu_shim.ops`)."""

FLASH_ATTN = "vllm.vllm_flash_attn"
FLASH_ATTN_EXPORTS = (
    "compile_flash_attn_varlen_func_from_specs",
    "fa_version_unsupported_reason",
    "flash_attn_varlen_func",
    "get_scheduler_metadata",
    "is_fa_version_supported",
)
"""What ``vllm/vllm_flash_attn/__init__.py`` exports (from its pure-Python ``flash_attn_interface``)."""


def _flash_attn_without_kernels() -> None:
    """``vllm.vllm_flash_attn`` as its ``__init__`` builds it, minus the final ``ImportError`` it raises
    when neither FlashAttention extension is there (``v1/attention/backends/fa_utils.py`` imports the
    package at its top on CUDA, and every attention layer module imports ``fa_utils``). The
    interface module reports FA2/FA3 unavailable, so vLLM never selects them; calling one fails."""
    if FLASH_ATTN in sys.modules:
        return
    spec = importlib.util.find_spec(FLASH_ATTN)
    if spec is None:  # pragma: no cover - not a vLLM 0.33 tree
        return
    pkg = importlib.util.module_from_spec(spec)  # the package, its __init__ not executed
    sys.modules[FLASH_ATTN] = pkg
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fai
    except Exception:
        del sys.modules[FLASH_ATTN]
        raise
    for name in FLASH_ATTN_EXPORTS:
        setattr(pkg, name, getattr(fai, name))
    pkg.__all__ = list(FLASH_ATTN_EXPORTS)


def install_stubs() -> None:
    """Put an empty module for each of :data:`STUB_MODULES` in ``sys.modules``, make
    ``vllm.vllm_flash_attn`` importable without its kernels and register the shim's ops (idempotent)."""
    from lmtier.testing.vllm_gpu_shim import ops

    for name in STUB_MODULES:
        if name not in sys.modules:
            mod = types.ModuleType(name, "lmtier test shim: stands in for vLLM's compiled extension")
            mod.__file__ = __file__
            sys.modules[name] = mod
    _flash_attn_without_kernels()
    ops.register()


def gpu_count() -> int:
    """GPUs NVML sees (through vLLM's own copy of pynvml), 0 when NVML is unavailable."""
    try:
        from vllm.utils.import_utils import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
        try:
            return int(nvml.nvmlDeviceGetCount())
        finally:
            nvml.nvmlShutdown()
    except Exception as e:  # no NVML / no driver: not a CUDA machine
        log.debug("lmtier gpu shim: NVML unavailable: %s", e)
        return 0


def detect() -> str | None:
    """The plugin: :data:`QUALNAME` on a machine with a GPU (stubs installed), else None."""
    if gpu_count() <= 0:
        return None
    install_stubs()
    return QUALNAME
