"""The per-model data of the PCA levels (basis, means, integer transforms, steps, outlier thresholds,
entropy tables) and its file: versioned, checksummed, identified by a 32-bit id that records carry.

File layout (little endian)::

    b"LMTPCA\\0\\0"  8 bytes magic
    version         uint32 (MODEL_FILE_VERSION)
    header_bytes    uint32: n, the JSON header's length
    header          n bytes of UTF-8 JSON: the scalars, and per array its dtype, shape and offset
    arrays          each at a 64-byte aligned offset from the file start, zero padding between
    sha256          32 bytes: SHA-256 of every byte before it

The model id is the first 4 bytes (little endian) of that SHA-256 (0xFFFFFFFF, the records'
"no table", maps to 0xFFFFFFFE): the same data always gets the same id, and a record names the data
it needs (the ``table_id`` of its header).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from lmtier.errors import LMTierError

__all__ = [
    "MODEL_FILE_VERSION",
    "DIGEST_BYTES",
    "MAX_VECTOR_SIZE",
    "PCAModelError",
    "PCALevelData",
    "PCAModel",
    "load",
    "save",
    "from_bytes",
]

MODEL_FILE_VERSION = 1
_MAGIC = b"LMTPCA\0\0"
RANKS_MAGIC = b"LMTPCATP"
"""The magic of a tensor-parallel model file (:mod:`.ranks`: one model per slice of KV heads)."""
_HEAD = struct.Struct("<8sII")
_ALIGN = 64
_MAX_HEADER = 1 << 20
DIGEST_BYTES = 16
"""Bytes of the model file's SHA-256 that identify its data in a record (:attr:`PCAModel.digest`)."""
MAX_VECTOR_SIZE = 8192
"""Largest ``N = G * H * D``: the integer GEMMs and energies of :mod:`.transform` are exact in float64
only while their sums stay within 2**53 (``N * 32767**2`` and ``N * EMAX**2``)."""


class PCAModelError(LMTierError, ValueError):
    """A PCA model file or object that must not be used (truncated, corrupt, another version,
    inconsistent arrays); the message names the file and the reason."""


@dataclass(frozen=True)
class PCALevelData:
    """One level's part of a :class:`PCAModel` (``R`` layer groups, ``N`` values per vector).

    Attributes:
        c: the level's relative step (step = ``c`` * the layer group's RMS coefficient spread).
        step: float64 ``[R, 2]``, the quantizer step per (layer group, K/V) in the basis' space.
        k: float64 ``[R, 2, N]``: coefficient ``q = round_half_even(acc * k)`` of an integer
            transform output ``acc``.
        f: float64 ``[R, 2, N]``: decoded raw value ``acc2 * f + mu_raw`` of an integer inverse
            transform output ``acc2``.
        energy_threshold: int64 ``[R, 2]``: a token whose energy over a (layer group, K/V) exceeds
            it is stored exact; the energy is ``sum fine**2`` of the coefficients on a grid
            ``ENERGY_SCALE`` times finer than the step, ``fine = clamp(round_half_even(acc * k *
            ENERGY_SCALE), -EMAX, EMAX)`` (:class:`lmtier.codec.pca.transform.Forward`).
        tables: uint16 ``[R * 2 * N, 256]`` rANS tables (12-bit), one per (layer group, K/V,
            component), each coding all 256 symbols.
    """

    c: float
    step: np.ndarray
    k: np.ndarray
    f: np.ndarray
    energy_threshold: np.ndarray
    tables: np.ndarray


