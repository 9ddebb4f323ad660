"""Configuration checks against this machine: disk paths (writable directories), physical memory
and file-system sizes; and the chunk size against the block sizes vLLM uses (a warning: the actual
block size is known, and checked, only at connector start). Used by :mod:`lmtier.config` when it
builds a config; no torch."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from urllib.parse import unquote

from lmtier.config_schema import config_error as _err

__all__ = [
    "VLLM_DEFAULT_BLOCK_SIZE",
    "check_readable_file",
    "filesystems_bytes",
    "parse_disk_paths",
    "physical_memory_bytes",
    "warn_chunk_size",
]

logger = logging.getLogger("lmtier.config")

VLLM_DEFAULT_BLOCK_SIZE = 16
"""vLLM's default KV block size in tokens on GPUs (``CacheConfig.block_size``; vllm/config/cache.py
and the CUDA platform's default); the block sizes in use (16, 32, 64, 128) are its multiples."""


def warn_chunk_size(chunk_size: int) -> bool:
    """Warn when ``chunk_size`` is not a multiple of :data:`VLLM_DEFAULT_BLOCK_SIZE`: under vLLM the
    connector refuses a chunk size that is not a multiple of the engine's block size (known only at
    connector start, :meth:`lmtier.config.LMTierConfig.validate_for`); the library API alone accepts
    any positive chunk size.

    Returns:
        True when it warned.
    """
    if chunk_size % VLLM_DEFAULT_BLOCK_SIZE == 0:
        return False
    logger.warning(
        "lmtier config: chunk_size=%d is not a multiple of %d (vLLM's default KV block size): "
        "the vLLM connector refuses a chunk size that is not a multiple of the engine's block size",
        chunk_size,
        VLLM_DEFAULT_BLOCK_SIZE,
    )
    return True


def parse_disk_paths(key: str, value: str) -> tuple[str, ...]:
    """``local_disk``'s comma-separated ``file://`` (or plain) paths as absolute directories.

    ``file:///abs/dir`` is ``/abs/dir``; ``file://rel/dir`` (LMCache's ``file://local_disk/``) and a
    plain ``rel/dir`` are relative to the current working directory, resolved here, once; ``~`` is
    expanded and percent-escapes are decoded.

    Raises:
        ConfigError: an empty item, another URL scheme, a NUL byte, a path listed twice, or a path
            whose nearest existing ancestor is not a writable directory (the message names ``key``).
    """
    paths: list[str] = []
    for part in value.split(","):
        item = part.strip()
        if not item:
            raise _err(key, value, "empty path in comma-separated list")
        if item.startswith("file://"):
            item = item[len("file://") :]
        elif "://" in item:
            raise _err(key, value, f"only file:// paths are supported, got {part.strip()!r}")
        if not item:
            raise _err(key, value, "empty path")
        path = os.path.abspath(os.path.expanduser(unquote(item)))
        if "\x00" in path:
            raise _err(key, value, "path contains a NUL byte")
        _check_writable_dir(key, value, path)
        if path in paths:
            raise _err(key, value, f"path {path!r} listed twice")
        paths.append(path)
    return tuple(paths)


def physical_memory_bytes() -> int:
    """Total physical memory in bytes, or 0 when the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _existing_ancestor(path: str) -> str:
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def filesystems_bytes(paths: Sequence[str]) -> int:
    """Total size in bytes of the file systems that hold ``paths`` (each path's nearest existing
    ancestor), each file system counted once (folders on one file system share its size); 0 if any
    is unknown."""
    sizes: dict[int, int] = {}
    for path in paths:
        probe = _existing_ancestor(path)
        try:
            dev, st = os.stat(probe).st_dev, os.statvfs(probe)
        except OSError:
            return 0
        if not (size := st.f_frsize * st.f_blocks):
            return 0
        sizes[dev] = size
    return sum(sizes.values())


def _check_writable_dir(key: str, value: str, path: str) -> None:
    probe = _existing_ancestor(path)
    if not os.path.isdir(probe):
        raise _err(key, value, f"{probe!r} exists and is not a directory")
    try:  # not os.access, which root passes everywhere: an unnamed file, made and dropped (nothing stays)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise _err(key, value, f"directory {probe!r} is not writable ({e.strerror or e})") from None


def check_readable_file(key: str, value: str) -> str:
    """``value`` (a path; ``~`` expanded, relative to the working directory) as an absolute path of a
    readable regular file (its content is the reader's business).

    Raises:
        ConfigError: a NUL byte, nothing there, not a regular file, not readable (the message names
            ``key``).
    """
    if "\x00" in value:
        raise _err(key, value, "path contains a NUL byte")
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.exists(path):
        url = " (a plain path, not a file:// URL as local_disk takes)" if value.startswith("file:") else ""
        raise _err(key, value, f"{path!r} does not exist{url}")
    if not os.path.isfile(path):
        raise _err(key, value, f"{path!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise _err(key, value, f"{path!r} is not readable")
    return path
