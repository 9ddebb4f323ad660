"""The soak's workload and requests (tests/soak/run_soak.py): the prompt pool built from stdlib sources
and one streamed, greedy completion request with its TTFT, token ids and cached-token count."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from lmtier.testing.server import SERVED_NAME

__all__ = ["SOURCE_MODULES", "Prompt", "build_prompts", "send"]

SOURCE_MODULES = (
    "argparse",
    "textwrap",
    "collections",
    "functools",
    "pathlib",
    "subprocess",
    "tempfile",
    "shutil",
    "json.decoder",
    "json.encoder",
    "dataclasses",
    "enum",
    "string",
    "heapq",
    "bisect",
)


@dataclass
class Prompt:
    pid: str
    kind: str  # "shared" | "unique"
    ids: list[int]
    ref: list[int] | None = None


def build_prompts(model: Path, a: argparse.Namespace) -> list[Prompt]:
    import importlib
    import inspect

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in SOURCE_MODULES)
    ids = tok(text)["input_ids"]
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        if pos + n > len(ids):
            raise SystemExit(f"workload needs more text ({pos + n} > {len(ids)} tokens)")
        out = [int(t) for t in ids[pos : pos + n]]
        pos += n
        return out

    rng = random.Random(a.seed)
    prompts: list[Prompt] = []
    for p in range(a.prefixes):
        prefix = take(a.prefix_len)
        for q in range(a.questions):
            prompts.append(Prompt(f"s{p}q{q}", "shared", prefix + take(rng.randint(24, 80))))
    for u in range(a.unique):
        prompts.append(Prompt(f"u{u}", "unique", take(a.unique_len + rng.randint(0, 200))))
    return prompts


def send(base: str, p: Prompt, salt: str | None, a: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": p.ids,
        "max_tokens": a.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    out: dict[str, Any] = {
        "status": None,
        "error": None,
        "finish": None,
        "tokens": [],
        "cached": None,
        "ttft": None,
        "done": False,
    }
    t0 = time.perf_counter()
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=(5, a.request_timeout)) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
            return out
        for raw in r.iter_lines():
            if not raw or not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            msg = json.loads(data)
            if "error" in msg:
                out["error"] = f"stream error: {str(msg['error'])[:300]}"
                continue
            if msg.get("usage"):
                out["cached"] = (msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            for ch in msg.get("choices") or []:
                ids = ch.get("token_ids") or []
                if ids and out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
                out["tokens"] += ids
                out["finish"] = ch.get("finish_reason") or out["finish"]
            if time.perf_counter() - t0 > a.request_timeout:
                raise requests.Timeout("stream exceeded the request timeout")
    out["total"] = time.perf_counter() - t0
    if not out["done"] and out["error"] is None:
        out["error"] = "stream ended without [DONE]"
    if out["finish"] == "error" and out["error"] is None:
        out["error"] = "finish_reason error"
    return out
