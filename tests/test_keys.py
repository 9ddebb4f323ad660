"""Tests for lmtier.keys: stability across processes, namespace/salt separation, prefix property."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from lmtier.keys import KEY_BYTES, Namespace, chunk_keys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE_NS = dict(model="tiny-llama@v1", num_layers=4, num_kv_heads=2, head_size=64, kv_dtype="bfloat16", chunk_size=16)


def make_ns(**over) -> Namespace:
    return Namespace(**{**BASE_NS, **over})


TOKENS = list(range(1000, 1000 + 100))  # 6 full chunks of 16, tail of 4


def test_key_count_and_length():
    keys = chunk_keys(TOKENS, make_ns())
    assert len(keys) == 100 // 16 == 6
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 6
    assert chunk_keys(TOKENS[:15], make_ns()) == []
    assert chunk_keys([], make_ns()) == []


def test_reference_chain():
    """The documented construction, re-derived independently.

    Format version 2 (issue 20): the root hashes the injective scope encoding (here: no salt, no
    LoRA, no multimodal input, no prompt embeddings) where version 1 hashed a lone ``b"\\x00"``."""
    ns = make_ns()
    ns_d = ns.digest()
    no_scope = b"LMTSCOPE\x02" + b"s\x00" + b"L\x00" + b"M" + (0).to_bytes(8, "little") + b"E\x00"
    h = hashlib.blake2b(
        len(ns_d).to_bytes(8, "little") + ns_d + no_scope, digest_size=32, person=b"lmtier-root"
    ).digest()
    expected = []
    for i in range(6):
        data = np.asarray(TOKENS[i * 16 : (i + 1) * 16], dtype="<u4").tobytes()
        h = hashlib.blake2b(h + data, digest_size=32, person=b"lmtier-chunk").digest()
        expected.append(h)
    assert chunk_keys(TOKENS, ns) == expected


def test_golden_value():
    """Pin the format: a change here invalidates every stored cache (bump format_version)."""
    ns = Namespace(model="m", num_layers=1, num_kv_heads=1, head_size=1, kv_dtype="float16", chunk_size=4)
    keys = chunk_keys([0, 1, 2, 3, 4, 5, 6, 7], ns)
    assert len(keys) == 2
    assert keys[0].hex() == GOLDEN[0] and keys[1].hex() == GOLDEN[1]


# Format version 2 (issue 20: the request scope -- cache_salt, LoRA, multimodal inputs -- is encoded
# injectively, and CANONICAL_FORMAT_VERSION went 1 -> 2 so version-1 records are misses). The
# version-1 values were f1d030410e86c2d7... and be2369634d0326a1...
GOLDEN = (
    "ce143432e81b12d8a168af78e1b88bbef9b585140a1ecab349714501aa90b033",
    "9eadf0ef732f1d9277a1b0b0f7eac796e8fc48c68baba3238fe41599c6b9daab",
)


@pytest.mark.parametrize(
    "convert",
    [
        list,
        lambda t: np.asarray(t, dtype=np.int64),
        lambda t: np.asarray(t, dtype=np.int32),
        lambda t: np.asarray(t, dtype=np.uint32),
        lambda t: np.asarray(t, dtype=">i8"),
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
        tuple,
        lambda t: (x for x in t),
    ],
    ids=[
        "list",
        "np-int64",
        "np-int32",
        "np-uint32",
        "np-bigendian",
        "torch-int64",
        "torch-int32",
        "tuple",
        "generator",
    ],
)
def test_input_types_agree(convert):
    assert chunk_keys(convert(TOKENS), make_ns()) == chunk_keys(TOKENS, make_ns())


def test_prefix_property():
    ns = make_ns()
    full = chunk_keys(TOKENS, ns)
    for n in range(0, len(TOKENS) + 1, 7):
        assert chunk_keys(TOKENS[:n], ns) == full[: n // 16]


def test_one_token_change_changes_that_key_and_all_later():
    ns = make_ns()
    a = chunk_keys(TOKENS, ns)
    toks = list(TOKENS)
    toks[40] += 1  # chunk 2
    b = chunk_keys(toks, ns)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "tiny-llama@v2"),
        ("num_layers", 5),
        ("num_kv_heads", 4),
        ("head_size", 128),
        ("kv_dtype", "float16"),
        ("kv_dtype", "fp8_e4m3"),
        ("kv_planes", 1),
        ("format_version", 1),  # the previous version (CANONICAL_FORMAT_VERSION is 2): old keys are disjoint
        ("codec", "cachegen"),
        ("tp_size", 2),
    ],
)
def test_namespace_fields_separate_keys(field, value):
    a = chunk_keys(TOKENS, make_ns())
    b = chunk_keys(TOKENS, make_ns(**{field: value}))
    assert make_ns().digest() != make_ns(**{field: value}).digest()
    assert not set(a) & set(b)


def test_tp_rank_separates_keys():
    a = chunk_keys(TOKENS, make_ns(tp_size=2, tp_rank=0))
    b = chunk_keys(TOKENS, make_ns(tp_size=2, tp_rank=1))
    assert not set(a) & set(b)


def test_chunk_size_separates_keys():
    a = chunk_keys(TOKENS, make_ns(chunk_size=16))
    b = chunk_keys(TOKENS, make_ns(chunk_size=32))
    assert len(b) == 3 and not set(a) & set(b)


def test_field_boundaries_are_unambiguous():
    # Length prefixes: moving characters between adjacent string fields must change the digest.
    a = make_ns(model="ab", kv_dtype="float16", codec="none")
    b = make_ns(model="abf", kv_dtype="float16", codec="none")
    assert a.digest() != b.digest()


@pytest.mark.parametrize("salt", ["tenant-a", b"tenant-a", "x", b"\x00", " "])
def test_salt_separates_keys(salt):
    ns = make_ns()
    plain = chunk_keys(TOKENS, ns)
    salted = chunk_keys(TOKENS, ns, cache_salt=salt)
    assert not set(plain) & set(salted)
    assert chunk_keys(TOKENS, ns, cache_salt=salt) == salted  # deterministic


def test_salt_none_and_empty_are_the_same_and_str_equals_utf8_bytes():
    ns = make_ns()
    assert chunk_keys(TOKENS, ns, cache_salt=None) == chunk_keys(TOKENS, ns, cache_salt="")
    assert chunk_keys(TOKENS, ns, cache_salt=b"") == chunk_keys(TOKENS, ns)
    assert chunk_keys(TOKENS, ns, cache_salt="é") == chunk_keys(TOKENS, ns, cache_salt="é".encode())
    assert chunk_keys(TOKENS, ns, cache_salt="a") != chunk_keys(TOKENS, ns, cache_salt="b")


@pytest.mark.parametrize("salt", [1, 1.5, ["a"], {"a": 1}, object()])
def test_bad_salt_type(salt):
    with pytest.raises(TypeError, match="cache_salt"):
        chunk_keys(TOKENS, make_ns(), cache_salt=salt)


@pytest.mark.parametrize(
    "tokens,exc",
    [
        ([1, 2, -1], ValueError),
        ([1, 2**32], ValueError),
        ([1, 2**70], ValueError),
        (np.array([1, -5], dtype=np.int32), ValueError),
        (np.array([2**33], dtype=np.uint64), ValueError),
        (torch.tensor([-1, 3]), ValueError),
        (np.zeros((2, 16), dtype=np.int64), ValueError),
        ([1.0, 2.0], TypeError),
        (np.array([1.0, 2.0]), TypeError),
        (torch.tensor([1.0]), TypeError),
        (torch.tensor([True]), TypeError),
        (["a"], TypeError),
    ],
)
def test_bad_tokens(tokens, exc):
    with pytest.raises(exc):
        chunk_keys(tokens, make_ns(chunk_size=1))


def test_max_token_id_accepted():
    assert len(chunk_keys([0, 2**32 - 1], make_ns(chunk_size=1))) == 2


@pytest.mark.parametrize(
    "over,exc",
    [
        (dict(model=""), TypeError),
        (dict(model=None), TypeError),
        (dict(num_layers=0), ValueError),
        (dict(num_layers=2.0), ValueError),
        (dict(num_kv_heads=-1), ValueError),
        (dict(kv_dtype="float64"), ValueError),
        (dict(kv_planes=3), ValueError),
        (dict(chunk_size=0), ValueError),
        (dict(tp_rank=2, tp_size=2), ValueError),
        (dict(tp_rank=-1), ValueError),
    ],
)
def test_bad_namespace(over, exc):
    with pytest.raises(exc):
        make_ns(**over)


def test_namespace_is_frozen_and_chunk_bytes():
    ns = make_ns()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns.model = "x"  # type: ignore[misc]
    assert ns.chunk_bytes == 4 * 2 * 16 * 2 * 64 * 2
    mla = make_ns(kv_planes=1, num_kv_heads=1, head_size=576, kv_dtype="fp8_e4m3")
    assert mla.chunk_bytes == 4 * 1 * 16 * 1 * 576 * 1
    assert make_ns() == make_ns() and hash(make_ns()) == hash(make_ns())


def test_namespace_type_check():
    with pytest.raises(TypeError, match="Namespace"):
        chunk_keys(TOKENS, BASE_NS)  # type: ignore[arg-type]


_SUBPROC = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from lmtier.keys import Namespace, chunk_keys
    ns = Namespace(model="tiny-llama@v1", num_layers=4, num_kv_heads=2, head_size=64,
                   kv_dtype="bfloat16", chunk_size=16, tp_rank=1, tp_size=2)
    toks = list(range(5000, 5000 + 16 * 5 + 3))
    keys = chunk_keys(toks, ns, cache_salt="tenant-42") + [ns.digest()]
    print(",".join(k.hex() for k in keys))
    """
)


def test_identical_keys_across_processes_and_hash_seeds():
    code = _SUBPROC.format(repo=REPO)
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        outs.add(res.stdout.strip())
    assert len(outs) == 1
    ns = Namespace(**{**BASE_NS, "tp_rank": 1, "tp_size": 2})
    here = chunk_keys(list(range(5000, 5000 + 16 * 5 + 3)), ns, cache_salt="tenant-42") + [ns.digest()]
    assert outs.pop() == ",".join(k.hex() for k in here)
