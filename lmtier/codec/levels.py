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

import dataclasses
import enum
import functools
from dataclasses import dataclass

__all__ = [
    "Granularity",
    "Transform",
    "LayerGroup",
    "PlaneQuant",
    "Level",
    "ErrorBound",
    "BoundMetric",
    "resolve",
    "LEVELS",
    "EXPERIMENTAL_LEVELS",
    "LEVELS_BY_ID",
    "get_level",
    "CACHEGEN_REF",
    "QMAX_MENU",
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


class BoundMetric(enum.IntEnum):
    """What an :class:`ErrorBound` bounds, per (chunk, layer, plane); ``e = x_hat - x``.

    ``RELATIVE``  ``||e|| / ||x||`` over the plane's ``[T, H, D]`` values.
    ``CENTERED``  ``||e|| / ||x - mean_T(x)||``, the mean taken over the chunk's tokens per (head,
                  channel): an attention-logit error proxy for keys — a component shared by all
                  keys shifts every logit of a query equally (softmax ignores it), so the error is
                  measured against what distinguishes the keys.
    Both are the same in the rotated domain (the Hadamard transform is orthogonal up to a factor).
    """

    RELATIVE = 0
    CENTERED = 1


@dataclass(frozen=True)
class ErrorBound:
    """Layers ``[previous end, end)`` of an error-bounded plane: the chunk's error metric must be
    ``<= max_rel_err``; ``end`` resolves like :meth:`LayerGroup.end` (``first_layers`` = 0)."""

    max_rel_err: float
    frac_num: int = 1
    frac_den: int = 1

    def end(self, num_layers: int) -> int:
        return min(num_layers, -(-num_layers * self.frac_num // self.frac_den))


@dataclass(frozen=True)
class PlaneQuant:
    """Quantization of one plane (K or V).

    A fixed plane has ``groups`` (qmax per layer group). An *error-bounded* plane (of an adaptive
    level, :attr:`Level.adaptive`) has ``bounds`` and no ``groups`` until :func:`resolve` fixes the
    qmax per layer that the encoder chose for one chunk (what the record then stores)."""

    granularity: Granularity
    groups: tuple[LayerGroup, ...]
    transform: Transform = Transform.NONE
    bounds: tuple[ErrorBound, ...] = ()
    metric: BoundMetric = BoundMetric.RELATIVE

    def bound_table(self, num_layers: int) -> tuple[float, ...]:
        """Error bound of every layer (error-bounded planes; ValueError otherwise)."""
        if not self.bounds:
            raise ValueError("not an error-bounded plane")
        out: list[float] = []
        start = 0
        for b in self.bounds:
            if not 0.0 < b.max_rel_err < 1.0:
                raise ValueError(f"max_rel_err must be in (0, 1), got {b.max_rel_err}")
            end = b.end(num_layers)
            out.extend([b.max_rel_err] * max(0, end - start))
            start = max(start, end)
        if len(out) != num_layers:
            raise ValueError(f"error bounds cover {len(out)} of {num_layers} layers")
        return tuple(out)

    def qmax_table(self, num_layers: int) -> tuple[int, ...]:
        """qmax of every layer (the table the record stores and the kernels take).

        Raises ValueError for an error-bounded plane not yet :func:`resolve` d for a chunk."""
        if not self.groups:
            raise ValueError("error-bounded level: its qmax is chosen per chunk (levels.resolve / lmtier.codec.bound)")
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
    qmax_menu: tuple[int, ...] = ()
    """Adaptive (error-bounded) levels: the qmax values the encoder may choose, ascending."""

    def __post_init__(self):
        if self.lossless != (self.k is None and self.v is None):
            raise ValueError("a level is either lossless or has K and V quantizers")
        if self.qmax_menu and (
            list(self.qmax_menu) != sorted(set(self.qmax_menu))
            or not 1 <= self.qmax_menu[0] <= self.qmax_menu[-1] <= 127
        ):
            raise ValueError("qmax_menu must be ascending distinct values in [1, 127]")

    @property
    def adaptive(self) -> bool:
        """True for error-bounded levels: qmax per (chunk, layer, plane) chosen by the encoder from
        a measured error, stored in the record (:mod:`lmtier.codec.bound`)."""
        return bool(self.qmax_menu)

    @property
    def resolved(self) -> bool:
        """True when every plane has a qmax table (fixed levels, or an adaptive level resolved for a chunk)."""
        return self.lossless or bool(self.k.groups and self.v.groups)


@functools.lru_cache(maxsize=256)
def resolve(level: Level, qmax_k: tuple[int, ...], qmax_v: tuple[int, ...]) -> Level:
    """The adaptive ``level`` with the per-layer qmax of one chunk fixed (same name and id; what the
    quantizer, the kernels and the decoder take). Values must be in the level's ``qmax_menu``."""
    if not level.adaptive:
        raise ValueError(f"level {level.name!r} is not adaptive")
    if len(qmax_k) != len(qmax_v) or not qmax_k:
        raise ValueError("qmax tables of K and V must have one entry per layer")
    menu = set(level.qmax_menu)
    if not set(qmax_k) <= menu or not set(qmax_v) <= menu:
        raise ValueError(f"qmax outside the level's menu {level.qmax_menu}")
    nl = len(qmax_k)

    def groups(t):
        return tuple(LayerGroup(q, first_layers=i + 1) for i, q in enumerate(t))

    return (
        dataclasses.replace(
            level,
            k=dataclasses.replace(level.k, groups=groups(qmax_k)),
            v=dataclasses.replace(level.v, groups=groups(qmax_v)),
        )
        if nl
        else level
    )


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


def _eb_sixths(*bounds: float) -> tuple[ErrorBound, ...]:
    """One error bound per sixth of the depth (layers as in :func:`_sixths`)."""
    assert len(bounds) == 6
    return tuple(ErrorBound(b, frac_num=k + 1, frac_den=6) for k, b in enumerate(bounds))


QMAX_MENU = (1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 15, 19, 23, 31, 47, 63, 127)
"""qmax values the error-bounded levels choose from (one byte per layer and plane in the record)."""


def _eb(name: str, level_id: int, k: tuple[float, ...], v: tuple[float, ...]) -> Level:
    return Level(
        name,
        level_id,
        k=PlaneQuant(Granularity.TOKEN_HEAD, (), _H, _eb_sixths(*k), BoundMetric.RELATIVE),
        v=PlaneQuant(Granularity.TOKEN_HEAD, (), _H, _eb_sixths(*v), BoundMetric.RELATIVE),
        qmax_menu=QMAX_MENU,
    )


# Error-bounded levels (issue 19): per chunk, layer and plane, the smallest qmax of QMAX_MENU whose
# measured relative error of the rotated K/V meets the bound below (one bound per sixth of the
# depth; lmtier.codec.bound). The bounds were chosen on the tune split of the quality matrix
# (benchmarks/codec_corpus.py) and checked on its held-out split: docs/codec.md.
EB_HIGH = _eb("eb_high", 4, (0.07, 0.06, 0.06, 0.03, 0.035, 0.07), (0.11, 0.11, 0.11, 0.07, 0.11, 0.11))
EB_DEFAULT = _eb("eb_default", 5, (0.15, 0.12, 0.12, 0.04, 0.05, 0.15), (0.2, 0.2, 0.2, 0.12, 0.2, 0.25))
EB_LOW = _eb("eb_low", 6, (0.2, 0.16, 0.16, 0.055, 0.075, 0.2), (0.27, 0.27, 0.27, 0.16, 0.4, 0.4))

LEVELS: dict[str, Level] = {lv.name: lv for lv in (LOSSLESS, HIGH, DEFAULT, LOW)}
"""The user levels (``codec_level`` in the YAML)."""
EXPERIMENTAL_LEVELS: dict[str, Level] = {lv.name: lv for lv in (EB_HIGH, EB_DEFAULT, EB_LOW)}
"""Levels of the library API and the benchmarks only, not (yet) the YAML: the error-bounded levels
miss issue 19's quality targets on some texts, their encode-time choice is slow, and they have not
run on a GPU (docs/codec.md)."""
LEVELS_BY_ID: dict[int, Level] = {
    lv.level_id: lv for lv in (*LEVELS.values(), *EXPERIMENTAL_LEVELS.values(), CACHEGEN_REF)
}


def get_level(level: str | int | Level) -> Level:
    """Level by name, id or itself; unknown values raise ValueError."""
    if isinstance(level, Level):
        return level
    table = (
        LEVELS_BY_ID if isinstance(level, int) else {**LEVELS, **EXPERIMENTAL_LEVELS, CACHEGEN_REF.name: CACHEGEN_REF}
    )
    try:
        return table[level]
    except KeyError:
        raise ValueError(
            f"unknown codec level {level!r}; known: {sorted(LEVELS) + sorted(EXPERIMENTAL_LEVELS)}"
        ) from None
