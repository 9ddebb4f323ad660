"""The operations the connector's scheduler side hands its worker side, and the worker's load state.

:class:`LoadOp` / :class:`StoreOp` travel in the connector's metadata from the scheduler to
:class:`lmtier.integration.vllm.worker.ConnectorWorker`; the private classes hold the state of one
asynchronous or layer-by-layer load. This module imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from lmtier.keys import KeyScope

__all__ = ["AsyncLoad", "LayerwiseLoad", "LoadOp", "StoreOp", "lazy_once", "no_faults"]


@dataclass
class LoadOp:
    """Load chunks ``[start_token // chunk, len(token_ids) // chunk)`` of a request into its blocks.

    ``token_ids`` is the prompt prefix covering the hit (whole chunks); tokens before
    ``start_token`` are held by vLLM (its prefix cache) and are not written. ``block_ids[i]`` holds
    tokens ``[i * block_size, (i + 1) * block_size)``. ``is_async``: run in the background and
    report through ``finished_recving`` (else before the forward, failures as invalid blocks).
    ``skip_tiers``: lower tiers the chunks must not be read from (the load policy found them slower
    than recompute; a later tier holds a copy).
    """

    req_id: str
    token_ids: list[int]
    cache_salt: KeyScope | None
    start_token: int
    block_ids: list[int]
    is_async: bool = False
    poisoned: bool = False  # load nothing, report every block as failed (vLLM recomputes them)
    skip_tiers: tuple[str, ...] = ()


@dataclass
class StoreOp:
    """Store chunks ``[first_chunk, len(token_ids) // chunk)`` of a request from its blocks."""

    req_id: str
    token_ids: list[int]
    cache_salt: KeyScope | None
    first_chunk: int
    block_ids: list[int]


class AsyncLoad:
    """State of one background load: the fetch future, its op, and the start time."""

    __slots__ = ("cancelled", "future", "op", "t0")

    def __init__(self, op: LoadOp, future: Future, t0: float):
        self.op, self.future, self.t0, self.cancelled = op, future, t0, False


class LayerwiseLoad:
    """One step's layer-by-layer load: per-layer events (CUDA; None on CPU), the chunks it holds
    until the copy completed, and which layers the forward waited for."""

    def __init__(
        self,
        parts: list,
        events: list | None,
        num_layers: int,
        t0: float,
        timing: tuple[Any, Any] | None,
        *,
        device_event: Any = None,
        loaded: list | None = None,
    ) -> None:
        self.parts = parts  # [(op, ready host chunks, key0, pinned copies kept alive until the copy ends)]
        self.events = events
        self.device_event = device_event  # CUDA event after the device-staged chunks' scatters (or None)
        self.loaded = loaded or []  # [(op, first chunk index it loads)]
        self.waited = [False] * num_layers
        self.t0 = t0
        self.timing = timing  # (start, end) CUDA timing events around the copies


def no_faults() -> set[str]:
    return set()


def lazy_once(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` evaluated at the first call, then cached."""
    box: list = []

    def get() -> Any:
        if not box:
            box.append(fn())
        return box[0]

    return get
