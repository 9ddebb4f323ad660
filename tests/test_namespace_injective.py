"""The request part of the key namespace is injective (issue 20, section 1).

Up to format version 1 the vLLM connector joined a request's ``cache_salt``, LoRA adapter and
multimodal hashes into one ``"\\x1f"``-delimited string (``salt=A\\x1flora=sql#1@/adapters/sql``),
so a base-model request whose client-chosen ``cache_salt`` spelled that string got the keys of a LoRA
request. Now every field is tagged and length-prefixed (:class:`lmtier.keys.KeyScope`): these tests
decode the encoding back to its fields (so two scopes share keys only if every field is equal), try
adversarial salts against every legitimate composition, and check through
:func:`lmtier.integration.vllm.common.request_salt` with request objects shaped like vLLM's
``Request`` (no vLLM import; ``tests/test_salt_server.py`` does it through vLLM).

Empty salt vs no salt (decided): ``None``, ``""`` and ``b""`` are all "no salt", at the library
level (``chunk_keys``, ``KeyScope``) and for vLLM requests, as in vLLM itself (its prefix cache ignores
an empty ``cache_salt``; its OpenAI server rejects one).
"""

from __future__ import annotations

import itertools
import struct
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmtier.integration.vllm.common import request_salt
from lmtier.keys import KeyScope, LoraScope, MMInput, Namespace, chunk_keys

NS = Namespace(model="tiny@v1", num_layers=2, num_kv_heads=1, head_size=8, kv_dtype="float16", chunk_size=16)
TOKENS = list(range(100, 100 + 48))  # 3 full chunks


# ---------------------------------------------------------------------- an independent decoder


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        assert self.pos + n <= len(self.data), "truncated encoding"
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def tag(self, t: bytes) -> None:
        assert self.take(len(t)) == t

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def i64(self) -> int:
        return struct.unpack("<q", self.take(8))[0]

    def blob(self, t: bytes) -> bytes:
        self.tag(t)
        return self.take(self.u64())

    def present(self, t: bytes) -> bool:
        self.tag(t)
        flag = self.take(1)
        assert flag in (b"\x00", b"\x01")
        return flag == b"\x01"


def decode_scope(enc: bytes) -> tuple:
    """The fields of ``KeyScope.encoding()``, parsed from the documented format alone."""
    r = _Reader(enc)
    r.tag(b"LMTSCOPE\x02")
    salt = r.take(r.u64()) if r.present(b"s") else None
    lora = None
    if r.present(b"L"):
        name = r.blob(b"n").decode()
        r.tag(b"i")
        lora = (name, r.i64(), r.blob(b"p").decode())
    r.tag(b"M")
    mm = []
    for _ in range(r.u64()):
        ident = r.blob(b"h").decode()
        r.tag(b"o")
        off = r.i64()
        r.tag(b"l")
        mm.append((ident, off, r.i64()))
    embeds = r.blob(b"e") if r.present(b"E") else None
    assert r.pos == len(enc), "trailing bytes"
    return salt, lora, tuple(mm), embeds


def fields_of(scope: KeyScope) -> tuple:
    lora = None if scope.lora is None else (scope.lora.name, scope.lora.int_id, scope.lora.path)
    return scope.cache_salt, lora, tuple((m.identifier, m.offset, m.length) for m in scope.mm), scope.prompt_embeds


# ---------------------------------------------------------------------- vLLM-shaped requests


def fake_request(salt=None, lora=None, mm=(), embeds=None):
    """A request with the attributes ``request_salt`` reads from a vLLM ``Request``."""
    lora_request = None
    if lora is not None:
        lora_request = SimpleNamespace(lora_name=lora[0], lora_int_id=lora[1], lora_path=lora[2])
    mm_features = [
        SimpleNamespace(identifier=h, mm_hash=h, mm_position=SimpleNamespace(offset=o, length=n)) for h, o, n in mm
    ]
    return SimpleNamespace(
        cache_salt=salt, lora_request=lora_request, mm_features=mm_features or None, prompt_embeds=embeds
    )


