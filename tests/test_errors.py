"""lmtier.errors: every error class lmtier defines derives from LMTierError and keeps its built-in base."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lmtier.codec.chunk import CodecRecordError
from lmtier.codec.quant import CodecInputError
from lmtier.config import ConfigError
from lmtier.errors import LMTierError
from lmtier.layout import LayoutError
from lmtier.record import RecordError
from lmtier.tiers.base import TierError

PKG = Path(__file__).resolve().parent.parent / "lmtier"


@pytest.mark.parametrize(
    "cls,builtin",
    [
        (ConfigError, ValueError),
        (LayoutError, ValueError),
        (RecordError, ValueError),
        (CodecInputError, ValueError),
        (CodecRecordError, ValueError),
        (TierError, RuntimeError),
    ],
)
def test_error_classes_share_the_base_and_keep_theirs(cls, builtin):
    assert issubclass(cls, LMTierError) and issubclass(cls, builtin)
    with pytest.raises(LMTierError):
        raise cls("x")


def test_every_public_error_class_in_the_package_derives_from_lmtier_error():
    """A source scan (no imports, so vLLM-only modules count too): each public class whose bases are
    an exception type must reach LMTierError through lmtier's own classes."""
    bases: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = [
                    b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                    for b in node.bases
                ]
                bases[node.name] = names

    def is_exception(name: str, seen=()) -> bool:
        if name in ("Exception", "BaseException") or name.endswith(("Error", "Exception", "Warning")):
            return True
        return any(is_exception(b, seen + (name,)) for b in bases.get(name, ()) if b not in seen)

    def reaches_base(name: str, seen=()) -> bool:
        return name == "LMTierError" or any(
            reaches_base(b, seen + (name,)) for b in bases.get(name, ()) if b not in seen
        )

    errors = [n for n, b in bases.items() if not n.startswith("_") and n != "LMTierError" and any(map(is_exception, b))]
    assert {"ConfigError", "TierError", "RecordError", "LayoutError", "InjectedFault"} <= set(errors)
    assert [n for n in errors if not reaches_base(n)] == []
