"""Dropout on the host: the stream tensor the kernels draw the keep-mask from, and the
keep-mask a call with a seed applies (dropout_stream.py draws the seed, and computes the same
mask in plain PyTorch)."""

from __future__ import annotations

import torch

from ..dropout_stream import draw_seed
from .device import is_interpreter
from .limits import KERNEL_LIMITS, MAX_GRID_YZ
from .shapes import bh_chunks, cdiv
from .tl.dropout import _dropout_mask_kernel

# The kernels' ``Seed`` argument: int64 [seed, first row, first key, the whole call's Sq, Sk]
# (tl/common.py _load_stream); lengths 0 are the call's own, so a plain call's is [seed, 0, 0, 0, 0]
STREAM_LEN = 5


def draw_stream(device) -> torch.Tensor:
    """A plain call's stream: a new seed (draw_seed's draw: the same seed for the same torch
    generator state) at offset 0 of the call itself; no host values copied."""
    stream = torch.zeros(STREAM_LEN, device=device, dtype=torch.int64)
    draw_seed(device, out=stream[:1])
    return stream


def positioned_stream(
    seed: torch.Tensor,
    heads_q: int,
    batch_offset: int,
    row_offset: int,
    col_offset: int,
    seqlen_q: int,
    seqlen_k: int,
    block: tuple[int, int],
) -> torch.Tensor:
    """The stream of a call of ``block`` = (Sq, Sk) that is the block at (batch_offset,
    row_offset, col_offset) of a call of lengths seqlen_q x seqlen_k and ``heads_q`` query heads
    (dropout_stream.DropoutStream), on ``seed``'s device.  ``col_offset`` must be a multiple
    of 4 (the kernels draw four keys' lanes per Philox counter)."""
    if col_offset % KERNEL_LIMITS.dropout_column_multiple:
        raise ValueError(
            f"dropout stream col_offset={col_offset}: the triton kernels draw a block's keep-mask at a "
            f"column offset that is a multiple of {KERNEL_LIMITS.dropout_column_multiple} (one Philox draw "
            "covers 4 keys)"
        )
    if min(batch_offset, row_offset, col_offset) < 0 or seqlen_q <= 0 or seqlen_k <= 0:
        raise ValueError(
            f"dropout stream offsets ({batch_offset}, {row_offset}, {col_offset}) and lengths "
            f"({seqlen_q}, {seqlen_k}): offsets >= 0 and lengths > 0 expected"
        )
    if row_offset + block[0] > seqlen_q or col_offset + block[1] > seqlen_k:
        raise ValueError(
            f"dropout stream: a block of {block[0]} x {block[1]} at ({row_offset}, {col_offset}) does not "
            f"fit in the whole call's {seqlen_q} x {seqlen_k}"
        )
    # the batch offset folded into the row: the kernels count rows as (b * Hq + h) * Sq + i
    position = torch.tensor(
        [batch_offset * heads_q * seqlen_q + row_offset, col_offset, seqlen_q, seqlen_k], dtype=torch.int64
    )
    return torch.cat([seed.reshape(1).to(torch.int64), position.to(seed.device, non_blocking=True)])


def _as_stream(seed: torch.Tensor) -> torch.Tensor:
    """A seed (1,) as a plain call's stream; a stream (the forward's) unchanged."""
    if seed.numel() == STREAM_LEN:
        return seed.to(torch.int64)
    return torch.cat([seed.reshape(1).to(torch.int64), seed.new_zeros(STREAM_LEN - 1, dtype=torch.int64)])


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
    (an int64 (1,) seed, or the forward's stream: its position too) is given."""
    device = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() and not is_interpreter() else "cpu")
    )
    out = torch.empty((batch, num_heads, seqlen_q, seqlen_k), device=device, dtype=torch.uint8)
    if dropout_p <= 0:
        return out.fill_(1).bool()
    seed = draw_stream(device) if seed is None else _as_stream(seed.to(device))
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
