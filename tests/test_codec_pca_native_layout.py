"""The buffers of the native PCA decode (:mod:`lmtier.codec.pca.native_decode`), on the host: the
workspace regions are aligned and disjoint and hold what the native call writes; the checks read back
name a failed stream, a wrong count and escape symbols as the Python-driven path does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtier.codec import rans
from lmtier.codec.pca import kernels, native_decode, streams


@pytest.mark.parametrize(("rows", "n", "t"), [(32, 1024, 256), (8, 4096, 256), (3, 64, 40), (1, 4, 1)])
def test_layout_regions_are_aligned_disjoint_and_big_enough(rows, n, t):
    n8, p8 = -(-n // 8) * 8, -(-n // 8) * 8
    lay = native_decode.layout(rows, n, t, n8, p8)
    s, t32 = 2 * rows, streams.run_length(t)
    gpb = lay.groups_per_batch
    assert gpb == kernels._slices(rows, t, p8)[0][1]
    need = {
        "sym": s * n * t32,
        "lo": s * t * n8,
        "rowsum": rows * 2 * t * 8,
        "esc_row": (rows * 2 * t + 1) * 4,
        "y": 2 * gpb * t * 2 * p8 * 4,
        "scratch": len(streams.batches(s, n)) * lay.scratch_bytes,
        "gemm": kernels.GEMM_WORKSPACE,
        "esc_scratch": native_decode.escape_scratch_bytes(rows, n, t),
        "status": 4 * s,
        "counts": 8 * s,
        "esc_count": 4,
    }
    spans = sorted((getattr(lay, k), getattr(lay, k) + v, k) for k, v in need.items())
    for (_, a1, ka), (b0, _, kb) in zip(spans, spans[1:]):
        assert a1 <= b0, (ka, kb)
    assert spans[-1][1] == lay.checks_end <= lay.upload
    for k in ("sym", "lo", "rowsum", "esc_row", "y", "scratch", "gemm", "esc_scratch", "status", "upload"):
        assert getattr(lay, k) % 256 == 0, k
    assert lay.counts % 8 == 0 and lay.payload % 256 == 0 and lay.payload >= s * rans.DECODE_DESC.itemsize
    assert lay.scratch_bytes >= rans.decode_scratch_bytes(lay.streams_per_call)


def test_layout_follows_the_gemm_batches(monkeypatch):
    p8 = 1024
    whole = native_decode.layout(32, 1024, 256, 1024, p8)
    monkeypatch.setattr(kernels, "GEMM_BYTES", 2 * 256 * 2 * p8 * 4)  # one layer group a batch
    one = native_decode.layout(32, 1024, 256, 1024, p8)
    assert (whole.groups_per_batch, one.groups_per_batch) == (16, 1)
    assert one.gemm - one.y < whole.gemm - whole.y and one.upload < whole.upload


def _checks(status, counts, esc, announced=0):
    """Checks of a record of ``len(status)`` streams and ``announced`` escapes as
    ``native_decode.queue`` builds them from its layout, and the bytes of its workspace's check region
    holding ``status``, ``counts``, ``esc`` (the escape symbols found)."""
    lay = native_decode.layout(len(status) // 2, 16, 32, 16, 16)
    chk = native_decode.Checks(len(status), 512, lay.counts - lay.status, lay.esc_count - lay.status, announced)
    got = np.zeros(lay.checks_end - lay.status, np.uint8)
    got[: 4 * len(status)].view(np.int32)[:] = status
    got[chk.counts : chk.counts + 8 * len(counts)].view(np.int64)[:] = counts
    got[chk.esc_count :].view(np.int32)[:] = esc
    return chk, got


def test_checks_pass_and_name_what_is_wrong():
    chk, got = _checks([0, 0, 0, 0], [512] * 4, 0)
    chk.verify(got)
    chk, got = _checks([0, 2, 0, 0], [512] * 4, 0)
    with pytest.raises(ValueError, match=r"rans decode failed for 1 stream\(s\): stream 1: "):
        chk.verify(got)
    chk, got = _checks([0, 0, 0, 0], [512, 500, 512, 512], 0)
    with pytest.raises(ValueError, match=r"rANS streams of \[500, 512\] symbols, 512 expected"):
        chk.verify(got)
    chk, got = _checks([0, 0, 0, 0], [512] * 4, 3)
    with pytest.raises(ValueError, match="3 escape symbols, 0 announced"):
        chk.verify(got)
    chk, got = _checks([0, 0, 0, 0], [512] * 4, 3, announced=3)
    chk.verify(got)
    chk, got = _checks([0, 0, 0, 0], [512] * 4, 3, announced=2)
    with pytest.raises(ValueError, match="3 escape symbols, 2 announced"):
        chk.verify(got)


def test_not_available_without_a_device_build_or_cublas(monkeypatch):
    monkeypatch.setattr(native_decode, "_state", {**native_decode._state, "enabled": True, "disabled": ""})
    assert native_decode.available() == (
        kernels.available() and hasattr(kernels._native(), "decode_record")
        and not kernels._native().cublas_library().startswith("none")
    )  # fmt: skip


def test_on_by_default_and_enabled_blocks_restore(monkeypatch):
    import subprocess
    import sys

    code = "from lmtier.codec.pca import native_decode as n; print(n._state)"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "{'enabled': True, 'disabled': ''}"  # a new process: on
    monkeypatch.setattr(native_decode, "_state", {**native_decode._state, "enabled": True, "disabled": ""})
    with native_decode.enabled(False):
        assert not native_decode.available()
        with native_decode.enabled():
            assert native_decode._state["enabled"]
        assert not native_decode._state["enabled"]
    assert native_decode._state["enabled"]


@pytest.mark.skipif(not kernels.available(), reason="a build without the CUDA kernels")
def test_the_native_host_part_refuses_what_does_not_fit_before_touching_a_device():
    """``decode_record`` with a payload to stage checks the sections, the exact tokens' indices, the
    regions and the checks' size before any CUDA call (so on this GPU-less host too), each refusal
    naming what is wrong; without a payload it needs the caller's descriptors."""
    c = kernels._native()
    s, t = 4, 64  # 2 layer groups of one layer, H = 1, D = 8: N = 8
    lay = native_decode.layout(2, 8, t, 8, 8)
    payload = np.zeros(4096, np.uint8)
    offs = np.array([0, 256, 512, 768, 1024, 1032, 1040], np.int64)
    lens = np.array([200, 200, 200, 200, 0, 8, 2 * 2 * 2 * 8 * 3], np.int64)  # 3 exact tokens
    good = dict(
        dtype=c.DTYPE_BF16, L=2, T=t, H=1, D=8, G=1, t32=t, num_streams=s, tables_per_stream=8,
        streams_per_call=s, tables=1, run_luts=0, counts=1, status=1, scratch=1, scratch_bytes=1 << 20,
        sym=1, escapes=0, num_escapes=0, esc_col=0, esc_hi=0, esc_scratch=1, lo=1, rowsum=1, esc_count=1,
        esc_row=1, y=1, groups_per_batch=2, p8=8, dcat=1, f=1, mu=1, cos_t=0, sin_t=0, out=1,
        gemm_workspace=1, gemm_workspace_bytes=1, stream=0, payload=payload, offs=offs, lens=lens,
        exact_idx=np.array([0, 5, 9], np.int64), upload=1 << 20, payload_at=lay.payload,
        idx_at=lay.payload + 1232, checks=1, checks_bytes=lay.checks_end - lay.status,
    )  # fmt: skip
    cases = {
        "4-byte aligned": dict(offs=offs + np.array([0, 2, 0, 0, 0, 0, 0])),
        "outside the payload": dict(lens=lens + np.array([0, 0, 0, 9000, 0, 0, 0])),
        "indices must rise": dict(exact_idx=np.array([0, 9, 5], np.int64)),
        "exact token index 2 is 64": dict(exact_idx=np.array([0, 5, 64], np.int64)),
        "3 exact tokens in a section of": dict(lens=lens - np.array([0, 0, 0, 0, 0, 0, 2])),
        "bytes of checks": dict(checks_bytes=good["checks_bytes"] + 4),
        "index at": dict(idx_at=lay.payload + 1232 + 16),
        "7 sections": dict(offs=offs[:-1]),
    }
    for says, bad in cases.items():
        with pytest.raises(ValueError, match=says):
            c.decode_record(**{**good, **bad})
    with pytest.raises(TypeError):  # the payload is not optional
        c.decode_record(**{k: v for k, v in good.items() if k not in ("payload",)})
    if not torch.cuda.is_available():  # the good arguments pass every check and reach the device
        with pytest.raises(RuntimeError, match="cuda"):
            c.decode_record(**good)
