"""Shared benchmark helpers: timing, system header, table printing, plots (presets: :mod:`lmtier.bench.presets`)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from lmtier.bench.args import output_file
from lmtier.bench.presets import PRESETS, preset_help


def add_common_args(p, *, default_preset: str = "llama-3.1-8b") -> None:
    """``--model-preset`` (KV geometry), ``--plot PATH`` (PNG) and ``--quiet`` (no progress bars),
    shared by every ``lmtier bench`` subcommand."""
    p.add_argument(
        "--model-preset",
        default=default_preset,
        type=str.lower,
        choices=sorted(PRESETS),
        help="KV geometry of one TP rank: " + preset_help(),
    )
    p.add_argument(
        "--plot", type=output_file, default=None, metavar="PATH", help="write a PNG plot of the results (matplotlib)"
    )
    if not any("--quiet" in a.option_strings for a in p._actions):
        p.add_argument("--quiet", action="store_true", help="no progress bars")


def plot_series(
    path: str,
    series: dict[str, list[tuple[float, float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    hlines: dict[str, float] | None = None,
    xticks: list | None = None,
) -> str | None:
    """Line plot of ``{label: [(x, y), ...]}`` (+ dashed horizontal ceilings) to PNG ``path``.

    Returns None on success, else why nothing was written (matplotlib missing, no data)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    series = {k: v for k, v in series.items() if v}
    if not series and not hlines:
        return "nothing to plot"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    for label, y in (hlines or {}).items():
        if y:
            ax.axhline(y, linestyle="--", linewidth=1, color="gray")
            ax.annotate(label, xy=(0.01, y), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if xticks:
        ax.set_xticks(xticks)
        ax.set_xticklabels([str(x) for x in xticks], rotation=45)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


def plot_bars(
    path: str,
    groups: list[str],
    bars: dict[str, list[float | None]],
    *,
    title: str,
    ylabel: str,
    hlines: dict[str, float] | None = None,
) -> str | None:
    """Grouped bar chart: ``groups`` on x, one bar per ``bars`` label (None = missing) to PNG ``path``.
    Returns None on success, else why nothing was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    if not groups or not bars:
        return "nothing to plot"
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) + 3), 4.5))
    w = 0.8 / len(bars)
    for i, (label, ys) in enumerate(bars.items()):
        xs = [g + (i - (len(bars) - 1) / 2) * w for g in range(len(groups))]
        ax.bar(xs, [y if y is not None else 0 for y in ys], width=w, label=label)
    for label, y in (hlines or {}).items():
        if y:
            ax.axhline(y, linestyle="--", linewidth=1, color="gray")
            ax.annotate(label, xy=(0.01, y), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


def report_plot(path: str | None, why: str | None) -> None:
    """Print where the plot went (or why not)."""
    if path:
        print(f"plot: skipped — {why}" if why else f"wrote {path}")


def odirect_read_gbps(
    path: str, *, piece_bytes: int = 8 << 20, inflight: int = 4, limit_bytes: int | None = None
) -> float:
    """GB/s of reading file ``path`` with O_DIRECT in ``piece_bytes`` pieces, ``inflight`` preads at
    once (threads; ``os.preadv`` releases the GIL) into page-aligned buffers: the raw device's
    parallel read ceiling (``dd`` is one read in flight). Falls back to buffered reads where
    O_DIRECT is refused (tmpfs). Raises ``OSError`` if the file cannot be read."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    if piece_bytes <= 0 or piece_bytes % 4096 or inflight < 1:
        raise ValueError("piece_bytes must be a positive multiple of 4096 and inflight >= 1")
    size = os.path.getsize(path)
    if limit_bytes is not None:
        size = min(size, limit_bytes)
    size -= size % 4096
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    bufs = [mmap.mmap(-1, piece_bytes) for _ in range(inflight)]  # page aligned
    offs = list(range(0, size, piece_bytes))
    try:

        def worker(j):  # worker j reads pieces j, j + inflight, ... into its own buffer
            got_total = 0
            for off in offs[j::inflight]:
                mv = memoryview(bufs[j])[: min(piece_bytes, size - off)]
                got = os.preadv(fd, [mv], off)
                if got <= 0:
                    raise OSError(f"short read at offset {off}")
                got_total += got
            return got_total

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=inflight) as pool:
            total = sum(pool.map(worker, range(inflight)))
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        for b in bufs:
            b.close()


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
            json.dump(
                payload, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)
            )


def cpu_seconds(pids) -> float | None:
    """CPU time (seconds, user + system) the live threads of processes ``pids`` consumed so far,
    from Linux ``/proc/<pid>/task/*/schedstat`` (nanoseconds; threads that exited meanwhile are not
    counted); None without it. The batch benchmarks report the CPU an operation costs beside its wall
    time: on a loaded 2-core box the wall time mostly measures the scheduler, the CPU cost less so."""
    import glob

    total = 0
    for pid in pids:
        files = glob.glob(f"/proc/{pid}/task/*/schedstat")
        if not files:
            return None
        for f in files:
            try:
                with open(f) as fh:
                    total += int(fh.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def interleaved(whos: list[str], it: int) -> list[str]:
    """``whos`` rotated by ``it``: each iteration starts with another contender, so none always
    runs first (after the others' page faults, with their cache state) — the batch benchmarks time
    raw and tier alternately."""
    k = it % len(whos)
    return whos[k:] + whos[:k]


def pair_ratios(num: list[float], den: list[float]) -> list[float]:
    """Per-iteration ratios ``num[i] / den[i]`` in percent (same-iteration pairs of GB/s)."""
    return [100 * a / b for a, b in zip(num, den, strict=True) if b > 0]


def pairs_summary(ratios: list[float]) -> str:
    """``"median [lowest-highest]"`` of same-iteration ratios (percent): pairs timed moments apart
    share the box's load, so their median is the figure to read on a shared machine."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.0f} [{min(ratios):.0f}-{max(ratios):.0f}]"


def add_batch_args(ap) -> None:
    """The options of the batch-transfer benchmarks (``lmtier bench mooncake``, ``p2p``):
    ``--presets``, ``--counts``, ``--chunk-tokens``, ``--iters``, ``--quick``, ``--json``."""
    from lmtier.bench.args import bounded_int, int_list, name_list

    ap.add_argument(
        "--presets",
        type=name_list(PRESETS),
        default=["smollm2-135m", "llama-3.1-8b"],
        help="comma-separated model presets",
    )
    ap.add_argument("--counts", type=int_list(min_value=1), default=[8, 32], help="chunks per batch, comma-separated")
    ap.add_argument("--chunk-tokens", type=bounded_int(min_value=1), default=256)
    ap.add_argument("--iters", type=bounded_int(min_value=1), default=3)
    ap.add_argument("--quick", action="store_true", help="SmolLM2, 8 chunks, 1 iteration")
    ap.add_argument("--json", type=output_file)


def batch_scope(a) -> tuple[list[str], list[int]]:
    """The presets and chunk counts :func:`add_batch_args`' options ask for; ``--quick`` (or
    ``LMTIER_BENCH_SMOKE``): the first preset, 8 chunks, and ``a.iters`` set to 1."""
    from lmtier import envs

    if a.quick or envs.LMTIER_BENCH_SMOKE:
        a.iters = 1
        return a.presets[:1], [8]
    return a.presets, a.counts
