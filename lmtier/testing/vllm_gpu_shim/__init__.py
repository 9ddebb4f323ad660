"""Test scaffolding: run vLLM 0.33's real engine on a CUDA machine from its Python-only files.

The lent GPU machine has torch 2.11 and reaches no registry; vLLM 0.33's CUDA wheel pins torch 2.14
and its compiled parts (~790 MB) do not load on torch 2.11. ``scripts/bundle_vllm.sh`` carries the
wheel's Python files; this package supplies the little vLLM then still needs, so that vLLM's own
engine (scheduler, KV cache manager, KV connectors, Model Runner, ``TRITON_ATTN``) runs unchanged.
It is not product code: nothing in ``lmtier`` imports it.

Why vLLM finds no platform without it (``vllm/platforms/__init__.py``, ``cuda.py`` of 0.33.0):

1. ``cuda_platform_plugin()`` imports ``vllm.third_party.pynvml`` and reads vLLM's version through
   ``importlib.metadata`` (to rule out a CPU build); without ``third_party/pynvml.py`` or the
   ``dist-info`` the exception is swallowed and CUDA is not detected (the bundle keeps both);
2. resolving ``vllm.platforms.cuda.CudaPlatform`` runs ``import vllm._C_stable_libtorch`` at the top
   of ``cuda.py``: an ``ImportError`` without the compiled extension, so ``current_platform`` ends up
   ``UnspecifiedPlatform`` (device type ``""``: "Device string must not be empty" in ``DeviceConfig``).

What this package does, through vLLM's documented out-of-tree platform plugin mechanism (entry point
group ``vllm.platform_plugins``, see :func:`write_entry_point`):

* :func:`lmtier.testing.vllm_gpu_shim.plugin.detect` (the plugin) puts an empty
  ``vllm._C_stable_libtorch`` module in ``sys.modules`` and registers the few compiled ops the engine
  calls on this path (:mod:`.ops`), then names :class:`~.platform.ShimCudaPlatform`;
* ``ShimCudaPlatform`` is vLLM's ``CudaPlatform`` with two changes: ``import_kernels`` loads the
  shim's ops instead of the extension, and the vLLM IR op priority is ``native`` (PyTorch) instead of
  ``vllm_c`` (the compiled RMSNorm kernels).

Engine settings this supports: a dense model (Llama), ``attention_backend="TRITON_ATTN"``,
``compilation_config={"custom_ops": ["none"]}`` (every CustomOp runs ``forward_native``), eager or
CUDA graphs without ``torch.compile``, greedy sampling, TP = 1. A compiled op outside :mod:`.ops`
fails loudly (``AttributeError: '_OpNamespace' '_C' object has no attribute ...``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ENTRY_POINT", "write_entry_point"]

ENTRY_POINT = "lmtier_cuda_shim = lmtier.testing.vllm_gpu_shim.plugin:detect"
"""The ``vllm.platform_plugins`` entry point (``name = module:function``)."""


def write_entry_point(site_dir: str | Path) -> Path:
    """Make the plugin discoverable: write a minimal ``lmtier_vllm_gpu_shim-0.dist-info`` (METADATA
    and ``entry_points.txt``) into ``site_dir``, a folder on ``sys.path``/``PYTHONPATH`` of every vLLM
    process. Returns the dist-info folder. Idempotent."""
    d = Path(site_dir) / "lmtier_vllm_gpu_shim-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: lmtier-vllm-gpu-shim\nVersion: 0\n")
    (d / "entry_points.txt").write_text(f"[vllm.platform_plugins]\n{ENTRY_POINT}\n")
    return d
