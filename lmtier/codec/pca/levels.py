"""The PCA levels: a record level id and a relative quantizer step each.

A PCA level is defined by the error it allows, not by a target ratio: the step of every (layer group,
K/V) is ``c`` times that group's RMS coefficient spread on the calibration KV (in the model metric's
space when one was given), the same ``c`` for every model and text, so each coefficient's error is at
most ``c * rms / 2`` whatever the text; the ratio follows from the data. The two ``c`` were fitted in
the experiment (``benchmarks/codec_pca.py``, RESULTS §4.1h), where tune-split ratios of 5x and 8x
needed c = 0.102-0.108 and 0.276-0.292 on two models and two folds of the texts.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PCALevel", "PCA_LEVELS", "PCA_LEVELS_BY_ID", "get_pca_level"]


@dataclass(frozen=True)
class PCALevel:
    """``name``, record ``level_id`` (distinct from :data:`lmtier.codec.levels.LEVELS_BY_ID`'s) and
    relative step ``c`` (> 0)."""

    name: str
    level_id: int
    c: float


PCA_LEVELS: dict[str, PCALevel] = {
    lv.name: lv for lv in (PCALevel("pca_high", 8, 0.105), PCALevel("pca_default", 9, 0.28))
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
