"""Experiment (issue 19): bits per (layer, K/V, head) chosen from the model's measured sensitivity.

The product's levels give every head of a layer the same ``qmax`` (``lmtier.codec.levels``: one per
sixth of the depth). This experiment asks how much quality the same bits buy when ``qmax`` varies
per (layer, plane, head) group, chosen from each group's measured effect on the model's output:

1. **Sensitivity** (``--sens-texts``, the tune split): for every group g, the KL of the continuation
   when only g carries the level's quantization error (the product's decode, ``decode_level``) and
   every other element is exact. Summed over groups it predicts the whole decode's KL (checked per
   text: ``sum`` beside ``full`` in the JSON).
2. **Bits per group and qmax** on the tune split (static tables per stream fitted there, the rate
   model of ``codec_rates``), for the candidates :data:`CANDS`.
3. **Allocation** for a bit budget (a multiple of the level's own bits on the tune split): minimize
   ``sum_g KL_g * (q0_g / q_g)**2`` (the error's scale is ``absmax / qmax``) subject to the budget —
   a Lagrangian sweep over the groups' (KL, bits) curves.
4. **Evaluation** on held-out texts (never used in 1–3): ratio = bf16 bits / ideal-coder bits with
   the tune split's tables (the ``ratio_bound`` of the matrix, §4.1b), Δppl / top-1 / KL as the matrix
   measures them, the level itself beside each allocation.

The per-head quantizer :func:`quantize_heads` is the product's arithmetic (Hadamard, one E5M3 scale
per (token, head), round-half-even) with ``qmax`` per head; with one qmax per layer its decode equals
the product's bit for bit (tests/test_codec_head_alloc.py). The record format cannot carry a qmax
per head today: no records are written here.

Run: ``python benchmarks/codec_head_alloc.py [--level default] [--budgets 1.0,0.9]
[--budget-level high] [--per-layer] [--fisher SAMPLES] [--sens-json PATH] [--json PATH]`` (SmolLM2;
the sensitivity pass is ~180 forwards per text, or ``SAMPLES`` backward passes with ``--fisher``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import codec_quality as CQ
import codec_rates as CR
import torch

from lmtier.codec import levels as L
from lmtier.codec import quant as Q

TUNE = ("prose_mpl", "code_py", "chat_valgrind", "doc_pydoc", "fr_man")
HELD = ("prose_gfdl", "code_c", "de_man", "chat_zlib")
CANDS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 17, 19, 23, 27, 31, 39, 47, 63)
"""qmax candidates per group."""
OFFSET = 127
"""Symbol = q + OFFSET (one alphabet for every qmax, so one table layout)."""


def level_qmax(level: L.Level, nl: int, h: int) -> torch.Tensor:
    """The level's qmax per (layer, plane) broadcast to heads: float32 ``[L, 2, H]``."""
    qk = torch.tensor(level.k.qmax_table(nl), dtype=torch.float32)
    qv = torch.tensor(level.v.qmax_table(nl), dtype=torch.float32)
    return torch.stack([qk, qv], 1)[:, :, None].expand(nl, 2, h).contiguous()


