"""lmtier.geometry: one definition of chunk geometry, the dtype table, KEY_BYTES and the canonical
format version; the layout, keys, records, codec, tiers and manager use it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmtier import geometry as G
from lmtier import keys, layout, record
from lmtier.codec import chunk as cchunk
from lmtier.codec import format as cformat
from lmtier.hf import TORCH_KV_DTYPES
from lmtier.keys import Namespace
from lmtier.tiers import base as tier_base
from lmtier.tiers.codec import CODEC_KV_DTYPES
from lmtier.tiers.factory import codec_chunk_shape

PKG = Path(__file__).resolve().parent.parent / "lmtier"


def test_dtype_table_matches_torch():
    for d in G.KV_DTYPES:
        t = G.torch_dtype(d.name)
        assert t.itemsize == d.itemsize == G.KV_DTYPE_BYTES[d.name] == G.torch_itemsize(t)
        assert G.kv_dtype(t) is d and all(G.kv_dtype(a) is d for a in d.aliases)
        assert TORCH_KV_DTYPES[d.name] is t
    assert G.kv_dtype("bf16").name == "bfloat16" and G.kv_dtype("half").name == "float16"
    assert G.torch_itemsize(torch.float8_e4m3fnuz) == 1  # moved as bytes, no namespace name
    with pytest.raises(ValueError, match="float64"):
        G.kv_dtype("float64")
    with pytest.raises(ValueError):
        G.torch_itemsize(torch.complex64)


def test_dtype_codes_are_the_record_formats_codes():
    # On-disk values: never renumbered.
    assert {c.name: int(c) for c in G.DTypeCode} == {
        "UNSPECIFIED": 0,
        "BFLOAT16": 1,
        "FLOAT16": 2,
        "FLOAT32": 3,
        "FLOAT8_E4M3": 4,
        "FLOAT8_E5M2": 5,
        "UINT8": 6,
    }
    assert cformat.DType is G.DTypeCode
    assert cchunk.CODEC_DTYPES == {torch.bfloat16: G.DTypeCode.BFLOAT16, torch.float16: G.DTypeCode.FLOAT16}
    assert CODEC_KV_DTYPES == {"bfloat16": torch.bfloat16, "float16": torch.float16}


def test_one_key_size_and_format_version():
    assert keys.KEY_BYTES is G.KEY_BYTES and record.KEY_BYTES is G.KEY_BYTES and tier_base.KEY_BYTES is G.KEY_BYTES
    assert keys.CANONICAL_FORMAT_VERSION is G.CANONICAL_FORMAT_VERSION
    assert Namespace("m", 2, 1, 4, "bfloat16").format_version == G.CANONICAL_FORMAT_VERSION
    # Source scan: no second definition of a fact of the geometry module in the package.
    defs = re.compile(
        r"^\s*(KEY_BYTES|CANONICAL_FORMAT_VERSION|KV_DTYPE_BYTES|TORCH_KV_DTYPES)\s*(:[^=]*)?=\s*[\d{]", re.M
    )
    dtype_dict = re.compile(r"""(torch\.bfloat16|["']bfloat16["'])\s*:\s*(torch\.|\d|fmt\.)""")
    found = [
        f"{p.relative_to(PKG)}: {m.group(0).strip()}"
        for p in PKG.rglob("*.py")
        if p.name != "geometry.py"
        for rx in (defs, dtype_dict)
        for m in rx.finditer(p.read_text())
    ]
    assert found == []


@pytest.mark.parametrize(
    "planes,heads,d,dtype", [(2, 8, 128, "bfloat16"), (1, 1, 576, "fp8_e4m3"), (2, 3, 64, "float32")]
)
def test_namespace_layout_and_geometry_agree(planes, heads, d, dtype):
    ns = Namespace("m", 5, heads, d, dtype, kv_planes=planes, chunk_size=16)
    g = G.ChunkGeometry.of(5, planes, heads, d, dtype)
    assert ns.geometry == g and g.mla == (planes == 1)
    assert ns.chunk_bytes == g.chunk_bytes(16) == 16 * 5 * planes * heads * d * G.KV_DTYPE_BYTES[dtype]
    assert ns.chunk_shape == codec_chunk_shape(ns) == g.chunk_shape(16) == (5, planes, 16, heads, d)
    t = G.torch_dtype(dtype)
    kvl = layout.KVLayout(
        num_layers=5,
        num_blocks=1,
        block_size=16,
        num_heads=heads,
        head_size=d,
        dtype=t,
        device=torch.device("cpu"),
        planes=(layout.PlaneStrides(0, 0, 0, 0, 1),) * planes,
        layer_ptrs=(0,) * 5,
    )
    assert kvl.geometry == g and kvl.chunk_bytes(16) == ns.chunk_bytes and kvl.chunk_shape(16) == ns.chunk_shape


def test_geometry_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_planes"):
        G.ChunkGeometry(1, 3, 1, 1, 2)
    with pytest.raises(ValueError, match="head_size"):
        G.ChunkGeometry(1, 2, 1, 0, 2)


def test_keys_and_records_do_not_import_torch():
    code = (
        "import sys, lmtier.geometry, lmtier.keys, lmtier.record, lmtier.envs, lmtier.config; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PKG.parent
    ).stdout.strip()
    assert out == "False"
