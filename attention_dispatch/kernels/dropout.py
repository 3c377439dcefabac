"""Dropout on the host: the keep-mask a call with a seed applies (dropout_stream.py draws the
seed, and computes the same mask in plain PyTorch)."""

from __future__ import annotations

import torch

from ..dropout_stream import draw_seed
from .device import is_interpreter
from .limits import MAX_GRID_YZ
from .shapes import bh_chunks, cdiv
from .tl.dropout import _dropout_mask_kernel


def dropout_keep_mask(
    batch: int,
    num_heads: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p: float,
    device=None,
    *,
    seed: torch.Tensor | None = None,
    max_grid: int = 0,
) -> torch.Tensor:
    """Bool keep-mask (batch, num_heads, seqlen_q, seqlen_k) that a forward call with the same
    shapes and ``dropout_p`` uses right after the same ``torch.manual_seed``.

    Varlen: pass batch = number of sequences and seqlen_q/k = max_seqlen_q/k; element
    [b, h, i, j] is the mask of local query i / local key j of sequence b.  The seed is drawn
    exactly like the forward draws it (one int64 from the device generator), unless ``seed``
    (the forward's seed tensor) is given."""
    device = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() and not is_interpreter() else "cpu")
    )
    out = torch.empty((batch, num_heads, seqlen_q, seqlen_k), device=device, dtype=torch.uint8)
    if dropout_p <= 0:
        return out.fill_(1).bool()
    if seed is None:
        seed = draw_seed(device)
    if out.numel() == 0:
        return out.bool()
    bm, bn = (16, 32) if is_interpreter() else (64, 64)
    n_bh = batch * num_heads
    for start, cnt in bh_chunks(n_bh, num_heads, max_grid or MAX_GRID_YZ):
        _dropout_mask_kernel[(cdiv(seqlen_q, bm), cnt)](
            out,
            seed,
            float(dropout_p),
            seqlen_q * seqlen_k,
            seqlen_k,
            num_heads,
            seqlen_q,
            seqlen_k,
            start,
            BLOCK_M=bm,
            BLOCK_N=bn,
        )
    return out.bool()
