"""Whether lmtier's compiled extension (``lmtier/_C*.so``) is up to date, for scripts/bootstrap.sh.

A build's stamp is a SHA-256 over what the build reads: every file under ``csrc/``, ``setup.py``,
``CMakeLists.txt`` and ``pyproject.toml`` (path and bytes), and the settings that change its output:
``LMTIER_CUDA``, ``LMTIER_CUDA_ARCHS`` (as bootstrap passes them), the ``nvcc`` that CMake would find
and the Python version. Contents, not modification times, so a ``git checkout`` that changes nothing
costs no build and one that changes a source always does.

Usage (with the venv's Python, from anywhere)::

    python scripts/lib/extension_stamp.py check STAMP   # exit 0: up to date (stdout says why);
                                                        # exit 1: a build is needed (stdout says why)
    python scripts/lib/extension_stamp.py write STAMP   # after a successful build

``check`` is up to date only when STAMP holds the current digest, an ``lmtier/_C*.so`` exists and
``import lmtier._C`` works from outside the checkout (the editable install is in this Python's
environment) and finds this checkout's ``lmtier``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

TOP = Path(__file__).resolve().parents[2]
SOURCES = ("csrc", "setup.py", "CMakeLists.txt", "pyproject.toml")
"""What the build reads, relative to the checkout (a folder: every file under it)."""


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SOURCES:
        p = TOP / name
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            out.append(p)
    return out


def _nvcc() -> str:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else ""


def digest() -> str:
    """Hex SHA-256 of the sources and build settings (see the module doc)."""
    h = hashlib.sha256()
    for f in _files():
        h.update(str(f.relative_to(TOP)).encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    settings = {
        "LMTIER_CUDA": os.environ.get("LMTIER_CUDA", "AUTO"),
        "LMTIER_CUDA_ARCHS": os.environ.get("LMTIER_CUDA_ARCHS") or "release",
        "nvcc": _nvcc(),
        "python": sys.version,
    }
    h.update(repr(sorted(settings.items())).encode())
    return h.hexdigest()


def _imports_from_this_checkout() -> str | None:
    """None when ``import lmtier._C`` works outside the checkout and finds its ``lmtier``; else why not."""
    r = subprocess.run(
        [sys.executable, "-c", "import lmtier, lmtier._C; print(lmtier.__file__); print(lmtier._C.__file__)"],
        cwd="/",
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"import lmtier._C fails in {sys.executable} ({last})"
    for where in (Path(line).resolve() for line in r.stdout.split()):
        if TOP / "lmtier" not in where.parents:
            return f"{sys.executable} imports {where}, not this checkout's"
    return None


def check(stamp: Path) -> tuple[bool, str]:
    """(up to date, why) for the stamp file ``stamp``."""
    if not list((TOP / "lmtier").glob("_C*.so")):
        return False, "no lmtier/_C*.so"
    if not stamp.is_file():
        return False, f"no build stamp {stamp} (first build by this script)"
    if stamp.read_text().strip() != digest():
        return (
            False,
            "csrc/, setup.py, CMakeLists.txt, pyproject.toml or the build settings changed since the last build",
        )
    why = _imports_from_this_checkout()
    if why:
        return False, why
    return True, "csrc/, setup.py, CMakeLists.txt, pyproject.toml and the build settings are those of the last build"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("check", "write"):
        print(__doc__.split("Usage", 1)[1], file=sys.stderr)
        return 2
    stamp = Path(argv[1])
    if argv[0] == "write":
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest() + "\n")
        return 0
    ok, why = check(stamp)
    print(why)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
