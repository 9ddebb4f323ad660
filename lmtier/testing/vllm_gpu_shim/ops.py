"""The compiled vLLM 0.33 ops the shimmed engine calls, in Python (test scaffolding, see the package).

Registered under vLLM's own op names with ``torch.library`` (so every caller, whenever it was
imported, finds them):

* ``torch.ops._C.weak_ref_tensor(t)`` — a tensor aliasing ``t``'s memory that does not keep it alive
  (vLLM's CUDA-graph code keeps graph outputs this way). Built from the raw address through
  ``__cuda_array_interface__`` (CUDA) or a ctypes buffer (CPU), like vLLM's ``from_blob`` with no
  deleter.
* ``torch.ops._C.get_cuda_view_from_cpu_tensor(t)`` — a CUDA tensor over the pinned CPU tensor ``t``
  (Model Runner V2's UVA buffers). With unified addressing, pinned memory from ``cudaHostAlloc`` has
  the same address on the device (CUDA runtime API, "Unified Addressing"); the view keeps ``t`` alive.
* ``torch.ops._C_cache_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any)``
  — vLLM's native offloading DMA: one ``cuMemcpyBatchAsync`` over the three int64 CPU arrays on the
  current stream, source access order STREAM (or ANY), as vLLM's ``csrc/cache_kernels.cu`` does;
  called through ctypes on the arrays' memory (no per-descriptor Python work). If the driver lacks
  the batch call, a loop of ``cuMemcpyAsync`` (vLLM's own fallback before CUDA 12.8).

* ``torch.ops._C.silu_and_mul(out, x)`` and the other gated activations of dense models
  (:data:`GATED_ACTIVATIONS`): PyTorch versions with vLLM's semantics (``x = [gate | up]`` on the last
  dimension, ``out = act(gate) * up``; ``mul_and_silu``: ``out = gate * silu(up)``). vLLM's
  ``SiluAndMul`` takes the op in its constructor on CUDA; with ``custom_ops: none`` the forward uses
  ``forward_native`` and these are not called.
* ``torch.ops._C.<kernel>_supported(capability)`` queries (``cutlass_scaled_mm_supports_fp8`` and
  kin: :data:`ABSENT_KERNEL_QUERIES`) answer False: those CUTLASS kernels are not here. vLLM asks some
  of them at import time (``quantization/utils/w8a8_utils.py``).

Everything else in ``torch.ops._C`` stays missing and fails loudly when called.
"""

from __future__ import annotations

import ctypes
import threading

import torch

__all__ = ["register", "weak_ref_tensor", "cuda_view_from_cpu_tensor", "swap_blocks_batch"]

_LIBS: list = []  # the torch.library.Library objects (registrations live as long as they do)
_LOCK = threading.Lock()


class _DeviceArray:
    """A ``__cuda_array_interface__`` (v2) over ``nbytes`` bytes at device address ``ptr``; ``owner`` is
    kept alive as long as a tensor made from it (None: a weak view)."""

    def __init__(self, ptr: int, nbytes: int, owner: object = None) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}
        self._owner = owner


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (strided footprint)."""
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return (last + 1) * t.element_size()


def _view_like(raw: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8 bytes starting at ``t.data_ptr()``) viewed with ``t``'s dtype, sizes and strides."""
    return raw.view(t.dtype).as_strided(t.shape, t.stride())


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory (same dtype, shape, strides, device) that does not own it.

    Raises:
        ValueError: an empty tensor (vLLM never asks for one) or a device other than CPU/CUDA.
    """
    if t.numel() == 0:
        raise ValueError("weak_ref_tensor of an empty tensor")
    nbytes = _extent_bytes(t)
    if t.device.type == "cuda":
        raw = torch.as_tensor(_DeviceArray(t.data_ptr(), nbytes), device=t.device)
    elif t.device.type == "cpu":
        buf = (ctypes.c_uint8 * nbytes).from_address(t.data_ptr())
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        raise ValueError(f"weak_ref_tensor: unsupported device {t.device}")
    return _view_like(raw, t)


def cuda_view_from_cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the pinned CPU tensor ``t`` (same dtype, shape, strides); keeps ``t`` alive.

    Raises:
        ValueError: ``t`` is not a pinned CPU tensor.
    """
    if t.device.type != "cpu" or not t.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor needs a pinned CPU tensor")
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device="cuda")
    raw = torch.as_tensor(_DeviceArray(t.data_ptr(), _extent_bytes(t), owner=t))
    if raw.device.type != "cuda":  # pragma: no cover - torch decides from the pointer's attributes
        raise RuntimeError(f"pinned memory mapped to {raw.device}, expected a CUDA device")
    return _view_like(raw, t)


