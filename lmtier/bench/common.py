"""Shared benchmark helpers: timing, system header, model geometry presets, table printing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Geometry:
    """KV geometry of one tensor-parallel rank of a model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    kind: str = "kv"  # "mla": one latent plane

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def bytes_per_token(self) -> int:
        planes = 1 if self.kind == "mla" else 2
        return self.num_layers * planes * self.num_kv_heads * self.head_size * torch.tensor([], dtype=self.torch_dtype).element_size()


PRESETS = {
    "llama-3.1-8b": Geometry("llama-3.1-8b", 32, 8, 128),
    "llama-3.1-70b-tp8": Geometry("llama-3.1-70b-tp8", 80, 1, 128),
    "qwen2.5-7b": Geometry("qwen2.5-7b", 28, 4, 128),
    "deepseek-v3-mla": Geometry("deepseek-v3-mla", 61, 1, 576, kind="mla"),
    "smollm2-135m": Geometry("smollm2-135m", 30, 3, 64),
}


def progress(iterable, **kwargs):
    """tqdm progress bar when tqdm is installed (it is a dependency; the GPU box may lack it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, **kwargs)


def system_header() -> dict:
    h = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        h["gpu"] = p.name
        h["gpu_count"] = torch.cuda.device_count()
        h["sms"] = p.multi_processor_count
    return h


def cuda_time_ms(fn: Callable[[], object], *, warmup: int = 3, iters: int = 10, stream=None) -> float:
    """Median milliseconds of ``fn`` timed with CUDA events on ``stream`` (default current).

    ``fn`` may enqueue work on other streams: the end event waits for a device-wide sync.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def event_time_ms(fn: Callable[[], object], stream, *, warmup: int = 2, iters: int = 10) -> float:
    """Median milliseconds of ``fn`` between two CUDA events recorded on ``stream`` (device time only)."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_time_ms(fn: Callable[[], object], *, warmup: int = 2, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return "" if v is None else str(v)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