def keys_of(request) -> list[bytes]:
    return chunk_keys(TOKENS, NS, cache_salt=request_salt(request))


SQL = ("sql", 1, "/adapters/sql")
# What format version 1 composed for these requests (connector.request_salt, issue 20):
V1_LORA = "lora=sql#1@/adapters/sql"
V1_SALTED_LORA = "salt=A\x1flora=sql#1@/adapters/sql"
V1_MM = "mm=abc123@5"
V1_SALTED_LORA_MM = "salt=A\x1flora=sql#1@/adapters/sql\x1fmm=abc123@5"

LEGIT = {
    "base": fake_request(),
    "salt A": fake_request("A"),
    "lora": fake_request(lora=SQL),
    "salt A + lora": fake_request("A", lora=SQL),
    "lora other path": fake_request(lora=("sql", 1, "/adapters/sql2")),
    "lora other id": fake_request(lora=("sql", 2, "/adapters/sql")),
    "mm": fake_request(mm=[("abc123", 5, 7)]),
    "salt A + mm": fake_request("A", mm=[("abc123", 5, 7)]),
    "salt A + lora + mm": fake_request("A", lora=SQL, mm=[("abc123", 5, 7)]),
    "two mm": fake_request(mm=[("abc123", 5, 7), ("def456", 20, 7)]),
    "embeds": fake_request(embeds=None),  # same as base (no embeddings)
}

ADVERSARIAL_SALTS = [
    V1_LORA,
    V1_SALTED_LORA,
    V1_MM,
    V1_SALTED_LORA_MM,
    "salt=A",
    "A\x1f",
    "\x1f",
    "\x00",
    "A\x00",
    "=",
    "#",
    "@",
    "salt=",
    "lora=",
    "lora=sql#1@",
    "sql",
    "/adapters/sql",
    "abc123",
    "x" * (1 << 20),  # 1 MiB
    "ü🙂" * 1000,
    "\u202eRTL",
    b"\xff\xfe invalid utf-8",
]


def test_issue_20_crafted_salts_do_not_reproduce_lora_keys():
    """The issue's two collisions (fail on format version 1: equal first chunk keys)."""
    assert keys_of(fake_request(V1_LORA))[0] != keys_of(fake_request(lora=SQL))[0]
    assert keys_of(fake_request(V1_SALTED_LORA))[0] != keys_of(fake_request("A", lora=SQL))[0]
    assert keys_of(fake_request(V1_MM))[0] != keys_of(fake_request(mm=[("abc123", 5, 7)]))[0]
    assert keys_of(fake_request(V1_SALTED_LORA_MM))[0] != keys_of(fake_request("A", lora=SQL, mm=[("abc123", 5, 7)]))[0]


@pytest.mark.parametrize("salt", ADVERSARIAL_SALTS, ids=lambda s: repr(s)[:40])
def test_adversarial_salt_differs_from_every_legit_composition(salt):
    crafted = keys_of(fake_request(salt))
    assert len(crafted) == 3
    for name, req in LEGIT.items():
        assert not set(crafted) & set(keys_of(req)), name
    # and from the same salt combined with any other field
    for other in (fake_request(salt, lora=SQL), fake_request(salt, mm=[("abc123", 5, 7)])):
        assert not set(crafted) & set(keys_of(other))
    # a plain salt is the library's plain cache_salt (one key space for both APIs)
    assert crafted == chunk_keys(TOKENS, NS, cache_salt=salt)


def test_adversarial_salts_are_pairwise_distinct():
    firsts = [keys_of(fake_request(s))[0] for s in ADVERSARIAL_SALTS]
    assert len(set(firsts)) == len(firsts)


def test_legit_compositions_are_pairwise_distinct():
    firsts = {name: keys_of(r)[0] for name, r in LEGIT.items() if name != "embeds"}
    assert len(set(firsts.values())) == len(firsts)
    assert keys_of(LEGIT["embeds"]) == keys_of(LEGIT["base"])


