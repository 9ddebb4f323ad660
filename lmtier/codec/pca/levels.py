"""The PCA levels: a record level id and a relative quantizer step ``c`` each.

A PCA level is defined by the error it allows, not by a ratio: at calibration the step of every
(layer group, K/V) is set to ``c`` times that group's RMS coefficient spread on the calibration KV (in
the model metric's space when one was given; :func:`lmtier.codec.pca.fit.fit`). From then on the step
is a constant of the model: each coefficient of a token not stored exact errs by at most ``step / 2``
(plus the roundings of the 16-bit fixed point and of the int16 matrices) whatever the text, and the
ratio follows from the data and from how well the basis fits it. ``c`` is the same for every model
and calibration corpus: 0.25 (``pca_default``) and 0.09 (``pca_high``), about the steps at which the
broader calibration corpus coded its calibration KV at 7.2x / 4.6x on SmolLM2 and its 28-layer
variant (c = 0.245-0.256 and 0.090-0.094, RESULTS §4.1k). A level built with ``calibration_ratio``
instead (an experiment's knob, ``benchmarks/codec_pca_product.py --calibration-ratio``) has its ``c``
searched so that the calibration KV codes at that ratio (how the levels were defined before).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PCALevel", "PCA_LEVELS", "PCA_LEVELS_BY_ID", "get_pca_level"]


@dataclass(frozen=True)
class PCALevel:
    """``name``, record ``level_id`` (distinct from :data:`lmtier.codec.levels.LEVELS_BY_ID`'s) and
    how calibration sets the step: ``c`` (> 0), the step relative to each (layer group, K/V)'s RMS
    coefficient spread, or — when ``c`` is None — ``calibration_ratio`` (> 1), the ratio of bf16 bytes
    to the ideal coded bytes of the calibration KV that the fitted ``c`` reaches.

    Raises:
        ValueError: neither or both of ``c`` and ``calibration_ratio``, or one out of range.
    """

    name: str
    level_id: int
    c: float | None = None
    calibration_ratio: float | None = None

    def __post_init__(self) -> None:
        if (self.c is None) == (self.calibration_ratio is None):
            raise ValueError(f"PCA level {self.name!r}: give exactly one of c and calibration_ratio")
        if self.c is not None and not self.c > 0:
            raise ValueError(f"PCA level {self.name!r}: c must be > 0, got {self.c!r}")
        if self.calibration_ratio is not None and not self.calibration_ratio > 1:
            raise ValueError(f"PCA level {self.name!r}: calibration_ratio must be > 1, got {self.calibration_ratio!r}")


PCA_LEVELS: dict[str, PCALevel] = {
    lv.name: lv for lv in (PCALevel("pca_high", 8, c=0.09), PCALevel("pca_default", 9, c=0.25))
}
PCA_LEVELS_BY_ID: dict[int, PCALevel] = {lv.level_id: lv for lv in PCA_LEVELS.values()}


def get_pca_level(level: str | int | PCALevel) -> PCALevel:
    """The :class:`PCALevel` of a name or record level id. Raises ValueError naming the known ones."""
    if isinstance(level, PCALevel):
        return level
    table = PCA_LEVELS_BY_ID if isinstance(level, int) else PCA_LEVELS
    if level not in table:
        raise ValueError(f"unknown PCA codec level {level!r}; known: {sorted(PCA_LEVELS)}")
    return table[level]
