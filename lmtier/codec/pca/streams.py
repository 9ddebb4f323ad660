"""The rANS streams of a PCA record on a CUDA device: one coder call per (layer group, K/V) stream
with that stream's ``N`` tables (the format restarts table ids at 0 in each stream), all queued on
the current stream and synchronized once, instead of :func:`lmtier.codec.rans.encode` /
:func:`~lmtier.codec.rans.decode` (one synchronization each). Same bytes and symbols.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from lmtier.codec import rans

__all__ = ["encode", "decode", "run_length"]


def run_length(tokens: int) -> int:
    """``T32``: a chunk's token count rounded up to the coder's lanes: the length of each component's
    run of symbols (one table each) in a PCA record's streams."""
    return -(-tokens // rans.LANES) * rans.LANES


def _on(dev: torch.device):
    """The native coder launches on the current device: make ``dev`` current (host tensors: no-op)."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def encode(sym: torch.Tensor, tables: torch.Tensor, run_len: int) -> list[np.ndarray]:
    """Encoded bytes (host uint8 arrays) of each row of ``sym``.

    Args:
        sym: uint8 ``[S, N * run_len]`` on a CUDA device, row ``i`` coded with ``tables[i * N :
            (i + 1) * N]``, one table per run of ``run_len`` symbols.
        tables: uint16 ``[S * N, 256]`` on the same device.

    Raises:
        ValueError: a coder status other than ok (bad tables).
    """
    with _on(sym.device):
        return _encode(sym, tables, run_len)


def _encode(sym: torch.Tensor, tables: torch.Tensor, run_len: int) -> list[np.ndarray]:
    s_count, length = sym.shape
    n = tables.shape[0] // s_count
    dev = sym.device
    bound = -(-rans.max_batch_encoded_bytes(1, length) // 256) * 256  # rows 4-byte aligned, as the coder needs
    out = torch.empty(s_count, bound, dtype=torch.uint8, device=dev)
    offsets = torch.empty(s_count, 2, dtype=torch.int64, device=dev)
    status = torch.empty(s_count, dtype=torch.int32, device=dev)
    scratch = torch.empty(rans.encode_scratch_bytes(1, length), dtype=torch.uint8, device=dev)  # calls run in order
    for i in range(s_count):
        rans.encode_into(
            [sym[i]],
            0,
            tables[i * n : (i + 1) * n],
            out=out[i],
            offsets=offsets[i],
            status=status[i : i + 1],
            scratch=scratch,
            run_lens=run_len,
        )
    rans._raise_status(status.cpu().numpy(), "encode")
    sizes = offsets[:, 1].cpu().numpy()
    flat = torch.cat([out[i, : int(sizes[i])] for i in range(s_count)]).cpu().numpy()
    ends = np.cumsum(sizes)
    return [flat[e - z : e] for z, e in zip(sizes, ends)]


def decode(sections: list, tables: torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[S, length]`` on ``device``: the symbols of encoded streams (host bytes-like) with the
    table layout of :func:`encode`; uploaded in one copy.

    Raises:
        ValueError: a stream that does not decode, or not to ``length`` symbols.
    """
    with _on(device):
        return _decode(sections, tables, length, device)


def _decode(sections: list, tables: torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    s_count = len(sections)
    n = tables.shape[0] // s_count
    sizes = [memoryview(s).nbytes for s in sections]
    starts = np.concatenate([[0], np.cumsum([-(-z // 4) * 4 for z in sizes])])  # 4-byte aligned sources
    host = np.zeros(int(starts[-1]), np.uint8)
    for st, s, z in zip(starts, sections, sizes):
        host[st : st + z] = np.frombuffer(s, np.uint8)
    src = torch.from_numpy(host).to(device)
    out = torch.empty(s_count, length, dtype=torch.uint8, device=device)
    got = torch.empty(s_count, dtype=torch.int64, device=device)
    status = torch.empty(s_count, dtype=torch.int32, device=device)
    scratch = torch.empty(rans.decode_scratch_bytes(1), dtype=torch.uint8, device=device)
    for i in range(s_count):
        rans.decode_into(
            [src[int(starts[i]) : int(starts[i]) + sizes[i]]],
            tables[i * n : (i + 1) * n],
            outs=[out[i]],
            out_lengths=got[i : i + 1],
            status=status[i : i + 1],
            scratch=scratch,
        )
    rans._raise_status(status.cpu().numpy(), "decode")
    counts = got.cpu().numpy()
    if (counts != length).any():
        raise ValueError(f"rANS streams of {sorted(set(counts.tolist()))} symbols, {length} expected")
    return out