def test_lora_and_mm_fields_cannot_spell_each_other():
    """Delimiter-like characters inside LoRA / multimodal fields shift nothing between fields."""
    pairs = [
        (fake_request(lora=("a#1", 1, "b")), fake_request(lora=("a", 1, "1#b"))),
        (fake_request(lora=("a@b", 1, "c")), fake_request(lora=("a", 1, "b@c"))),
        (
            fake_request(lora=("sql", 1, "/p\x1fmm=abc123@5")),
            fake_request(lora=("sql", 1, "/p"), mm=[("abc123", 5, 0)]),
        ),
        (fake_request(mm=[("a@1", 2, 3)]), fake_request(mm=[("a", 12, 3)])),
        (fake_request(mm=[("ab", 1, 1), ("c", 2, 2)]), fake_request(mm=[("a", 1, 1), ("bc", 2, 2)])),
        (fake_request(mm=[("a", 1, 1), ("b", 2, 2)]), fake_request(mm=[("b", 2, 2), ("a", 1, 1)])),
        (fake_request(embeds=None, mm=[("x", 0, 4)]), fake_request(mm=[("x", 0, 5)])),
    ]
    for a, b in pairs:
        assert keys_of(a)[0] != keys_of(b)[0]


def test_empty_salt_is_no_salt():
    """Decided: "" (and b"") is "no salt", everywhere (vLLM treats an empty cache_salt the same)."""
    base = chunk_keys(TOKENS, NS)
    assert chunk_keys(TOKENS, NS, cache_salt="") == base
    assert chunk_keys(TOKENS, NS, cache_salt=b"") == base
    assert chunk_keys(TOKENS, NS, cache_salt=KeyScope(cache_salt="")) == base
    assert chunk_keys(TOKENS, NS, cache_salt=KeyScope()) == base
    assert request_salt(fake_request("")) is None and request_salt(fake_request()) is None
    assert keys_of(fake_request("", lora=SQL)) == keys_of(fake_request(None, lora=SQL))
    assert KeyScope(cache_salt="") == KeyScope() and KeyScope(cache_salt="").cache_salt is None
    # any non-empty salt, even a NUL byte or a space, is a salt
    for s in ("\x00", " ", b"\x00"):
        assert not set(chunk_keys(TOKENS, NS, cache_salt=s)) & set(base)


def test_prompt_embeds_enter_the_scope():
    import torch

    e1 = torch.zeros(4, 8, dtype=torch.bfloat16)
    e2 = e1.clone()
    e2[3, 7] = 1.0
    k1, k1b, k2 = (keys_of(fake_request(embeds=e)) for e in (e1, e1.clone(), e2))
    assert k1 == k1b and k1 != k2
    assert not set(k1) & set(keys_of(fake_request()))
    assert keys_of(fake_request(embeds=e1.float()))[0] != k1[0]  # dtype is part of the digest


def test_library_salt_is_the_scope_of_that_salt_only():
    for s in ("A", b"A", "é", V1_LORA):
        assert chunk_keys(TOKENS, NS, cache_salt=s) == chunk_keys(TOKENS, NS, cache_salt=KeyScope(cache_salt=s))
    assert chunk_keys(TOKENS, NS, cache_salt="A") == keys_of(fake_request("A"))
    assert KeyScope(cache_salt="é") == KeyScope(cache_salt="é".encode())


@pytest.mark.parametrize(
    "bad",
    [
        dict(lora=("sql", 1, "/p")),
        dict(mm=[("x", 0, 1)]),
        dict(mm=(MMInput("x", 0, 1), "y")),
        dict(prompt_embeds="digest"),
        dict(cache_salt=3),
    ],
)
def test_scope_rejects_wrong_types(bad):
    with pytest.raises(TypeError):
        KeyScope(**bad)


@pytest.mark.parametrize(
    "bad",
    [
        dict(name=1, int_id=1, path="p"),
        dict(name="a", int_id="1", path="p"),
        dict(name="a", int_id=True, path="p"),
        dict(name="a", int_id=2**63, path="p"),
    ],
)
def test_lora_scope_rejects_wrong_types(bad):
    with pytest.raises(TypeError):
        LoraScope(**bad)


