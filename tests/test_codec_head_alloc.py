"""The per-head bit-allocation experiment (`benchmarks/codec_head_alloc.py`, RESULTS §4.1e): its
quantizer is the product's arithmetic (with one qmax per layer its decode equals
`lmtier.codec.quant`'s bit for bit), a per-head qmax changes only that head, and the allocation keeps
its bit budget while giving the more sensitive group the finer quantizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import codec_head_alloc as HA  # noqa: E402
import codec_quality as CQ  # noqa: E402

from lmtier.codec import levels as L  # noqa: E402


def _kv(tokens: int = 256) -> torch.Tensor:
    """KV-like bf16 [L=6, 2, T, H=3, D=64] with per-channel magnitudes."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 2, tokens, 3, 64, generator=g) * (torch.rand(6, 2, 1, 3, 64, generator=g) + 0.1)
    return x.to(torch.bfloat16)


def test_per_layer_qmax_decodes_like_the_product():
    kv = _kv()
    for name in ("high", "default", "low"):
        lv = L.get_level(name)
        _, _, dec = HA.quantize_heads(kv, HA.level_qmax(lv, kv.shape[0], kv.shape[3]))
        ref = CQ.decode_level(lv, kv)
        assert torch.equal(dec.view(torch.int16), ref.view(torch.int16)), name


def test_a_head_qmax_changes_only_that_head():
    kv = _kv()
    q = HA.level_qmax(L.get_level("default"), 6, 3)
    s0, _, d0 = HA.quantize_heads(kv, q)
    q2 = q.clone()
    q2[4, 1, 2] = 31.0
    s1, _, d1 = HA.quantize_heads(kv, q2)
    changed = (d0.view(torch.int16) != d1.view(torch.int16)).nonzero()
    assert changed.numel() > 0
    assert set(map(tuple, changed[:, [0, 1, 3]].tolist())) == {(4, 1, 2)}
    assert int(s1[4, 1, 2].max()) - HA.OFFSET == 31 and int(s0[4, 1, 2].max()) - HA.OFFSET <= 2
    err0 = (d0[4, 1, :, 2].float() - kv[4, 1, :, 2].float()).norm()
    err1 = (d1[4, 1, :, 2].float() - kv[4, 1, :, 2].float()).norm()
    assert err1 < err0 / 5


def test_allocation_keeps_the_budget_and_favours_the_sensitive_group():
    c = torch.tensor(HA.CANDS, dtype=torch.float64)
    bits = torch.log2(2 * c + 1)[None, :].repeat(4, 1) * 1000  # same rate curve for 4 groups
    kl0 = torch.tensor([1e-3, 1e-4, 1e-4, 1e-5], dtype=torch.float64)
    q0 = torch.full((4,), 4.0, dtype=torch.float64)
    budget = float(bits[:, HA.CANDS.index(4)].sum())
    q = HA.allocate(kl0, q0, bits, budget)
    spent = sum(float(bits[g, HA.CANDS.index(int(q[g]))]) for g in range(4))
    assert spent <= budget
    assert q[0] > 4 and q[3] < 4 and q[0] > q[1] >= q[3]
    pred = float((kl0 * (q0 / q) ** 2).sum())
    assert pred < float(kl0.sum())  # better than the uniform allocation at the same bits


def test_per_layer_allocation_gives_every_head_of_a_layer_one_qmax():
    c = torch.tensor(HA.CANDS, dtype=torch.float64)
    nl, h = 2, 3
    # heads' bits differ (x1, x2, x3), so a wrong grouping of the bits would change the spend
    bits = torch.log2(2 * c + 1)[None, :] * 1000 * torch.tensor([1.0, 2.0, 3.0]).repeat(nl * 2)[:, None]
    kl0 = torch.full((nl, 2, h), 1e-5, dtype=torch.float64)
    kl0[1, 1, 0] = 1e-2  # one sensitive head makes its whole (layer, plane) finer
    q0 = torch.full((nl, 2, h), 4.0, dtype=torch.float64)
    budget = float(bits[:, HA.CANDS.index(4)].sum())
    q = HA.per_layer_allocation(kl0, q0, bits, budget)
    assert q.shape == (nl, 2, h) and q.dtype == torch.float32
    assert (q == q[:, :, :1]).all()
    assert q[1, 1, 0] > 4 and q[0, 0, 0] < 4
    spent = sum(float(bits[g, HA.CANDS.index(int(v))]) for g, v in enumerate(q.reshape(-1)))
    assert spent <= budget
    assert spent > 0.9 * budget  # the budget is used, not left over


def test_fisher_group_kl_predicts_the_kl_of_small_errors():
    # a softmax model linear in the KV: the KL of a small error on one element of a group is
    # 1/(2n) F_ii e_i^2 to second order, which the sampled Fisher diagonal must reproduce
    g = torch.Generator().manual_seed(0)
    shape, n, vocab = (2, 2, 3, 2, 4), 5, 7
    kv = torch.randn(shape, generator=g)
    a = torch.randn(n * vocab, kv.numel(), generator=g) * 0.3

    def logprobs(x):
        return torch.log_softmax((a @ x.reshape(-1)).reshape(n, vocab), -1)

    e = torch.zeros(shape)
    scale = torch.linspace(0.005, 0.04, 8).reshape(2, 2, 2)
    for idx, s in zip(torch.cartesian_prod(torch.arange(2), torch.arange(2), torch.arange(2)), scale.reshape(-1)):
        l, p, h = (int(v) for v in idx)
        e[l, p, 1, h, 2] = s  # one element per (layer, plane, head) group
    pred = HA.fisher_group_kl(logprobs, kv, e, samples=1500, gen=g)
    ref = logprobs(kv).detach()
    for l in range(2):
        for p in range(2):
            for h in range(2):
                x = kv.clone()
                x[l, p, :, h] += e[l, p, :, h]
                lp = logprobs(x).detach()
                exact = float((ref.exp() * (ref - lp)).sum(1).mean())
                assert abs(float(pred[l, p, h]) - exact) < 0.15 * exact, (l, p, h, float(pred[l, p, h]), exact)


@pytest.mark.parametrize(
    "args, why",
    [
        (["--budget-level", "nope"], "unknown codec level 'nope'"),
        (["--level", "nah"], "unknown codec level 'nah'"),
        (["--fisher", "-1"], "--fisher must be >= 1"),
    ],
)
def test_bad_options_fail_at_once_naming_the_problem(tmp_path, capsys, args, why):
    # before any sensitivity pass (an hour here) or rate model is started
    with pytest.raises(SystemExit) as e:
        HA.main([*args, "--sens-json", str(tmp_path / "absent.json")])
    assert e.value.code == 2 and why in capsys.readouterr().err
