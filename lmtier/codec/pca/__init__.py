"""PCA transform coding of KV chunks (issue 19; experimental; in the YAML: ``codec_level: pca_*`` with
``codec_pca_model``, :class:`lmtier.tiers.codec_pca.PCACodecTier`).

Data flow: :mod:`.hf` (calibration inputs from a checkpoint) -> :mod:`.fit` (a :class:`PCAModel`:
basis, integer transforms, steps, outlier thresholds, rANS tables) -> :mod:`.model` (its versioned,
checksummed file; :mod:`.ranks`: one model per rank's KV heads under tensor parallelism) ->
:mod:`.codec` (chunk <-> record, through :mod:`.transform`'s arithmetic and :mod:`.rope`; on CUDA the
same bits from :mod:`.imatmul`'s int8 GEMMs, :mod:`.kernels` and :mod:`.streams`). Levels:
:mod:`.levels`. Command: ``python -m lmtier.codec.pca`` (:mod:`.calibrate`).
"""

from .codec import RecordMeta, decode, encode, record_meta
from .fit import fit
from .levels import PCA_LEVELS, PCALevel, get_pca_level
from .model import PCAModel, PCAModelError, load, save
from .ranks import RankModels, load_file, rank_heads, save_ranks

__all__ = [
    "PCA_LEVELS",
    "PCALevel",
    "PCAModel",
    "PCAModelError",
    "RankModels",
    "RecordMeta",
    "decode",
    "encode",
    "fit",
    "get_pca_level",
    "load",
    "load_file",
    "rank_heads",
    "record_meta",
    "save",
    "save_ranks",
]