def test_namespace_string_fields_are_length_prefixed():
    """The library namespace: shifting characters between string fields changes the digest."""
    base = dict(num_layers=2, num_kv_heads=1, head_size=8, chunk_size=16)
    a = Namespace(model="m|cpu_attn=vec", kv_dtype="float16", codec="none", **base)
    b = Namespace(model="m", kv_dtype="float16", codec="none", **base)
    c = Namespace(model="mnone", kv_dtype="float16", codec="none", **base)
    assert len({a.digest(), b.digest(), c.digest()}) == 3


# ---------------------------------------------------------------------- property: injectivity

_PIECES = list("a=#@/\x1f\x00 ü🙂") + ["salt=", "lora=", "mm=", "LMTSCOPE\x02", "s\x01", "L\x00", "\x01\x00\x00"]
_text = st.lists(st.sampled_from(_PIECES), max_size=6).map("".join)
_salt = st.one_of(st.none(), _text, st.binary(max_size=8))
_lora = st.one_of(st.none(), st.tuples(_text, st.integers(-(2**63), 2**63 - 1), _text))
_mm = st.lists(st.tuples(_text, st.integers(-3, 3000), st.integers(-1, 3000)), max_size=3).map(tuple)
_embeds = st.one_of(st.none(), st.binary(max_size=6))
_scope = st.tuples(_salt, _lora, _mm, _embeds)


def _make(fields) -> KeyScope:
    salt, lora, mm, embeds = fields
    return KeyScope(
        cache_salt=salt,
        lora=None if lora is None else LoraScope(*lora),
        mm=tuple(MMInput(*m) for m in mm),
        prompt_embeds=embeds,
    )


def _norm(fields) -> tuple:
    salt, lora, mm, embeds = fields
    if isinstance(salt, str):
        salt = salt.encode()
    return (salt or None), lora, tuple(mm), embeds


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scope)
def test_scope_encoding_decodes_to_its_fields(fields):
    """decode(encode(x)) == x: the encoding is injective (two scopes share an encoding, and so keys,
    only if every field is equal)."""
    scope = _make(fields)
    assert decode_scope(scope.encoding()) == fields_of(scope) == _norm(fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scope, _scope)
def test_scope_keys_equal_iff_fields_equal(a, b):
    ka = chunk_keys(TOKENS, NS, cache_salt=_make(a))
    kb = chunk_keys(TOKENS, NS, cache_salt=_make(b))
    assert (ka == kb) == (_norm(a) == _norm(b))
    if _norm(a) != _norm(b):
        assert not set(ka) & set(kb)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_text, _scope)
def test_no_plain_salt_spells_a_composed_request(salt, fields):
    """A base-model request with only a (client-chosen) salt never shares keys with a request that
    has a LoRA adapter, a multimodal input or prompt embeddings."""
    _, lora, mm, embeds = fields
    if lora is None and not mm and embeds is None:
        return
    lora_req = None if lora is None else (lora[0], lora[1], lora[2])
    composed = fake_request(fields[0], lora=lora_req, mm=mm)
    crafted = fake_request(salt)
    assert keys_of(crafted)[0] != chunk_keys(TOKENS, NS, cache_salt=_make(fields))[0]
    if embeds is None:
        assert keys_of(crafted)[0] != keys_of(composed)[0]


def test_every_pair_of_small_scopes_differs():
    """Exhaustive over a small grid of delimiter-laden values (complements the random search)."""
    vals = ["", "a", "a=", "=a", "\x1f", "a\x1fb", "#", "@"]
    seen: dict[bytes, tuple] = {}
    for salt, lora in itertools.product(vals, [None] + [(n, 1, p) for n in vals[:4] for p in vals[:4]]):
        f = (salt, lora, (), None)
        enc = _make(f).encoding()
        assert seen.setdefault(enc, _norm(f)) == _norm(f)