def quantize_heads(chunk: torch.Tensor, qmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a bf16 chunk ``[L, 2, T, H, D]`` with qmax per (layer, plane, head) (``[L, 2, H]``).

    Returns ``(symbols int64 [L, 2, H, D, T] in 0..254, scale codes int64 [L, 2, H, T], decode bf16
    [L, 2, T, H, D])`` in the product's arithmetic (:mod:`lmtier.codec.quant`, ``TOKEN_HEAD`` scales,
    Hadamard)."""
    x = chunk.float()
    y = Q.fwht(x)
    a = y.abs().amax(-1)  # [L, 2, T, H]
    qm = qmax[:, :, None, :].expand_as(a)
    code = torch.where(a > 0, Q.scale_code_ceil(a / qm), torch.zeros_like(a)).to(torch.int64)
    s = Q.scale_value(code.to(torch.uint8)).to(torch.float32)[..., None]
    q = torch.where(s > 0, torch.clamp(torch.round(y / s), -qm[..., None], qm[..., None]), torch.zeros_like(y))
    dec = (Q.fwht(q * s) / x.shape[-1]).to(chunk.dtype)
    return (q.to(torch.int64) + OFFSET).permute(0, 1, 3, 4, 2), code.permute(0, 1, 3, 2), dec


def _support(qmax: torch.Tensor, d: int) -> torch.Tensor:
    """bool ``[L*2*H*D, 256]``: the symbols each stream can emit (``|sym - OFFSET| <= qmax``)."""
    sym = torch.arange(256)
    sup = (sym - OFFSET).abs()[None, :] <= qmax.reshape(-1, 1)  # [L*2*H, 256]
    return sup.repeat_interleave(d, dim=0)


def _streams(sym: torch.Tensor) -> torch.Tensor:
    """Symbols ``[L, 2, H, D, T]`` as uint8 streams ``[L*2*H*D, T]`` (the rate model's input)."""
    return sym.reshape(-1, sym.shape[-1]).to(torch.uint8)


def group_bits(cal: list[torch.Tensor], nl: int, h: int) -> torch.Tensor:
    """float64 ``[L*2*H, len(CANDS)]``: symbol bits of each group over the tune chunks at each qmax
    (the rate model of the matrix: :class:`codec_rates.StaticCoderModel` fitted on those chunks)."""
    out = torch.zeros(nl * 2 * h, len(CANDS), dtype=torch.float64)
    for i, q in enumerate(CANDS):
        qm = torch.full((nl, 2, h), float(q))
        streams = [_streams(quantize_heads(c, qm)[0]) for c in cal]
        model = CR.StaticCoderModel(streams, _support(qm, cal[0].shape[-1]))
        for x in streams:
            out[:, i] += model.stream_bits(x).reshape(nl * 2 * h, -1).sum(1)
    return out


def allocate(kl0: torch.Tensor, q0: torch.Tensor, bits: torch.Tensor, budget: float) -> torch.Tensor:
    """qmax per group (float64 ``[G]``, values of :data:`CANDS`) minimizing the predicted KL
    ``sum kl0 * (q0 / q)**2`` with ``sum bits <= budget`` (bisection on the Lagrange multiplier)."""
    c = torch.tensor(CANDS, dtype=torch.float64)
    klq = kl0[:, None] * (q0[:, None] / c[None, :]) ** 2
    lo, hi = 1e-12, 1e3
    for _ in range(80):
        lam = (lo * hi) ** 0.5
        tot = bits.gather(1, (klq + lam * bits).argmin(1)[:, None]).sum()
        lo, hi = (lam, hi) if tot > budget else (lo, lam)
    return c[(klq + hi * bits).argmin(1)]


def per_layer_allocation(kl0: torch.Tensor, q0: torch.Tensor, bits: torch.Tensor, budget: float) -> torch.Tensor:
    """:func:`allocate` with one qmax per (layer, plane) for all its heads (their KL and bits summed):
    float32 ``[L, 2, H]``. ``kl0``, ``q0``: ``[L, 2, H]`` (``q0`` alike over heads); ``bits``:
    ``[L*2*H, len(CANDS)]``."""
    nl, _, h = kl0.shape
    q = allocate(kl0.sum(-1).reshape(-1), q0[:, :, 0].reshape(-1), bits.reshape(nl * 2, h, -1).sum(1), budget)
    return q.reshape(nl, 2, 1).expand(nl, 2, h).float().contiguous()


class Scheme:
    """A qmax per group with static tables (symbols, and scale codes per (layer, plane)) fitted on the
    tune chunks: :class:`codec_rates.StaticCoderModel`, as the matrix's ``ratio_bound``."""

    def __init__(self, qmax: torch.Tensor, cal: list[torch.Tensor]):
        self.qmax = qmax
        syms, codes = [], []
        for c in cal:
            s, k, _ = quantize_heads(c, qmax)
            syms.append(_streams(s))
            codes.append(k.reshape(k.shape[0] * 2, -1).to(torch.uint8))
        self.sym_model = CR.StaticCoderModel(syms, _support(qmax, cal[0].shape[-1]))
        self.side_model = CR.StaticCoderModel(codes, torch.ones(codes[0].shape[0], 256, dtype=torch.bool))

    def run(self, kv: torch.Tensor) -> tuple[float, torch.Tensor]:
        """(ratio bound, decoded KV bf16) of a canonical bf16 context ``kv``."""
        bits, dec = 0.0, []
        for c in CQ.chunk_views(kv):
            s, k, d = quantize_heads(c, self.qmax)
            bits += self.sym_model.bits(_streams(s))[0]
            bits += self.side_model.bits(k.reshape(k.shape[0] * 2, -1).to(torch.uint8))[0]
            dec.append(d)
        return kv.numel() * 16 / bits, torch.cat(dec, 2)


def reference(t: str, model: str, offset: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(text data, bf16 KV [L, 2, T, H, D], reference log-probs, scored next tokens)`` of text ``t``
    (its window at token ``offset``: :func:`codec_quality.get_text`)."""
    data = CQ.get_text(t, model, offset)
    kv = data["kv_fp32"].to(torch.bfloat16)
    return data, kv, CQ.continuation_logprobs(data, kv.float()), data["ids"][data["ctx"] + 1 :]


def level_reference(level: L.Level, t: str, model: str):
    """:func:`reference` plus the level's decode: ``(data, bf16 KV, reference log-probs, scored next
    tokens, decoded bf16 KV, KL of the whole decode)``."""
    data, kv, ref, ids = reference(t, model)
    dec = CQ.decode_level(level, kv)
    return data, kv, ref, ids, dec, CQ.compare(ref, CQ.continuation_logprobs(data, dec.float()), ids)["kl"]


def sensitivity(level: L.Level, texts, model: str) -> dict:
    """Per text: ``full`` (KL of the whole decode) and ``kl`` ``[L][2][H]`` (only that group decoded)."""
    out = {}
    for t in texts:
        t0 = time.time()
        data, kv, ref, ids, dec, full = level_reference(level, t, model)
        nl, _, _, h, _ = kv.shape
        kl = torch.zeros(nl, 2, h)
        for l in range(nl):
            for p in range(2):
                for hh in range(h):
                    x = kv.clone()
                    x[l, p, :, hh] = dec[l, p, :, hh]
                    kl[l, p, hh] = CQ.compare(ref, CQ.continuation_logprobs(data, x.float()), ids)["kl"]
        out[t] = dict(full=full, kl=kl.tolist())
        print(
            f"sensitivity {t}: full KL {full:.5f}, sum of groups {float(kl.sum()):.5f} ({time.time() - t0:.0f} s)",
            flush=True,
        )
    return out


def fisher_group_kl(logprobs, kv: torch.Tensor, e: torch.Tensor, samples: int, gen: torch.Generator) -> torch.Tensor:
    """Predicted KL per (layer, plane, head) group of the error ``e``: float64 ``[L, 2, H]``.

    The second-order expansion of the mean KL of ``n`` predicted tokens around the exact KV is
    ``KL(kv + e) ~ 1/(2n) e^T F e`` with ``F = sum_t E_{y ~ p_t}[g_t g_t^T]``, ``g_t`` the gradient of
    ``log p_t(y)`` w.r.t. ``kv`` (the Fisher information of the model's own distribution; KVQuant,
    Hooper et al. 2024, weights its quantizer by a Fisher diagonal, the empirical one at the data's
    tokens). The diagonal is estimated from ``samples`` draws of all ``n`` tokens at once (one
    backward each; unbiased, as the cross-token terms have zero mean), and a group's KL is
    ``1/(2n) sum_{i in g} F_ii e_i^2`` (errors of different elements taken as uncorrelated).

    Args:
        logprobs: ``x [L, 2, T, H, D] -> log-probs [n, V]``, differentiable in ``x``.
        kv, e: float32 ``[L, 2, T, H, D]``: the exact KV and the error to rate.
        samples: draws; gen: their random generator.
    """
    kl = torch.zeros(kv.shape[0], 2, kv.shape[3], dtype=torch.float64)
    n = 1
    for _ in range(samples):
        x = kv.clone().requires_grad_(True)
        lp = logprobs(x)
        n = lp.shape[0]
        y = torch.multinomial(lp.detach().exp(), 1, generator=gen)
        (g,) = torch.autograd.grad(lp.gather(1, y).sum(), x)
        kl += ((g * e) ** 2).sum((2, 4)).double()
    return kl * (0.5 / samples / n)


def fisher_sensitivity(level: L.Level, texts, model: str, samples: int = 8, seed: int = 0) -> dict:
    """:func:`sensitivity` from :func:`fisher_group_kl` (``samples`` backward passes per text) instead
    of one forward per group. Per text: ``full`` (the measured KL of the whole decode) and ``kl``
    ``[L][2][H]`` (predicted)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in texts:
        t0 = time.time()
        data, kvb, _, ids, dec, full = level_reference(level, t, model)
        n = ids.numel()  # the scored tokens, as compare() counts them

        def logprobs(x, data=data, n=n):
            return CQ.continuation_logprobs(data, x, grad=True)[:n]

        kv = kvb.float()
        kl = fisher_group_kl(logprobs, kv, dec.float() - kv, samples, gen)
        out[t] = dict(full=full, kl=kl.tolist())
        print(
            f"fisher sensitivity {t}: full KL {full:.5f}, sum of groups {float(kl.sum()):.5f} "
            f"({time.time() - t0:.0f} s)",
            flush=True,
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", default="default")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sens-texts", default=",".join(TUNE))
    ap.add_argument("--eval-texts", default=",".join(HELD))
    ap.add_argument("--budgets", default="1.0,0.9", help="bit budgets as multiples of the level's bits (tune split)")
    ap.add_argument(
        "--budget-level",
        default=None,
        help="budgets as multiples of this level's bits instead (the sensitivities stay --level's); "
        "the level itself is evaluated beside the allocations",
    )
    ap.add_argument(
        "--per-layer",
        action="store_true",
        help="also allocate one qmax per (layer, plane) for all its heads (the kernels' [L, 2] table)",
    )
    ap.add_argument(
        "--sens-json", type=Path, default=None, help="read the sensitivities here if it exists, else write them"
    )
    ap.add_argument(
        "--fisher",
        type=int,
        default=0,
        metavar="SAMPLES",
        help="estimate the sensitivities from the Fisher information with this many sampled "
        "continuations per text (one backward each) instead of one forward per group",
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.fisher < 0:
        ap.error(f"--fisher must be >= 1 sample (or 0: measure per group), got {a.fisher}")
    try:  # before any long pass: a wrong name fails at once
        level = L.get_level(a.level)
        blevel = L.get_level(a.budget_level) if a.budget_level else level
    except ValueError as e:
        ap.error(str(e))
    if a.sens_json and a.sens_json.exists():
        if a.fisher:
            ap.error(f"--fisher would be ignored: {a.sens_json} exists (its sensitivities are read)")
        sens = json.loads(a.sens_json.read_text())
    else:
        texts = a.sens_texts.split(",")
        sens = fisher_sensitivity(level, texts, a.model, a.fisher) if a.fisher else sensitivity(level, texts, a.model)
        if a.sens_json:
            a.sens_json.write_text(json.dumps(sens))
    kl0 = torch.tensor([v["kl"] for v in sens.values()], dtype=torch.float64).clamp_min(0).mean(0)
    nl, _, h = kl0.shape
    cal = [c for t in sens for c in CQ.chunk_views(CQ.get_text(t, a.model)["kv_fp32"].to(torch.bfloat16))]
    q0 = level_qmax(level, nl, h).double()
    bits = group_bits(cal, nl, h)
    qb = level_qmax(blevel, nl, h).double()
    base = float(bits.gather(1, torch.tensor([CANDS.index(int(q)) for q in qb.reshape(-1)])[:, None]).sum())
    schemes = {blevel.name: Scheme(qb.float(), cal)}
    for b in (float(x) for x in a.budgets.split(",")):
        schemes[f"{blevel.name}/head x{b:g}"] = Scheme(
            allocate(kl0.reshape(-1), q0.reshape(-1), bits, base * b).reshape(nl, 2, h).float(), cal
        )
        if a.per_layer:
            ql = per_layer_allocation(kl0, q0, bits, base * b)
            schemes[f"{blevel.name}/layer x{b:g}"] = Scheme(ql, cal)
    cells = []
    for t in a.eval_texts.split(","):
        data, kv, ref, ids = reference(t, a.model)
        for name, s in schemes.items():
            ratio, dec = s.run(kv)
            m = CQ.compare(ref, CQ.continuation_logprobs(data, dec.float()), ids)
            cells.append(dict(text=t, scheme=name, ratio_bound=ratio, qmax=s.qmax.tolist(), **m))
            print(
                f"{t:<12s} {name:<22s} ratio(bound) {ratio:5.2f}x dppl {m['dppl_pct']:+6.2f}% "
                f"top1 {m['top1']:6.2f}% KL {m['kl']:.5f}",
                flush=True,
            )
    if a.json:
        run = dict(
            level=a.level,
            budget_level=blevel.name,
            budgets=a.budgets,
            per_layer=a.per_layer,
            fisher_samples=a.fisher,
            sens_json=str(a.sens_json) if a.sens_json else None,
        )
        a.json.write_text(json.dumps(dict(model=a.model, **run, sensitivity=sens, cells=cells), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
