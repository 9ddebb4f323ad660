"""The PCA levels: a record level id and a calibration ratio each.

A PCA level fixes its quantizer steps once per model, at calibration: the step of every (layer group,
K/V) is ``c`` times that group's RMS coefficient spread on the calibration KV (in the model metric's
space when one was given), with ``c`` found so that the calibration texts code at the level's
``calibration_ratio`` (:func:`lmtier.codec.pca.fit.fit`). From then on the step is a constant of the
model: each coefficient of a token not stored exact errs by at most ``step / 2`` (plus the roundings
of the 16-bit fixed point and of the int16 matrices) whatever the text, and the ratio follows from
the data. The two ratios are those of the experiment (``benchmarks/codec_pca.py``, RESULTS §4.1h: 8x
and 5x on the tune split, c = 0.276-0.292 and 0.102-0.108 on two models and two folds of the texts).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PCALevel", "PCA_LEVELS", "PCA_LEVELS_BY_ID", "get_pca_level"]


@dataclass(frozen=True)
class PCALevel:
    """``name``, record ``level_id`` (distinct from :data:`lmtier.codec.levels.LEVELS_BY_ID`'s) and
    ``calibration_ratio`` (> 1): bf16 bytes over the ideal coded bytes of the calibration KV that
    calibration aims at."""

    name: str
    level_id: int
    calibration_ratio: float


PCA_LEVELS: dict[str, PCALevel] = {
    lv.name: lv for lv in (PCALevel("pca_high", 8, 5.0), PCALevel("pca_default", 9, 8.0))
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