@dataclass(frozen=True, eq=False)
class PCAModel:
    """The data a PCA level needs for one model's KV geometry ``[L, 2, T, H, D]``.

    Vectors: ``G`` = ``layer_group`` adjacent layers' heads of one token and plane, ``N = G * H * D``
    values, ``R = L / G`` layer groups. Encode (:mod:`lmtier.codec.pca.codec`): keys RoPE-undone
    (``inv_freq``), ``x_int = clamp(round_half_even(x * inv_x_scale))`` (16-bit fixed point),
    ``acc = x_int @ e_int - e_mu`` (exact integers), ``q = round_half_even(acc * k)``. Decode:
    ``acc2 = q @ d_int`` (exact), ``x = acc2 * f + mu_raw``, RoPE redone, float64 -> float32 -> bf16.

    Attributes:
        name: free text (the checkpoint it was calibrated for).
        num_layers, num_heads, head_size, layer_group: ``L``, ``H`` (KV heads), ``D``, ``G``.
        inv_freq: float64 ``[D/2]``: the model's rotary inverse frequencies; None: keys are coded
            with RoPE kept.
        exact_first: positions below it are always stored exact (the attention sink).
        inv_x_scale: float64 ``[R, 2]``: 1 / the fixed-point step of the raw vectors.
        mu_int: int32 ``[R, 2, N]``: the calibration mean in fixed point.
        e_int: int16 ``[R, 2, N, N]``: encode matrix (metric then basis), rows = input values.
        e_mu: int64 ``[R, 2, N]``: ``mu_int @ e_int``.
        d_int: int16 ``[R, 2, N, N]``: decode matrix (basis transposed then inverse metric), rows =
            components.
        mu_raw: float64 ``[R, 2, N]``: the calibration mean (raw space).
        levels: level name -> :class:`PCALevelData`.
        info: calibration facts (JSON-able): texts, tokens, outlier share, ...
    """

    name: str
    num_layers: int
    num_heads: int
    head_size: int
    layer_group: int
    inv_freq: np.ndarray | None
    exact_first: int
    inv_x_scale: np.ndarray
    mu_int: np.ndarray
    e_int: np.ndarray
    e_mu: np.ndarray
    d_int: np.ndarray
    mu_raw: np.ndarray
    levels: dict[str, PCALevelData]
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        nl, h, d, g = self.num_layers, self.num_heads, self.head_size, self.layer_group
        if min(nl, h, d, g) < 1 or nl % g:
            raise PCAModelError(f"geometry L={nl}, H={h}, D={d}, layer group {g}: G must divide L, all >= 1")
        if g * h * d > MAX_VECTOR_SIZE:
            raise PCAModelError(f"vector size N = G*H*D = {g * h * d} exceeds {MAX_VECTOR_SIZE} (exact float64 sums)")
        r, n = self.rows, self.vector_size
        want = {
            "inv_x_scale": ((r, 2), np.float64),
            "mu_int": ((r, 2, n), np.int32),
            "e_int": ((r, 2, n, n), np.int16),
            "e_mu": ((r, 2, n), np.int64),
            "d_int": ((r, 2, n, n), np.int16),
            "mu_raw": ((r, 2, n), np.float64),
        }
        for name, (shape, dt) in want.items():
            _check(f"PCAModel.{name}", getattr(self, name), shape, dt)
        if self.inv_freq is not None:
            _check("PCAModel.inv_freq", self.inv_freq, (d // 2,), np.float64)
            if d % 2:
                raise PCAModelError(f"RoPE needs an even head size, got {d}")
        if not self.levels:
            raise PCAModelError("a PCA model needs at least one level")
        for lv, x in self.levels.items():
            _check(f"level {lv} step", x.step, (r, 2), np.float64)
            _check(f"level {lv} k", x.k, (r, 2, n), np.float64)
            _check(f"level {lv} f", x.f, (r, 2, n), np.float64)
            _check(f"level {lv} energy_threshold", x.energy_threshold, (r, 2), np.int64)
            _check(f"level {lv} tables", x.tables, (r * 2 * n, 256), np.uint16)
            if (x.tables.sum(1, dtype=np.int64) != 4096).any() or (x.tables == 0).any():
                raise PCAModelError(f"level {lv}: every table must code all 256 symbols and sum to 4096")
        if self.exact_first < 0:
            raise PCAModelError(f"exact_first must be >= 0, got {self.exact_first}")
        self._check_values()

    def _check_values(self) -> None:
        """Refuse values the arithmetic cannot use (a file written by a faulty writer: its checksum
        verifies, its numbers do not): non-finite or non-positive scales, non-finite means or
        frequencies, negative thresholds, an ``e_mu`` that is not ``mu_int @ e_int``."""

        def bad(what: str, a: np.ndarray, ok: np.ndarray) -> None:
            if not bool(ok.all()):
                i = tuple(int(v) for v in np.argwhere(~ok)[0])
                raise PCAModelError(f"{what} at {i} is {a[i].item()!r}: {WHY[what]}")

        WHY = {
            "inv_x_scale": "must be finite and > 0",
            "mu_raw": "must be finite",
            "inv_freq": "must be finite and >= 0",
            "step": "must be finite and > 0",
            "k": "must be finite and >= 0",
            "f": "must be finite and >= 0",
            "energy_threshold": "must be >= 0",
        }
        bad("inv_x_scale", self.inv_x_scale, np.isfinite(self.inv_x_scale) & (self.inv_x_scale > 0))
        bad("mu_raw", self.mu_raw, np.isfinite(self.mu_raw))
        if self.inv_freq is not None:
            bad("inv_freq", self.inv_freq, np.isfinite(self.inv_freq) & (self.inv_freq >= 0))
        for x in self.levels.values():
            bad("step", x.step, np.isfinite(x.step) & (x.step > 0))
            bad("k", x.k, np.isfinite(x.k) & (x.k >= 0))
            bad("f", x.f, np.isfinite(x.f) & (x.f >= 0))
            bad("energy_threshold", x.energy_threshold, x.energy_threshold >= 0)
        for i in range(self.rows):  # one layer group at a time: all of e_int as int64 is 0.5 GB at 8B
            e_mu = np.einsum("pi,pij->pj", self.mu_int[i].astype(np.int64), self.e_int[i].astype(np.int64))
            if not np.array_equal(e_mu, self.e_mu[i]):
                raise PCAModelError("e_mu is not mu_int @ e_int")

    @property
    def rows(self) -> int:
        """``R``: layer groups."""
        return self.num_layers // self.layer_group

    @property
    def vector_size(self) -> int:
        """``N = G * H * D``."""
        return self.layer_group * self.num_heads * self.head_size

    @cached_property
    def digest(self) -> bytes:
        """The first :data:`DIGEST_BYTES` bytes of the file's SHA-256 (:func:`to_bytes`): records carry
        it, so a record never decodes with other data whose 32-bit :attr:`model_id` collides."""
        return hashlib.sha256(to_bytes(self)[:-32]).digest()[:DIGEST_BYTES]

    @property
    def model_id(self) -> int:
        """32-bit id of the data (see the module doc): the first 4 bytes of :attr:`digest`."""
        return _id(self.digest)


def _check(what: str, a, shape: tuple, dtype) -> None:
    if not isinstance(a, np.ndarray) or a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise PCAModelError(f"{what} must be {np.dtype(dtype)} {tuple(shape)}, got {got}")


def _id(digest: bytes) -> int:
    i = int.from_bytes(digest[:4], "little")
    return 0xFFFFFFFE if i == 0xFFFFFFFF else i


_LEVEL_ARRAYS = ("step", "k", "f", "energy_threshold", "tables")
_ARRAYS = ("inv_x_scale", "mu_int", "e_int", "e_mu", "d_int", "mu_raw")


def to_bytes(m: PCAModel) -> bytes:
    """The file bytes of ``m`` (deterministic: the same model gives the same bytes)."""
    arrays = {n: getattr(m, n) for n in _ARRAYS}
    if m.inv_freq is not None:
        arrays["inv_freq"] = m.inv_freq
    for lv, x in sorted(m.levels.items()):  # the order of a loaded model's levels
        arrays.update({f"{lv}.{n}": getattr(x, n) for n in _LEVEL_ARRAYS})
    scalars = dict(
        name=m.name,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        head_size=m.head_size,
        layer_group=m.layer_group,
        exact_first=m.exact_first,
        levels={lv: x.c for lv, x in m.levels.items()},
        info=m.info,
    )
    directory, off = {}, 0
    for n, a in arrays.items():
        directory[n] = dict(dtype=np.dtype(a.dtype).newbyteorder("<").str, shape=list(a.shape), offset=off)
        off = -(-(off + a.nbytes) // _ALIGN) * _ALIGN
    head = json.dumps(dict(scalars=scalars, arrays=directory), sort_keys=True).encode()
    start = -(-(_HEAD.size + len(head)) // _ALIGN) * _ALIGN
    out = bytearray(start + off)
    out[: _HEAD.size] = _HEAD.pack(_MAGIC, MODEL_FILE_VERSION, len(head))
    out[_HEAD.size : _HEAD.size + len(head)] = head
    for n, a in arrays.items():
        o = start + directory[n]["offset"]
        b = np.ascontiguousarray(a, directory[n]["dtype"]).tobytes()
        out[o : o + len(b)] = b
    return bytes(out) + hashlib.sha256(out).digest()


def from_bytes(data: bytes, where: str = "<bytes>") -> PCAModel:
    """Parse and verify a model file's bytes (``where`` names it in errors).

    Raises:
        PCAModelError: truncated, not a model file, another version, checksum mismatch, or arrays
            that do not fit the geometry.
    """

    def bad(why: str) -> PCAModelError:
        return PCAModelError(f"PCA model {where}: {why}; not used")

    if len(data) < _HEAD.size + 32:
        raise bad(f"truncated ({len(data)} bytes)")
    magic, version, hlen = _HEAD.unpack_from(data, 0)
    if magic == RANKS_MAGIC:
        raise bad("a tensor-parallel model file (a model per rank's KV heads): read it with lmtier.codec.pca.load_file")
    if magic != _MAGIC:
        raise bad(f"not a PCA model file (magic {bytes(magic)!r})")
    if version != MODEL_FILE_VERSION:
        raise bad(f"version {version}, this reader knows {MODEL_FILE_VERSION}")
    if hashlib.sha256(data[:-32]).digest() != data[-32:]:
        raise bad("checksum mismatch (corrupted or truncated)")
    if hlen > _MAX_HEADER or _HEAD.size + hlen > len(data) - 32:
        raise bad(f"header of {hlen} bytes does not fit")
    try:
        head = json.loads(data[_HEAD.size : _HEAD.size + hlen])
        start = -(-(_HEAD.size + hlen) // _ALIGN) * _ALIGN
        arrays = {}
        spans = []
        for n, e in head["arrays"].items():
            dt = np.dtype(e["dtype"])
            count = int(np.prod(e["shape"], dtype=np.int64))
            o = start + int(e["offset"])
            if o < start or o + count * dt.itemsize > len(data) - 32:
                raise PCAModelError(f"array {n} lies outside the file")  # wrapped by bad() below
            arrays[n] = np.frombuffer(data, dt, count, o).reshape(e["shape"]).astype(dt.newbyteorder("="))
            spans.append((o, o + count * dt.itemsize, n))
        spans.sort()
        for (_, end, a), (o, _, b) in zip(spans, spans[1:]):
            if o < end:
                raise PCAModelError(f"arrays {a} and {b} overlap")  # wrapped by bad() below
        s = head["scalars"]
        levels = {
            lv: PCALevelData(float(c), *(arrays[f"{lv}.{n}"] for n in _LEVEL_ARRAYS)) for lv, c in s["levels"].items()
        }
        return PCAModel(
            name=str(s["name"]),
            num_layers=int(s["num_layers"]),
            num_heads=int(s["num_heads"]),
            head_size=int(s["head_size"]),
            layer_group=int(s["layer_group"]),
            inv_freq=arrays.get("inv_freq"),
            exact_first=int(s["exact_first"]),
            levels=levels,
            info=s.get("info", {}),
            **{n: arrays[n] for n in _ARRAYS},
        )
    except PCAModelError as e:
        raise bad(str(e)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # AttributeError: a list for a mapping
        raise bad(f"malformed header ({type(e).__name__}: {e})") from None


def save(m: PCAModel, path: str | Path) -> int:
    """Write ``m`` to ``path`` atomically (mode 0600); returns its :attr:`PCAModel.model_id`."""
    from lmtier.codec.autotables import write_table_file

    data = to_bytes(m)
    write_table_file(path, data)
    return _id(data[-32:])


def load(path: str | Path) -> PCAModel:
    """Read and verify a model file (:func:`from_bytes`). Raises PCAModelError, OSError."""
    return from_bytes(Path(path).read_bytes(), str(path))
