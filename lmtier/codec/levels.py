"""Codec levels: what each quality level quantizes, and how coarsely.

A level fixes, for keys and values separately, the *scale granularity* (which elements share one
scale), an optional fixed orthogonal *transform* over the head dimension, and the quantizer's
``qmax`` per layer (integers ``q`` in ``[-qmax, qmax]``, i.e. ``2 * qmax + 1`` levels; CacheGen's
"bins" ``b`` correspond to ``qmax = b // 2 - 1``). ``lossless`` instead splits every bf16/fp16
element into two byte planes (see :mod:`lmtier.codec.quant`).

Per-layer ``qmax`` comes from :class:`LayerGroup` s resolved against the model's layer count by an
integer rule (:meth:`PlaneQuant.qmax_table`); the resolved table (one byte per layer and plane) is
what the binary record stores and what the C++/CUDA kernels take, so they never re-derive it.

The numbers behind the choices (SmolLM2-135M, dequantized-4-bit weights) are in docs/codec.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Granularity",
    "Transform",
    "LayerGroup",
    "PlaneQuant",
    "Level",
    "LEVELS",
    "LEVELS_BY_ID",
    "get_level",
    "CACHEGEN_REF",
]


class Granularity(enum.IntEnum):
    """Which elements of one plane (K or V) of one layer share a scale; T = chunk tokens.

    ``TOKEN``      one scale per token over all heads × channels (CacheGen / LMCache).
    ``TOKEN_HEAD`` one scale per (token, head) over ``head_size`` channels.
    ``CHANNEL``    one scale per (head, channel) over the chunk's T tokens (keys' outlier channels).
    ``HEAD``       one scale per head over T × head_size (a uniform step inside the head).
    """

    TOKEN = 0
    TOKEN_HEAD = 1
    CHANNEL = 2
    HEAD = 3


class Transform(enum.IntEnum):
    """Fixed transform over head_size applied before quantization (inverse after)."""

    NONE = 0
    HADAMARD = 1  # unnormalized Walsh–Hadamard, fixed butterfly order; see quant.fwht


@dataclass(frozen=True)
class LayerGroup:
    """Layers ``[previous end, end)`` are quantized with ``qmax``.

    ``end`` is resolved against ``num_layers`` as
    ``min(num_layers, first_layers + ceil(num_layers * frac_num / frac_den))``; the last group of a
    plane must reach ``num_layers`` (``frac_num == frac_den``).
    """

    qmax: int
    first_layers: int = 0
    frac_num: int = 0
    frac_den: int = 1

    def end(self, num_layers: int) -> int:
        return min(num_layers, self.first_layers + -(-num_layers * self.frac_num // self.frac_den))


@dataclass(frozen=True)
class PlaneQuant:
    """Quantization of one plane (K or V)."""

    granularity: Granularity
    groups: tuple[LayerGroup, ...]
    transform: Transform = Transform.NONE

    def qmax_table(self, num_layers: int) -> tuple[int, ...]:
        """qmax of every layer (the table the record stores and the kernels take)."""
        out: list[int] = []
        start = 0
        for g in self.groups:
            if not 1 <= g.qmax <= 127:
                raise ValueError(f"qmax must be in [1, 127], got {g.qmax}")
            end = g.end(num_layers)
            out.extend([g.qmax] * max(0, end - start))
            start = max(start, end)
        if len(out) != num_layers:
            raise ValueError(f"layer groups cover {len(out)} of {num_layers} layers")
        return tuple(out)


@dataclass(frozen=True)
class Level:
    """One codec level. ``k``/``v`` are None exactly when ``lossless``."""

    name: str
    level_id: int
    lossless: bool = False
    k: PlaneQuant | None = None
    v: PlaneQuant | None = None

    def __post_init__(self):
        if self.lossless != (self.k is None and self.v is None):
            raise ValueError("a level is either lossless or has K and V quantizers")


def _all(qmax: int) -> tuple[LayerGroup, ...]:
    return (LayerGroup(qmax, frac_num=1, frac_den=1),)


def _first(n: int, qmax_first: int, qmax_rest: int) -> tuple[LayerGroup, ...]:
    return (LayerGroup(qmax_first, first_layers=n), LayerGroup(qmax_rest, frac_num=1, frac_den=1))


def _sixths(*qmax: int) -> tuple[LayerGroup, ...]:
    """One qmax per sixth of the depth: layers ``[ceil(L*(k-1)/6), ceil(L*k/6))`` get ``qmax[k-1]``."""
    assert len(qmax) == 6
    return tuple(LayerGroup(q, frac_num=k + 1, frac_den=6) for k, q in enumerate(qmax))


def _third(qmax_first: int, qmax_rest: int) -> tuple[LayerGroup, ...]:
    return (LayerGroup(qmax_first, frac_num=1, frac_den=3), LayerGroup(qmax_rest, frac_num=1, frac_den=1))


LOSSLESS = Level("lossless", 0, lossless=True)

# Keys and values: per-(token, head) scale codes after a fixed 64/128-point Walsh–Hadamard rotation
# of each head row (spreads the keys' outlier channels over the row, so one scale per row no longer
# wastes the range). Keys are far more sensitive than values (measured: K alone at qmax 3 costs
# +4.4 % perplexity, V alone at qmax 3 +0.6 %), so K gets the finer step. `default` and `low`
# allocate bits by depth: quantizing one sixth of the layers at a time (SmolLM2, pydoc text) showed
# the error comes from the 4th and 5th sixths (layers 15-24 of 30: K +1.8 / +0.8 %, V +0.8 / +0.1 %
# perplexity at the old K 6 / V 3), the other sixths cost ~0; so those layers get more levels and
# the rest fewer (V below qmax 3 in the first sixths measured costly again). Measurements that fixed
# these numbers: docs/codec.md. Changing a level's numbers changes its records: it needs a record
# format version bump (lmtier.codec.format.FORMAT_VERSION), as the records store the level id only.
_H = Transform.HADAMARD
HIGH = Level(
    "high",
    1,
    k=PlaneQuant(Granularity.TOKEN_HEAD, _all(15), _H),
    v=PlaneQuant(Granularity.TOKEN_HEAD, _all(7), _H),
)
DEFAULT = Level(
    "default",
    2,
    k=PlaneQuant(Granularity.TOKEN_HEAD, _sixths(4, 5, 5, 15, 11, 4), _H),
    v=PlaneQuant(Granularity.TOKEN_HEAD, _sixths(3, 3, 3, 5, 2, 2), _H),
)
LOW = Level(
    "low",
    3,
    k=PlaneQuant(Granularity.TOKEN_HEAD, _sixths(3, 3, 4, 11, 8, 3), _H),
    v=PlaneQuant(Granularity.TOKEN_HEAD, _sixths(2, 2, 2, 4, 2, 2), _H),
)

# CacheGen's scheme as LMCache implements it (K 32 bins for the first third of layers then 16,
# V 32 bins for the first 2 layers then 16, one scale per layer and token), expressed in lmtier's
# arithmetic and scale format: a reference point for benchmarks, not a user level.
CACHEGEN_REF = Level(
    "cachegen_ref",
    127,
    k=PlaneQuant(Granularity.TOKEN, _third(15, 7)),
    v=PlaneQuant(Granularity.TOKEN, _first(2, 15, 7)),
)

LEVELS: dict[str, Level] = {lv.name: lv for lv in (LOSSLESS, HIGH, DEFAULT, LOW)}
LEVELS_BY_ID: dict[int, Level] = {lv.level_id: lv for lv in (*LEVELS.values(), CACHEGEN_REF)}


def get_level(level: str | int | Level) -> Level:
    """Level by name, id or itself; unknown values raise ValueError."""
    if isinstance(level, Level):
        return level
    table = LEVELS_BY_ID if isinstance(level, int) else {**LEVELS, CACHEGEN_REF.name: CACHEGEN_REF}
    try:
        return table[level]
    except KeyError:
        raise ValueError(f"unknown codec level {level!r}; known: {sorted(LEVELS)}") from None
