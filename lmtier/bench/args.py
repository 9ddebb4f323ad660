"""Argument types shared by every ``lmtier bench`` parser: bounded numbers and comma-separated lists.

Each factory returns an ``argparse`` ``type=`` callable that converts one command-line string or
raises :class:`argparse.ArgumentTypeError`, so a bad value ends as argparse's usage error (exit
status 2, ``lmtier bench transfer: error: argument --batches: expected comma-separated integers
>= 1, got 'abc'``) instead of a traceback from the benchmark's body. argparse also applies the
type to a string default, so ``default="1,4,8"`` parses to ``[1, 4, 8]``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

__all__ = [
    "bounded_int",
    "bounded_float",
    "int_list",
    "float_list",
    "name_list",
    "output_file",
    "output_directory",
    "model_directory",
    "redis_url",
    "ping_redis",
]


def _bounds(lo: float | None, hi: float | None, *, above: bool = False) -> str:
    parts = []
    if lo is not None:
        parts.append(f"> {lo:g}" if above else f">= {lo:g}")
    if hi is not None:
        parts.append(f"<= {hi:g}")
    return " " + " and ".join(parts) if parts else ""


def _int(text: str, lo: int | None, hi: int | None) -> int:
    v = int(text.strip())  # ValueError: caller reports
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(text)
    return v


def _float(text: str, lo: float | None, above: bool) -> float:
    v = float(text.strip())
    if not math.isfinite(v) or (lo is not None and (v <= lo if above else v < lo)):
        raise ValueError(text)
    return v


def bounded_int(*, min_value: int | None = None, max_value: int | None = None) -> Callable[[str], int]:
    """An integer in ``[min_value, max_value]`` (either bound optional)."""
    what = "an integer" + _bounds(min_value, max_value)

    def parse(text: str) -> int:
        try:
            return _int(text, min_value, max_value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    parse.__name__ = "int"
    return parse


def bounded_float(*, above: float | None = None, min_value: float | None = None) -> Callable[[str], float]:
    """A finite float ``> above`` or ``>= min_value`` (give at most one)."""
    if above is not None and min_value is not None:
        raise ValueError("bounded_float: give above or min_value, not both")
    lo, strict = (above, True) if above is not None else (min_value, False)
    what = "a finite number" + _bounds(lo, None, above=strict)

    def parse(text: str) -> float:
        try:
            return _float(text, lo, strict)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    parse.__name__ = "float"
    return parse


def _split(text: str, allow_empty: bool, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if items == [""] and allow_empty:
        return []
    if "" in items:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return items


def int_list(
    *, min_value: int | None = None, max_value: int | None = None, allow_empty: bool = False
) -> Callable[[str], list[int]]:
    """Comma-separated integers in ``[min_value, max_value]``, e.g. ``"1,4,8"`` -> ``[1, 4, 8]``;
    ``""`` -> ``[]`` when ``allow_empty``."""
    what = "comma-separated integers" + _bounds(min_value, max_value) + (" (or '' for none)" if allow_empty else "")

    def parse(text: str) -> list[int]:
        try:
            return [_int(x, min_value, max_value) for x in _split(text, allow_empty, what)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    parse.__name__ = "int list"
    return parse


def float_list(*, above: float | None = None) -> Callable[[str], list[float]]:
    """Comma-separated finite floats ``> above``, e.g. ``"1,0.5"`` -> ``[1.0, 0.5]``."""
    what = "comma-separated finite numbers" + _bounds(above, None, above=True)

    def parse(text: str) -> list[float]:
        try:
            return [_float(x, above, True) for x in _split(text, False, what)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    parse.__name__ = "float list"
    return parse


def name_list(choices: Iterable[str], *, allow_empty: bool = False) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``choices``, e.g. ``"data,none"`` -> ``["data", "none"]``;
    ``""`` -> ``[]`` when ``allow_empty``."""
    allowed = tuple(choices)
    what = "comma-separated names from " + ", ".join(allowed) + (" (or '' for none)" if allow_empty else "")

    def parse(text: str) -> list[str]:
        items = _split(text, allow_empty, what)
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r} ({bad[0]!r} is not one)")
        return items

    parse.__name__ = "name list"
    return parse


def redis_url(text: str) -> str:
    """One Redis/Valkey instance's URL (``redis://``, ``rediss://``, ``unix://``; the grammar of
    :mod:`lmtier.remote_url`), returned as given; a malformed URL or a cluster URL is a usage error."""
    from lmtier.remote_url import RemoteURLError, parse_redis_url, redact_url

    try:
        endpoint = parse_redis_url(text, env={})
    except RemoteURLError as e:
        raise argparse.ArgumentTypeError(f"{redact_url(text)!r}: {e.why}") from None
    if endpoint.kind == "cluster":
        raise argparse.ArgumentTypeError(f"{redact_url(text)!r}: one instance (redis://, rediss://, unix://)")
    return text


def ping_redis(prog: str, url: str, timeout_s: float = 5.0) -> None:
    """Raise ``SystemExit`` with a one-line message (``prog: cannot reach URL: why``) unless the
    Redis at ``url`` answers a PING within ``timeout_s`` (the benchmarks' clients would otherwise
    end in a redis-py traceback, or a tier that turns every call into a miss)."""
    import redis

    from lmtier.remote_url import redact_url

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as e:
        raise SystemExit(f"{prog}: cannot reach {redact_url(url)}: {type(e).__name__}: {e}") from None


def output_file(text: str) -> str:
    """A file the benchmark writes at its end (``--json``, ``--plot``), returned ``~``-expanded: its
    directory must exist and be writable now, so a typo is a usage error before the run, not a
    traceback that loses the run's results."""
    import os

    path = os.path.abspath(os.path.expanduser(text))
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: directory {parent!r} is not writable")
    return os.path.expanduser(text)


def output_directory(text: str) -> str:
    """A folder the benchmark writes into (``--model-cache``, ``--plot-dir``), returned ``~``-expanded: created
    now if missing (with its parents), and writable, so a typo or a read-only place is a usage error
    before the run, not a traceback after minutes of work."""
    import os

    path = os.path.expanduser(text)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot create the directory: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: directory is not writable")
    return path


def model_directory(text: str) -> str:
    """A local ``transformers`` model directory (``--model``), returned as given: it must exist and
    hold a ``config.json`` now, so a typo is a usage error naming the path instead of a run that
    quietly measures something else (``lmtier bench codec --model /nope`` used to fall back to
    synthetic KV)."""
    import os

    path = os.path.expanduser(text)
    if not os.path.exists(path):
        raise argparse.ArgumentTypeError(f"{text!r}: no such directory")
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json (not a transformers model directory)")
    return text
