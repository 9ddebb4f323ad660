""":class:`ShimCudaPlatform`: vLLM's CUDA platform for the shimmed engine (test scaffolding, see the
package docstring). Importing this module installs the stub extension module first, because
``vllm/platforms/cuda.py`` imports ``vllm._C_stable_libtorch`` at its top.
"""

from __future__ import annotations

from lmtier.testing.vllm_gpu_shim.plugin import install_stubs

install_stubs()

from vllm.platforms.cuda import CudaPlatform  # noqa: E402  (after the stub module exists)

__all__ = ["ShimCudaPlatform"]


class ShimCudaPlatform(CudaPlatform):
    """vLLM's CUDA platform without vLLM's compiled kernels: the shim's ops are the "kernels", and
    vLLM IR ops (RMSNorm, fused add + RMSNorm) default to their PyTorch (``native``) implementations
    instead of the ``vllm_c`` CUDA kernels; ``gelu_and_mul_sparse`` keeps CUDA's Triton-first order."""

    @classmethod
    def import_kernels(cls) -> None:
        install_stubs()

    @classmethod
    def get_default_ir_op_priority(cls, vllm_config):
        from vllm.config.kernel import IrOpPriorityConfig

        return IrOpPriorityConfig.with_default(["native"], gelu_and_mul_sparse=["triton", "native"])