# ------------------------------------------------------------------------------ cuMemcpyBatchAsync
class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (CUDA >= 12.8)
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_SRC_ACCESS_ORDER_STREAM = 1
_SRC_ACCESS_ORDER_ANY = 3
_DRIVER: dict = {}


def _driver() -> dict:
    """libcuda's batch copy entry point: ``("v2", fn)`` (CUDA 13 ABI, no ``failIdx``), ``("v1", fn)``
    (CUDA 12.8 ABI) or ``("loop", cuMemcpyAsync)``; plus ``cuGetErrorString``."""
    with _LOCK:
        if _DRIVER:
            return _DRIVER
        lib = ctypes.CDLL("libcuda.so.1")
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        if hasattr(lib, "cuMemcpyBatchAsync_v2"):
            fn = lib.cuMemcpyBatchAsync_v2
            fn.argtypes = [vp, vp, vp, sz, ctypes.POINTER(_MemcpyAttributes), vp, sz, vp]
            _DRIVER["batch"] = ("v2", fn)
        elif hasattr(lib, "cuMemcpyBatchAsync"):
            fn = lib.cuMemcpyBatchAsync
            fn.argtypes = [vp, vp, vp, sz, ctypes.POINTER(_MemcpyAttributes), vp, sz, vp, vp]
            _DRIVER["batch"] = ("v1", fn)
        else:
            fn = lib.cuMemcpyAsync
            fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, sz, vp]
            _DRIVER["batch"] = ("loop", fn)
        fn.restype = ctypes.c_int
        err = lib.cuGetErrorString
        err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        err.restype = ctypes.c_int
        _DRIVER["err"] = err
        return _DRIVER


def _check(rc: int, what: str) -> None:
    if rc != 0:
        s = ctypes.c_char_p()
        _driver()["err"](rc, ctypes.byref(s))
        raise RuntimeError(f"{what} failed: CUresult {rc} ({(s.value or b'?').decode()})")


def batch_api() -> str:
    """Which driver entry point :func:`swap_blocks_batch` uses: ``"v2"``, ``"v1"`` or ``"loop"``."""
    return _driver()["batch"][0]


