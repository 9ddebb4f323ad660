"""Offline evaluation corpus and models of the codec quality matrix (issue 19).

Texts of different kinds, assembled from what is installed on the box (no hub, no download):
Debian's license texts, pydoc of stdlib modules, stdlib Python source, a C header, translated
(German / French) man pages stripped of troff, and FAQ files rendered as chat turns (dialogue-like,
in the model's chat template). They are split into a **tune** set (the only texts any level
parameter may be chosen on) and a **held-out** set (never tuned on; the targets are judged on every
text of both). Every text is cut to ``context + continuation`` tokens by the model's tokenizer.

Models:

* ``smollm2``: SmolLM2-135M-Instruct (``models/SmolLM2-135M-Instruct``; weights dequantized from a
  4-bit GGUF), 30 layers, 3 KV heads of 64.
* ``smollm2-d28``: a *depth-pruned derivative* of it, built offline: layers 26 and 27 removed
  (28 layers), so layers 28-29 see inputs they were not trained on and the "sixths of the depth"
  land on other layers. Same architecture, different size, a degraded model (perplexity on the
  first 512 tokens of MPL-2.0: 18.1 vs 12.3 for the full model; dropping 3 or 6 layers gave 42 and
  206) — a stand-in for "a second model", since no second small model can be fetched here. Its
  perplexity on each text is in the matrix JSON (``ppl_ref``).
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import re
import unicodedata
from pathlib import Path

# name -> (source spec, split)
MATRIX_TEXTS: dict[str, tuple[str, str]] = {
    # tune split
    "prose_mpl": ("license:MPL-2.0", "tune"),
    "doc_pydoc": ("pydoc:pathlib,argparse", "tune"),
    "code_py": ("pysrc:heapq,bisect,textwrap,shlex", "tune"),
    "fr_man": ("man:fr/man8/apt-get.8.gz", "tune"),
    "chat_valgrind": ("chat:/usr/share/doc/valgrind/FAQ.txt.gz", "tune"),
    # held-out split (never tuned on)
    "prose_gfdl": ("license:GFDL-1.3", "held-out"),
    "code_c": ("file:/usr/include/zlib.h", "held-out"),
    "de_man": ("man:de/man8/apt-get.8.gz", "held-out"),
    "chat_zlib": ("chat:/usr/share/doc/zlib1g-dev/FAQ.gz", "held-out"),
}

# name -> source spec: calibration-only texts (issue 19's "broad, mixed corpus"), never evaluated and
# sharing no document with MATRIX_TEXTS (another license, other modules, another header, other
# commands' man pages in German, Spanish, Polish and Russian). No dialogue: the box's other FAQ files
# are shorter than a matrix context (1,280 tokens).
CALIBRATION_TEXTS: dict[str, str] = {
    "cal_prose_apache": "license:Apache-2.0",
    "cal_doc_pydoc": "pydoc:json,csv",
    "cal_code_py": "pysrc:fnmatch,string",
    "cal_code_c": "file:/usr/include/stdio.h",
    "cal_de_man": "man:de/man1/dpkg-buildpackage.1.gz",
    "cal_es_man": "man:es/man1/dpkg-split.1.gz",
    "cal_pl_man": "man:pl/man1/dpkg-split.1.gz",
    "cal_ru_man": "man:ru/man1/apropos.1.gz",
}


def source_spec(name: str) -> str:
    """The source spec of a matrix text or of a calibration-only text (KeyError for neither)."""
    return MATRIX_TEXTS[name][0] if name in MATRIX_TEXTS else CALIBRATION_TEXTS[name]


MATRIX_CONTEXT = 1024  # 4 chunks of 256 tokens
MATRIX_CONTINUATION = 256  # scored tokens per text (2 shared CPU cores: keep a matrix run short)

# model name -> (directory under models/, kept layers or None for all)
MODELS: dict[str, tuple[str, tuple[int, ...] | None]] = {
    "smollm2": ("SmolLM2-135M-Instruct", None),
    "smollm2-d28": ("SmolLM2-135M-Instruct", (*range(26), 28, 29)),
}


def _read(path: str) -> str:
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return raw.decode("utf-8", errors="replace")


_TROFF_ESC = re.compile(r"\\f[BIRP]|\\f\(..|\\\(..|\\[&|^e-]|\\\*\(..|\\\*.")
# troff accent escapes (groff_char(7)) -> the character
_ACCENTS = {"'": "\u0301", "`": "\u0300", "^": "\u0302", ":": "\u0308", ",": "\u0327", "~": "\u0303"}
_ACCENT_ESC = re.compile(r"\\\((['`^:,~])([A-Za-z])")
_NAMED = {"\\(ss": "ß", "\\*(Aq": "'", "\\(aq": "'", "\\(dq": '"', "\\(Fo": "«", "\\(Fc": "»", "\\(em": "—"}


def strip_troff(src: str) -> str:
    """man(7) source -> plain text: request lines dropped (section titles kept), font escapes removed."""
    out = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith("."):
            m = re.match(r"\.(SH|SS|TP|IP|B|I|BR|IR|RB)\s+(.*)", line)
            if m:
                line = m.group(2).replace('"', "")
            else:
                continue
        for k, v in _NAMED.items():
            line = line.replace(k, v)
        line = _ACCENT_ESC.sub(lambda m: unicodedata.normalize("NFC", m.group(2) + _ACCENTS[m.group(1)]), line)
        line = _TROFF_ESC.sub("", line).replace("\\-", "-").replace("\\\\", "\\")
        out.append(line)
    return "\n".join(out)


def as_chat(text: str) -> str:
    """FAQ text -> alternating user / assistant turns (one paragraph each) in ChatML, SmolLM2's
    chat template format."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    turns = []
    for i, p in enumerate(paras):
        role = "user" if i % 2 == 0 else "assistant"
        turns.append(f"<|im_start|>{role}\n{p}<|im_end|>\n")
    return "".join(turns)


def source_text(src: str) -> str:
    """The text of a source spec ``kind:arg[+kind:arg...]``; kinds: license, pydoc, pysrc, file,
    man (path under /usr/share/man), chat (an FAQ file rendered as chat turns)."""
    parts = []
    for piece in src.split("+"):
        kind, arg = piece.split(":", 1)
        if kind == "license":
            parts.append(Path("/usr/share/common-licenses", arg).read_text())
        elif kind == "pydoc":
            import pydoc

            for mod in arg.split(","):
                parts.append(pydoc.render_doc(importlib.import_module(mod), renderer=pydoc.plaintext))
        elif kind == "pysrc":
            for mod in arg.split(","):
                parts.append(inspect.getsource(importlib.import_module(mod)))
        elif kind == "file":
            parts.append(_read(arg))
        elif kind == "man":
            parts.append(strip_troff(_read(str(Path("/usr/share/man", arg)))))
        elif kind == "chat":
            parts.append(as_chat(_read(arg)))
        else:
            raise ValueError(f"unknown text source kind {kind!r} in {src!r}")
    return "\n".join(parts)


def prune_layers(model, keep: tuple[int, ...]):
    """Keep only decoder layers ``keep`` (in order) of a Llama-family HF model, in place; fixes the
    layer indices the KV cache uses and the config's layer count. Returns the model."""
    import torch

    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    for new, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return model
