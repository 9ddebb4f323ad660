"""KV codec: quantization (this package's :mod:`.quant`, :mod:`.levels`) + entropy coding
(:mod:`.rans`, interleaved rANS over the byte streams the quantizer emits).

Levels: ``lossless`` (exact byte-plane split), ``high``, ``default``, ``low``; see docs/codec.md for
the scheme, the error bounds and the measured ratio/quality. :mod:`.chunk` turns one KV chunk into
one record and back; :mod:`.decoder` keeps the reusable decode state (device tables, buffers,
streams) behind it. :mod:`.rans` is imported lazily (it is built separately and may wrap a compiled
extension).
"""

from .levels import LEVELS, Granularity, Level, PlaneQuant, Transform, get_level
from .quant import CodecInputError, dequantize, error_bound, quantize, side_sizes, symbol_shape

__all__ = [
    "LEVELS",
    "Granularity",
    "Level",
    "PlaneQuant",
    "Transform",
    "get_level",
    "CodecInputError",
    "quantize",
    "dequantize",
    "error_bound",
    "side_sizes",
    "symbol_shape",
]
