"""Fused kernels for weight transfer on GPUs (Triton; ROCm builds of torch report the same device
type and Triton runs there too).

``rows_checksum`` computes the row part of :func:`unisleep.transfer.manifest.checksum` —
``sum(rs) * K1 + sum(cumsum(rs)) * K2`` over 4 KiB row sums ``rs`` — in one pass, as
``sum_i rs_i * (K1 + (rows - i) * K2)`` (the same value modulo 2**64, so a GPU and a CPU end
agree bit for bit).  Imported only when Triton is available; otherwise the torch ops run.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROWS_PER_PROGRAM = 8


@triton.jit
def _rows_kernel(x_ptr, out_ptr, rows, k1, k2, R: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * R + tl.arange(0, R)
    cols = tl.arange(0, W)
    offs = r[:, None].to(tl.int64) * W + cols[None, :]
    x = tl.load(x_ptr + offs, mask=(r < rows)[:, None], other=0)
    rs = tl.sum(x, axis=1)
    w = k1 + (rows - r).to(tl.int64) * k2
    tl.store(out_ptr + pid, tl.sum(rs * w, axis=0))


def rows_checksum(words, rows: int, row_words: int, k1: int, k2: int):
    """0-d int64 tensor: ``sum_i rowsum_i * (k1 + (rows - i) * k2)`` for ``words`` (int64, at
    least ``rows * row_words`` long), wrapping modulo 2**64."""
    import torch

    progs = -(-rows // ROWS_PER_PROGRAM)
    out = torch.empty(progs, dtype=torch.int64, device=words.device)
    _rows_kernel[(progs,)](words, out, rows, k1, k2, R=ROWS_PER_PROGRAM, W=row_words)
    return out.sum()