def swap_blocks_batch(
    src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor, is_src_access_order_any: bool = False
) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every ``i`` (device or pinned
    host addresses), asynchronously on the current CUDA stream, in one driver call.

    Args:
        src_ptrs, dst_ptrs, sizes: 1-D int64 CPU tensors of equal length.
        is_src_access_order_any: the driver may read sources out of stream order (only safe when no
            stream writes them meanwhile).

    Raises:
        ValueError: wrong device, dtype or lengths. RuntimeError: the driver call failed.
    """
    for name, t in (("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs), ("sizes", sizes)):
        if t.device.type != "cpu" or t.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 CPU tensor")
    n = src_ptrs.numel()
    if dst_ptrs.numel() != n or sizes.numel() != n:
        raise ValueError("src_ptrs, dst_ptrs and sizes must have the same length")
    if n == 0:
        return
    src, dst, siz = src_ptrs.contiguous(), dst_ptrs.contiguous(), sizes.contiguous()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    kind, fn = _driver()["batch"]
    if kind == "loop":
        for s, d, k in zip(src.tolist(), dst.tolist(), siz.tolist()):
            _check(fn(d, s, k, stream), "cuMemcpyAsync")
        return
    attr = _MemcpyAttributes()
    attr.srcAccessOrder = _SRC_ACCESS_ORDER_ANY if is_src_access_order_any else _SRC_ACCESS_ORDER_STREAM
    idx = ctypes.c_size_t(0)
    args = [
        ctypes.c_void_p(dst.data_ptr()),
        ctypes.c_void_p(src.data_ptr()),
        ctypes.c_void_p(siz.data_ptr()),
        ctypes.c_size_t(n),
        ctypes.byref(attr),
        ctypes.byref(idx),
        ctypes.c_size_t(1),
    ]
    if kind == "v1":
        fail = ctypes.c_size_t(0)
        args.append(ctypes.byref(fail))
    _check(fn(*args, stream), "cuMemcpyBatchAsync")


# ------------------------------------------------------------------------------ registration
ABSENT_KERNEL_QUERIES = (
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
)
"""``torch.ops._C`` capability queries ``(int cuda_device_capability) -> bool`` that answer False."""


def _absent(cuda_device_capability: int) -> bool:
    return False


def _gated(act):
    def kernel(out: torch.Tensor, x: torch.Tensor) -> None:
        d = x.shape[-1] // 2
        out.copy_(act(x[..., :d]) * x[..., d:])

    return kernel


def _mul_and_silu(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(x[..., :d] * torch.nn.functional.silu(x[..., d:]))


GATED_ACTIVATIONS = {
    "silu_and_mul": _gated(torch.nn.functional.silu),
    "mul_and_silu": _mul_and_silu,
    "gelu_and_mul": _gated(lambda g: torch.nn.functional.gelu(g, approximate="none")),
    "gelu_tanh_and_mul": _gated(lambda g: torch.nn.functional.gelu(g, approximate="tanh")),
}
"""``torch.ops._C`` gated activations ``(Tensor! out, Tensor input) -> ()`` in PyTorch."""


def _ops() -> list[tuple[str, str, str, object, tuple[str, ...]]]:
    """(namespace, name, schema, Python kernel, dispatch keys) of every op the shim provides."""
    ops = [
        ("_C", "weak_ref_tensor", "(Tensor tensor) -> Tensor", weak_ref_tensor, ("CPU", "CUDA")),
        ("_C", "get_cuda_view_from_cpu_tensor", "(Tensor cpu_tensor) -> Tensor", cuda_view_from_cpu_tensor, ("CPU",)),
        (
            "_C_cache_ops",
            "swap_blocks_batch",
            "(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, bool is_src_access_order_any) -> ()",
            swap_blocks_batch,
            ("CPU",),
        ),
    ]
    ops += [
        ("_C", q, "(int cuda_device_capability) -> bool", _absent, ("CompositeExplicitAutograd",))
        for q in ABSENT_KERNEL_QUERIES
    ]
    ops += [
        ("_C", name, "(Tensor! out, Tensor input) -> ()", fn, ("CPU", "CUDA")) for name, fn in GATED_ACTIVATIONS.items()
    ]
    return ops


def _exists(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def register() -> list[str]:
    """Register the shim's ops under ``torch.ops._C`` / ``torch.ops._C_cache_ops`` where no op of that
    name exists yet (a real vLLM extension loaded first keeps its own); idempotent. Returns the
    ``namespace::name`` of the ops this call registered."""
    done = []
    with _LOCK:
        libs: dict[str, torch.library.Library] = {}
        for ns, name, schema, fn, keys in _ops():
            if _exists(ns, name):
                continue
            if ns not in libs:
                libs[ns] = torch.library.Library(ns, "FRAGMENT")
            libs[ns].define(name + schema)
            for key in keys:
                libs[ns].impl(name, fn, key)
            done.append(f"{ns}::{name}")
        _LIBS.extend(libs.values())
    return done
