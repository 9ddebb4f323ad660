"""Running a test's worker in several threads at once, with every thread's exception reported."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def run_in_threads(worker: Callable[..., Any], args: Iterable[tuple]) -> None:
    """Run ``worker(*a)`` in one thread per ``a`` of ``args``, all started before any is joined.

    Raises:
        AssertionError: a worker raised (all threads are joined first; the message lists up to two
            of the exceptions, the first is chained)."""
    errors: list[BaseException] = []

    def run(*a: Any) -> None:
        try:
            worker(*a)
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise AssertionError(f"{len(errors)} of {len(threads)} threads failed: {errors[:2]!r}") from errors[0]
